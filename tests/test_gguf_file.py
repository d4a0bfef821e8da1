"""A GGUF file read tensor by tensor (runtime/models/gguf_file.py): a mixture of experts'
stacked expert tensors, the float32 copy the loadtest tools read, and a copy of some of a
file's layers (loadtest/truncated_copy.py)."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path

import pytest
import torch

from pageserve.loadtest.tiny_model import build_tiny_model
from pageserve.runtime import LLM, SamplingParams
from pageserve.runtime.kernels import Backend, make_kernels
from pageserve.runtime.models import registry
from pageserve.runtime.models.gguf_file import GGUFFile, dense_copy
from pageserve.runtime.models.weight_formats import GGUFBlocks
from pageserve.runtime.models.loader import read_config, resolve_model
from tests.hf_reference import hf_greedy
from tests.test_gguf_gemma import add_model_keys, hf_from_gguf, write_gguf

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.engine


# a checkpoint's expert matrices: (layer, expert, part); Qwen3-MoE's names, then Mixtral's
EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp\.experts\.(\d+)\.(gate|up|down)_proj"
                    r"|block_sparse_moe\.experts\.(\d+)\.(w1|w3|w2))\.weight")


def write_moe_gguf(model_dir: Path, out: Path, qtype_of=lambda name: gguf.GGMLQuantizationType.Q8_0,
                   arch: str = "qwen3moe") -> Path:
    """A tiny Qwen3-MoE (or Mixtral: arch "llama") as llama.cpp writes one: each layer's experts
    stacked into one [experts, rows, columns] tensor a projection (ffn_gate_exps, ffn_up_exps,
    ffn_down_exps), Llama's q and k rows permuted as llama.cpp does, the matrices in
    `qtype_of(name)` (Q8_0; None: float32) where their rows allow, the rest float32."""
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), arch=arch)
    add_model_keys(w, cfg, head_dim=arch == "qwen3moe")
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size", cfg["intermediate_size"]))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)

    def add(name: str, tensor: torch.Tensor) -> None:
        values = tensor.float().numpy()
        if values.ndim > 1 and values.shape[-1] % 32 == 0 and qtype_of(name) is not None:
            w.add_tensor(name, gguf.quants.quantize(values, qtype_of(name)), raw_dtype=qtype_of(name))
        else:
            w.add_tensor(name, values)

    names = gguf.TensorNameMap(getattr(gguf.MODEL_ARCH, arch.upper()), cfg["num_hidden_layers"])
    stacks: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        if m := EXPERT.fullmatch(name):
            layer, expert, part = int(m[1]), int(m[2] or m[4]), m[3] or {"w1": "gate", "w3": "up", "w2": "down"}[m[5]]
            stacks.setdefault((layer, part), {})[expert] = tensor
            continue
        heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}.get(name.split(".")[-2])
        if arch == "llama" and heads:  # llama.cpp's permute (each head's rotary halves interleaved)
            tensor = tensor.reshape(heads, 2, tensor.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(tensor.shape)
        add(names.get_name(name, try_suffixes=(".weight",)), tensor)
    for (layer, part), experts in sorted(stacks.items()):
        add(f"blk.{layer}.ffn_{part}_exps.weight", torch.stack([experts[e] for e in sorted(experts)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_a_moe_gguf_streams_its_stacked_experts(tmp_path, monkeypatch, own_cache, native_kernels):
    """transformers stacks a GGUF's experts into one gate_up tensor (gate rows first) and one
    down tensor; the stream gives them per expert, and the model serves HF's greedy tokens on
    the experts' own blocks (Q8_0 gate beside Q4_1 up: w13 in x8; Q4_0 down), each expert's
    matrix HF's to the bit, and the same tokens on the dequantized float32 copy."""
    Q = gguf.GGMLQuantizationType
    # transformers reads no moe_intermediate_size from a GGUF: the config class's default, 768
    model_dir = build_tiny_model(tmp_path / "hf", arch="qwen3_moe", moe_intermediate_size=768)
    path = write_moe_gguf(model_dir, tmp_path / "tiny-moe.gguf", lambda name: Q.Q4_1 if "up_exps" in name
                          else Q.Q4_0 if "down_exps" in name else Q.Q8_0)
    hf = hf_from_gguf(path)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 30, 70)]
    expected = hf_greedy(None, prompts, max_new_tokens=10, hf_model=hf)

    def run():
        llm = LLM(str(path), dtype="float32", kv_cache_memory=0.01, max_num_batched_tokens=64)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
        run.cfg = llm.engine.runner.model_cfg
        return llm.engine.runner.model.layers[1].mlp.experts, [o.outputs[0].token_ids for o in outs]

    ours, tokens = run()
    assert tokens == expected
    theirs = hf.model.layers[1].mlp.experts
    assert ours.w13.dtype == torch.uint8 and [ours.parts[p][0].block_format for p in ("w13", "w2")] == ["x8", "q4_0"]
    for part, want in (("w13", theirs.gate_up_proj), ("w2", theirs.down_proj)):
        assert torch.equal(torch.stack([native_kernels.widen(w) for w in ours.parts[part]]), want)
    monkeypatch.setattr(GGUFFile, "block_formats", lambda self: {})
    dense, dense_tokens = run()
    assert torch.equal(dense.w13, theirs.gate_up_proj) and torch.equal(dense.w2, theirs.down_proj)
    assert dense_tokens == tokens
    monkeypatch.undo()
    # the names a quantization method plans from (--quantization fp8) are the stream's, by expert
    file = GGUFFile(path, read_config(resolve_model(str(path))))
    names = file.checkpoint_names()
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in names
    assert names == {name: (tuple(t.shape), "F32") for name, t in file.stream()}
    formats = file.block_formats()
    assert formats["model.layers.0.mlp.experts.3.up_proj.weight"] == ("q4_1", 768, 64)
    def rank_experts(rank: int, keep: dict):  # a tensor-parallel rank's experts, loaded in this process
        with torch.device("meta"):
            model = registry.model_class(run.cfg.architecture)(dataclasses.replace(run.cfg, tp_size=2, tp_rank=rank),
                                                               make_kernels(Backend.TORCH, 16, 2, 1))
        kept = GGUFBlocks.plan(model, keep, names)
        model = model.to_empty(device="cpu")
        model.load_weights(file.stream(kept.names))
        kept.finish()
        return model.layers[1].mlp.experts

    for rank in (0, 1):  # each rank keeps its half of every expert's blocks: HF's values, sliced
        experts, dense = rank_experts(rank, formats), rank_experts(rank, {})
        assert experts.w13.shape == (4, 768, 64 // 32 * 48) and experts.w2.shape == (4, 64, 384 // 32 * 18)
        for part in ("w13", "w2"):
            assert torch.equal(torch.stack([native_kernels.widen(w) for w in experts.parts[part]]),
                               getattr(dense, part))
        assert torch.equal(dense.w2, theirs.down_proj[:, :, rank * 384:(rank + 1) * 384])
    sizes = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
    kept = {name: tuple(t.shape) for name, t in file.stream(dict.fromkeys(formats)) if name in formats}
    assert kept == {name: (rows, columns // 32 * sizes[fmt]) for name, (fmt, rows, columns) in formats.items()}


def test_a_mixtral_gguf_serves_the_checkpoint_it_was_written_from(tmp_path, monkeypatch, own_cache, native_kernels):
    """llama.cpp writes Mixtral as a "llama" with stacked experts, which transformers reads as a
    dense Llama (it reads no Mixtral GGUF): read as Mixtral (the experts' count and size from
    their tensors, the top-k from expert_used_count), a float32 file serves HF's greedy tokens on
    the checkpoint it was written from; a quantized one keeps its experts' blocks (Q8_0 gate and
    up: w13 in q8_0; Q4_0 down), each widening to the values its float32 copy loads, which gives
    the same tokens. The float32 copy of the file (gguf_file.dense_copy) is the same model in
    transformers."""
    Q = gguf.GGMLQuantizationType
    model_dir = build_tiny_model(tmp_path / "hf", arch="mixtral", intermediate_size=96, num_experts_per_tok=3)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 30, 70)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def run(path):
        llm = LLM(str(path), dtype="float32", kv_cache_memory=0.01, max_num_batched_tokens=64)
        cfg = llm.engine.runner.model_cfg.hf_config
        assert (cfg["model_type"], cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"]) \
            == ("mixtral", 4, 3, 96)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return llm.engine.runner.model.layers[1].mlp.experts, [o.outputs[0].token_ids for o in outs]

    f32 = write_moe_gguf(model_dir, tmp_path / "tiny-mixtral-f32.gguf", lambda name: None, "llama")
    _, tokens = run(f32)
    assert tokens == hf_greedy(model_dir, prompts, max_new_tokens=10)
    # the float32 copy the loadtest tools read is the checkpoint for transformers too, experts and all
    assert hf_greedy(resolve_model(str(f32)), prompts, max_new_tokens=10) == tokens
    path = write_moe_gguf(model_dir, tmp_path / "tiny-mixtral-q.gguf",
                          lambda name: Q.Q4_0 if "down_exps" in name else Q.Q8_0, "llama")
    ours, tokens = run(path)
    assert [ours.parts[p][0].block_format for p in ("w13", "w2")] == ["q8_0", "q4_0"]
    monkeypatch.setattr(GGUFFile, "block_formats", lambda self: {})
    dense, dense_tokens = run(path)
    for part in ("w13", "w2"):
        assert torch.equal(torch.stack([native_kernels.widen(w) for w in ours.parts[part]]), getattr(dense, part))
    assert dense_tokens == tokens


def test_a_mixtral_gguf_of_an_early_layout_is_refused_by_name(tmp_path, own_cache):
    """Experts each in tensors of their own (blk.N.ffn_gate.E.weight, llama.cpp's layout before it
    stacked them): one clear error, not a dense Llama missing its feed-forward."""
    from pageserve.runtime.models.loader import ModelLoadError

    cfg = json.loads((build_tiny_model(tmp_path / "hf", arch="llama") / "config.json").read_text())
    w = gguf.GGUFWriter(str(tmp_path / "early.gguf"), arch="llama")
    add_model_keys(w, cfg)
    w.add_tensor("token_embd.weight", torch.zeros(cfg["vocab_size"], cfg["hidden_size"]).numpy())
    w.add_tensor("blk.0.ffn_gate.0.weight", torch.zeros(cfg["intermediate_size"], cfg["hidden_size"]).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="each expert in tensors of its own"):
        resolve_model(str(tmp_path / "early.gguf"))


def test_a_moe_gguf_of_another_expert_size(tmp_path, own_cache):
    """transformers reads no expert size from a GGUF (it takes the config class's default,
    Qwen3-MoE's 768); the file's expert tensors' own is written into the config, also into a
    cache folder of an earlier version, so a Qwen3-MoE of 64-wide experts loads and serves the
    greedy tokens of HF on the checkpoint it was written from (float32 tensors: the same
    values)."""
    model_dir = build_tiny_model(tmp_path / "hf", arch="qwen3_moe", moe_intermediate_size=64)
    path = write_moe_gguf(model_dir, tmp_path / "tiny-moe.gguf", lambda name: None)
    folder = resolve_model(str(path))
    assert read_config(folder)["moe_intermediate_size"] == 64
    stale = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**stale, "moe_intermediate_size": 768}))
    assert read_config(resolve_model(str(path)))["moe_intermediate_size"] == 64
    prompts = [[5, 9, 200, 31], list(range(40, 80))]
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.01, max_num_batched_tokens=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model_dir, prompts, max_new_tokens=10)


def test_weights_load_from_the_file_asked_for(tmp_path, own_cache):
    """Two copies of a file share one cache folder; the weights load from the one asked for, so
    that a copy later overwritten with other weights is not read in its place."""
    from pageserve.runtime.models import loader

    model_dir = build_tiny_model(tmp_path / "hf", arch="llama")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = write_gguf(model_dir, tmp_path / "a" / "m.gguf", "llama")
    (tmp_path / "b" / "m.gguf").write_bytes(first.read_bytes())
    out = resolve_model(str(first))
    assert resolve_model(str(tmp_path / "b" / "m.gguf")) == out
    assert loader.gguf_source(out) == tmp_path / "b" / "m.gguf"
    write_gguf(build_tiny_model(tmp_path / "hf2", arch="llama", seed=1), first, "llama")  # other weights
    assert resolve_model(str(tmp_path / "b" / "m.gguf")) == out and loader.gguf_source(out) == tmp_path / "b" / "m.gguf"


def test_a_damaged_file_is_one_line(tmp_path):
    """A header cut short, or a tensor of a type gguf does not know: a ValueError naming it
    (the loader's one line), not a traceback from the parser."""
    from pageserve.runtime.models.gguf_file import read_header

    path = write_gguf(build_tiny_model(tmp_path / "hf", arch="llama"), tmp_path / "m.gguf", "llama")
    data = path.read_bytes()
    (tmp_path / "short.gguf").write_bytes(data[:200])
    with pytest.raises(ValueError, match="damaged GGUF header"):
        read_header(tmp_path / "short.gguf")
    arch, entries = read_header(path)
    at = data.index(entries[0].name.encode()) + len(entries[0].name) + 4 + 8 * len(entries[0].shape)
    bad = bytearray(data)
    bad[at:at + 4] = (250).to_bytes(4, "little")  # the first tensor's GGML type
    (tmp_path / "bad.gguf").write_bytes(bytes(bad))
    with pytest.raises(ValueError, match="GGML type 250"):
        read_header(tmp_path / "bad.gguf")


def test_the_tools_float32_copy(tmp_path, own_cache):
    """dense_copy: a GGUF model's weights as float32 safetensors (for loadtest's copies), written
    once, with its config and tokenizer and no pointer back to the file; a safetensors
    directory is its own."""
    from safetensors.torch import load_file

    path = write_gguf(build_tiny_model(tmp_path / "hf", arch="llama"), tmp_path / "tiny.gguf", "llama",
                      lambda name: gguf.GGMLQuantizationType.Q4_0 if name.endswith("ffn_up.weight") else None)
    model_dir = resolve_model(str(path))
    out = dense_copy(model_dir)
    assert out != model_dir and {"config.json", "tokenizer.json", "model.safetensors"} <= {f.name for f in
                                                                                          out.iterdir()}
    assert not (out / "gguf_source.txt").exists() and resolve_model(str(out)) == out
    written = load_file(out / "model.safetensors")
    streamed = dict(GGUFFile(path, read_config(model_dir)).stream())
    assert written.keys() == streamed.keys() and all(torch.equal(written[k], streamed[k]) for k in written)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert dense_copy(model_dir) == out and (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert dense_copy(out) == out


def test_some_layers_of_a_gguf_as_a_gguf(tmp_path, own_cache):
    """truncated_copy of a model read from a GGUF file writes a GGUF file of those layers,
    renumbered, each tensor's bytes as they were, and one layer fewer in its metadata."""
    from pageserve.loadtest.truncated_copy import truncated_copy

    path = write_gguf(build_tiny_model(tmp_path / "hf", arch="llama", num_hidden_layers=3), tmp_path / "tiny.gguf",
                      "llama", lambda name: gguf.GGMLQuantizationType.Q8_0 if name.startswith("blk.")
                      and "norm" not in name else None)
    copy = truncated_copy(resolve_model(str(path)), tmp_path / "draft", [0, 2])
    assert copy == tmp_path / "draft" / "model.gguf"
    full, cut = gguf.GGUFReader(path), gguf.GGUFReader(copy)
    assert cut.fields["llama.block_count"].contents() == 2
    assert cut.fields["tokenizer.ggml.tokens"].contents() == full.fields["tokenizer.ggml.tokens"].contents()
    theirs = {t.name: t for t in full.tensors}
    renamed = {"blk.0.": "blk.0.", "blk.1.": "blk.2."}
    assert len(cut.tensors) == len([t for t in full.tensors if not t.name.startswith("blk.1.")])
    for t in cut.tensors:
        source = theirs[next((v + t.name[len(k):] for k, v in renamed.items() if t.name.startswith(k)), t.name)]
        assert t.tensor_type == source.tensor_type and bytes(t.data) == bytes(source.data), t.name
    assert sum(t.tensor_type == gguf.GGMLQuantizationType.Q8_0 for t in cut.tensors) > 0
    llm = LLM(str(copy), dtype="float32", kv_cache_memory=0.01, max_num_batched_tokens=64)
    assert llm.engine.config.model.hf_config["num_hidden_layers"] == 2
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_tensor_parallel_ranks_keep_whole_blocks(tmp_path, own_cache):
    """Under tensor parallelism each rank keeps the blocks of its part where that part is whole
    blocks: q/k/v and gate/up split by rows, down_proj's 4 blocks of columns 2 a rank; o_proj's
    3 blocks of columns do not split in two, and it stays float32."""
    import gguf as gg

    from pageserve.runtime.config import ModelConfig

    model_dir = build_tiny_model(tmp_path / "hf", arch="llama", hidden_size=96, intermediate_size=128,
                                 num_attention_heads=4, num_key_value_heads=2)
    path = write_gguf(model_dir, tmp_path / "m.gguf", "llama",
                      lambda name: gg.GGMLQuantizationType.Q8_0 if name.startswith("blk.") and "norm" not in name
                      else None)
    hf = read_config(resolve_model(str(path)))
    file = GGUFFile(path, hf)
    for rank in (0, 1):
        cfg = ModelConfig(path="", architecture="LlamaForCausalLM", vocab_size=hf["vocab_size"], hidden_size=96,
                          intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=24,
                          rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None, max_position_embeddings=64,
                          tie_word_embeddings=False, qkv_bias=False, eos_token_ids=(0,), dtype=torch.float32,
                          max_model_len=64, hf_config=hf, tp_size=2, tp_rank=rank)
        with torch.device("meta"):
            model = registry.model_class("LlamaForCausalLM")(cfg, make_kernels(Backend.TORCH, 16, 2, 1))
        kept = GGUFBlocks.plan(model, file.block_formats(), file.checkpoint_names())
        layer = model.layers[0]
        assert {m for m, _, _, _ in kept.matrices} == {layer.self_attn.qkv_proj, layer.mlp.gate_up_proj,
                                                    layer.mlp.down_proj, model.layers[1].self_attn.qkv_proj,
                                                    model.layers[1].mlp.gate_up_proj, model.layers[1].mlp.down_proj}
        assert layer.mlp.down_proj.weight.shape == (96, 2 * 34) and layer.self_attn.o_proj.weight.dtype == torch.float32
