"""Multi-LoRA serving against PEFT: adapters made by PEFT on tiny random-weight models (rank 8
and 16, all seven target modules, one with rsLoRA; Phi-3's fused qkv_proj and gate_up_proj),
greedy tokens in float32 equal to PeftModel's, in one batch that mixes three adapters and the
base model; at most --max-loras adapters a step; the prefix cache kept apart per adapter;
preemption (swap and recompute) and n > 1 keeping each request's adapter; every adapter that
cannot be served refused with its reason."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from pageserve.loadtest.tiny_lora import peft_adapter, write_adapter
from pageserve.loadtest.tiny_model import build_tiny_model
from pageserve.runtime import LLM, LoRARequest, SamplingParams
from pageserve.runtime.engine import RequestFailedError
from pageserve.runtime.lora import LoRAError
from tests.conftest import assert_pool_clean
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.engine

PROMPTS = [[1, 5, 9, 13, 20, 40, 7, 77, 101, 3, 9, 250], [3, 4, 5, 6], [200, 17, 45, 90, 12, 300, 8]]
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# per architecture: the adapters' target modules (Phi-3's projections are fused in HF as in ours)
TARGETS = {"llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
           "qwen2": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
           "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
ADAPTERS = ((8, 16, False), (16, 32, False), (16, 8, True))  # rank, alpha, rsLoRA


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def make_adapters(base: Path, arch: str, root: Path) -> list[Path]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    return [peft_adapter(base, root / f"{arch}-r{rank}-{i}", rank, alpha, seed=10 + i, targets=TARGETS[arch],
                         use_rslora=rs, base_model=hf) for i, (rank, alpha, rs) in enumerate(ADAPTERS)]


def peft_greedy(base: Path, adapter: Path, prompts=PROMPTS) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32),
                                      str(adapter))
    return hf_greedy(base, prompts, NEW_TOKENS, hf_model=model)


@pytest.fixture(scope="module")
def llama_case(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-llama")
    base = build_tiny_model(root / "base", arch="llama")
    return base, make_adapters(base, "llama", root)


@pytest.fixture(scope="module")
def llama_llm(llama_case) -> LLM:
    """One engine on the Llama base, three slots, for the tests that need nothing else."""
    return lora_llm(llama_case[0])


def lora_llm(base: Path, **kw) -> LLM:
    kw.setdefault("max_loras", 3)
    kw.setdefault("kv_cache_memory", 0.01)
    kw.setdefault("max_lora_rank", 16)
    return LLM(str(base), dtype="float32", enable_lora=True, debug_checks=True, **kw)


def check_parity(base: Path, adapters: list[Path], llm: LLM) -> None:
    """Every adapter and the base model in one batch, each prompt's tokens as PEFT gives them alone."""
    expected = [peft_greedy(base, a) for a in adapters] + [hf_greedy(base, PROMPTS, NEW_TOKENS)]
    assert all(e != expected[-1] for e in expected[:-1]), "an adapter that changes nothing tests nothing"
    loras = [LoRARequest(f"a{i}", i + 1, str(a)) for i, a in enumerate(adapters)] + [None]
    prompts = [p for _ in loras for p in PROMPTS]
    per_prompt = [lora for lora in loras for _ in PROMPTS]
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=per_prompt))
    assert got == [t for e in expected for t in e]
    assert_pool_clean(llm.engine)


def test_llama_adapters_match_peft_in_one_mixed_batch(llama_case, llama_llm):
    base, adapters = llama_case
    check_parity(base, adapters, llama_llm)


@pytest.mark.parametrize("arch", ["qwen2", "phi3"])
def test_adapters_match_peft(tmp_path, arch):
    base = build_tiny_model(tmp_path / "base", arch=arch)
    # Phi-3's LongRoPE: HF's short factors are ours where the context fits the original one
    check_parity(base, make_adapters(base, arch, tmp_path), lora_llm(base, max_model_len=256))


def test_a_step_holds_at_most_max_loras_adapters(llama_case):
    """One slot and one adapter in host memory: the other is read again from disk each time
    its requests take the slot."""
    base, adapters = llama_case
    llm = lora_llm(base, max_loras=1, max_cpu_loras=1)
    manager = llm.engine.runner.lora
    seen = []
    batch = manager.batch

    def recording(requests, num_tokens):
        seen.append({r.lora.lora_int_id for r in requests if r.lora is not None})
        return batch(requests, num_tokens)
    manager.batch = recording
    loras = [LoRARequest("a0", 1, str(adapters[0])), LoRARequest("a1", 2, str(adapters[1])), None]
    per_prompt = [lora for lora in loras for _ in PROMPTS]
    got = tokens(llm.generate(PROMPTS * 3, GREEDY, use_tqdm=False, lora_request=per_prompt))
    assert max(len(s) for s in seen) == 1 and {1, 2} <= set().union(*seen)
    alone = [peft_greedy(base, adapters[0]), peft_greedy(base, adapters[1]), hf_greedy(base, PROMPTS, NEW_TOKENS)]
    assert got == [t for a in alone for t in a]


def test_prefix_cache_is_kept_apart_per_adapter(llama_case, llama_llm):
    base, adapters = llama_case
    llm = llama_llm
    llm.engine.kv.pool.reset_prefix_cache()
    a, b = (LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters[:2]))
    prompt = [list(range(3, 3 + 70))]  # four full blocks of 16
    fresh = {a: peft_greedy(base, adapters[0], prompt), b: peft_greedy(base, adapters[1], prompt),
             None: hf_greedy(base, prompt, NEW_TOKENS)}
    hits = []
    for lora in (a, b, None, a):
        out = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)[0]
        assert out.outputs[0].token_ids == fresh[lora][0]
        hits.append(out.metrics.num_cached_tokens)
    assert hits == [0, 0, 0, 64]  # only adapter a's second request found blocks: its own


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_each_request_adapter(llama_case, mode):
    from tests.test_prefix_and_swap import TINY_BLOCK_BYTES, workload

    base, adapters = llama_case
    prompts, params = workload(12, seed=5, lo=60, hi=200, out_lo=8, out_hi=24)
    loras = [LoRARequest(f"a{i % 3}", i % 3 + 1, str(adapters[i % 3])) if i % 4 else None for i in range(12)]
    roomy = lora_llm(base, max_model_len=512, enable_prefix_caching=False)
    expected = tokens(roomy.generate(prompts, params, use_tqdm=False, lora_request=loras))
    tight = lora_llm(base, max_model_len=512, kv_cache_memory=40 * TINY_BLOCK_BYTES / 2 ** 30,
                     swap_space=(14 if mode == "swap" else 0) * TINY_BLOCK_BYTES / 2 ** 30,
                     preemption_mode=mode, max_num_batched_tokens=128)
    assert tokens(tight.generate(prompts, params, use_tqdm=False, lora_request=loras)) == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert_pool_clean(tight.engine)


def test_n_above_one_keeps_the_adapter(llama_case, llama_llm):
    base, adapters = llama_case
    lora = LoRARequest("a0", 1, str(adapters[0]))
    llm = llama_llm
    alone = tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=lora))[0]
    out = llm.generate(PROMPTS[:1], SamplingParams(n=3, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                       use_tqdm=False, lora_request=lora)[0]
    assert [c.token_ids for c in out.outputs] == [alone] * 3



def test_adapters_under_async_scheduling(llama_case, llama_llm):
    """Decodes run ahead of their tokens under the adapters they were admitted with: each prompt's
    tokens as without async scheduling, in a batch mixing three adapters and the base model."""
    base, adapters = llama_case
    loras = [LoRARequest(f"a{i}", i + 1, str(a)) for i, a in enumerate(adapters)] + [None]
    prompts = [p for _ in loras for p in PROMPTS]
    per_prompt = [lora for lora in loras for _ in PROMPTS]
    want = tokens(llama_llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=per_prompt))
    llm = lora_llm(base, async_scheduling=True)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=per_prompt)) == want
    assert_pool_clean(llm.engine)

def run_served(engine, requests) -> tuple[dict, dict]:
    """Add (request id, prompt, adapter) as the server does (the adapter not read on the way
    in), step until done: (tokens by id, error by id)."""
    for rid, prompt, lora in requests:
        engine.add_processed(dataclasses.replace(engine.inputs.process(prompt, GREEDY), lora=lora), rid)
    done, failed = {}, {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
        failed.update(engine.take_failures())
    return done, failed


def test_a_live_request_keeps_its_adapter_and_a_lost_one_fails_alone(llama_case, tmp_path):
    """Host memory for one adapter (--max-cpu-loras 1), one slot, two adapters: each stays in
    host memory while a request runs under it, so its files can go meanwhile; once idle it
    leaves, and a new request naming it fails alone before its step while its batch-mates (the
    other adapter, the base model) run on."""
    base, adapters = llama_case
    a0, a1 = (LoRARequest(f"a{i}", i + 1, str(shutil.copytree(a, tmp_path / f"a{i}")))
              for i, a in enumerate(adapters[:2]))
    want = {"0": peft_greedy(base, adapters[0], PROMPTS[:1])[0], "1": peft_greedy(base, adapters[1], PROMPTS[1:2])[0],
            "base": hf_greedy(base, PROMPTS[2:], NEW_TOKENS)[0]}
    engine = lora_llm(base, max_loras=1, max_cpu_loras=1).engine
    manager = engine.runner.lora
    engine.add_processed(dataclasses.replace(engine.inputs.process(PROMPTS[0], GREEDY), lora=a0), "0")
    engine.add_processed(dataclasses.replace(engine.inputs.process(PROMPTS[1], GREEDY), lora=a1), "1")
    engine.step()  # a0's request runs; a1's waits for the slot, its adapter read all the same
    assert sorted(manager.in_host) == [1, 2]
    shutil.rmtree(a1.lora_path)
    done, failed = run_served(engine, [])
    assert done == {"0": want["0"], "1": want["1"]} and not failed
    assert manager.in_host == [2]  # the least recently pinned
    run_served(engine, [("again", PROMPTS[0], a0)])
    assert manager.in_host == [1]
    done, failed = run_served(engine, [("lost", PROMPTS[1], a1), ("0", PROMPTS[0], a0), ("base", PROMPTS[2], None)])
    assert done == {"0": want["0"], "base": want["base"]}
    assert list(failed) == ["lost"] and isinstance(failed["lost"], RequestFailedError)
    assert "adapter_config.json" in str(failed["lost"]) or "does not exist" in str(failed["lost"])
    assert_pool_clean(engine)


def test_an_adapter_removed_under_a_running_request_goes_when_it_ends(llama_case, llama_llm, tmp_path):
    """Unloaded while its request runs (its files gone too): the request ends as it began, and
    the adapter is gone with it; an id used again then reads its new directory."""
    base, adapters = llama_case
    lora = LoRARequest("gone", 7, str(shutil.copytree(adapters[0], tmp_path / "gone")))
    engine = llama_llm.engine
    engine.add_processed(dataclasses.replace(engine.inputs.process(PROMPTS[0], GREEDY), lora=lora), "r")
    engine.step()
    engine.remove_lora(lora.lora_int_id)
    shutil.rmtree(lora.lora_path)
    done, failed = run_served(engine, [])
    assert done == {"r": peft_greedy(base, adapters[0], PROMPTS[:1])[0]} and not failed
    assert 7 not in engine.runner.lora.in_host
    # an idle adapter removed goes at once: the same id then serves other weights
    again = LoRARequest("again", 8, str(adapters[0]))
    run_served(engine, [("a", PROMPTS[0], again)])
    assert 8 in engine.runner.lora.in_host
    engine.remove_lora(8)
    assert 8 not in engine.runner.lora.in_host
    done, _ = run_served(engine, [("b", PROMPTS[0], LoRARequest("again", 8, str(adapters[1])))])
    assert done == {"b": peft_greedy(base, adapters[1], PROMPTS[:1])[0]}
    assert_pool_clean(engine)


def test_adapters_that_cannot_be_served_are_refused(llama_case, llama_llm, tiny_llm, tmp_path):
    base, adapters = llama_case
    llm = llama_llm
    good = adapters[0]

    def refused(path, match, name="bad"):
        with pytest.raises(LoRAError, match=match):
            llm.engine.add_lora(LoRARequest(name, 99, str(path)))

    refused(tmp_path / "missing", "does not exist")
    refused(write_adapter(tmp_path / "r32", {"q_proj": (64, 64)}, 2, rank=32), "rank 32, above --max-lora-rank 16")
    refused(write_adapter(tmp_path / "other-lora", {"q_proj": (32, 32)}, 2, rank=8), "another base model")
    for key, value, match in (("modules_to_save", ["lm_head"], "modules_to_save"), ("use_dora", True, "DoRA"),
                              ("bias", "all", "trained biases")):
        odd = tmp_path / key
        odd.mkdir()
        (odd / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
        config = json.loads((good / "adapter_config.json").read_text())
        config[key] = value
        (odd / "adapter_config.json").write_text(json.dumps(config))
        refused(odd, match)
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    (torn / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    refused(torn, "cannot be read")
    # the engine serves on, the good adapter included
    assert tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("a0", 1, str(good))))
    with pytest.raises(LoRAError, match="--enable-lora"):  # an engine without adapters
        tiny_llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("a0", 1, str(good)))


def test_lora_alpha_defaults_to_peft_s(tmp_path):
    """An adapter_config.json without lora_alpha scales by PEFT's default alpha, 8, over r."""
    from pageserve.runtime.lora.adapter import Target, load_adapter

    def scaled_b(path):
        return load_adapter("a", path, {"0.o_proj": Target(32, (32,))}, max_rank=8).weights["0.o_proj"][0][1]

    given = write_adapter(tmp_path / "given", {"o_proj": (32, 32)}, 1, rank=4, alpha=32)
    bare = write_adapter(tmp_path / "bare", {"o_proj": (32, 32)}, 1, rank=4)  # the same weights
    config = json.loads((bare / "adapter_config.json").read_text())
    del config["lora_alpha"]
    (bare / "adapter_config.json").write_text(json.dumps(config))
    assert torch.allclose(scaled_b(bare) * 4, scaled_b(given))  # 8 / 4 against 32 / 4


def test_the_c_kernel_adds_what_the_torch_path_adds(native_kernels):
    """Ragged groups listed out of slot order, base tokens between them, three slices of
    different sizes (q/k/v) and one; float32 sums in another order: 1e-5."""
    from pageserve.triton_kernels import torch_ops

    g = torch.Generator().manual_seed(0)
    slots, rank, k = 4, 8, 40
    for sizes in ((32, 8, 8), (24,)):
        n = sum(sizes)
        slices = tuple((i * rank, sum(sizes[:i]), s) for i, s in enumerate(sizes))
        a = torch.randn(slots, len(sizes) * rank, k, generator=g)
        bt = torch.randn(slots, rank, n, generator=g)
        x, out = torch.randn(23, k, generator=g), torch.randn(23, n, generator=g)
        rows = torch.tensor([5, 6, 7, 0, 1, 2, 3, 20, 21, 10], dtype=torch.int64)
        groups = [(3, 0, 3), (0, 3, 4), (2, 7, 2), (1, 9, 1)]
        want = out.clone()
        torch_ops.lora_delta(want, x, a, bt, slices, rows, groups)
        got = out.clone()
        native_kernels.lora(got, x, a, bt, torch.tensor(slices), rows, torch.tensor(groups))
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        untouched = [r for r in range(23) if r not in rows.tolist()]
        assert torch.equal(got[untouched], out[untouched]) and not torch.equal(got, out)


def test_the_torch_path_matches_peft(llama_case):
    """Without the C kernels (--enforce-eager): the grouped torch path alone."""
    base, adapters = llama_case
    check_parity(base, adapters, lora_llm(base, enforce_eager=True))


def test_tensor_parallel_ranks_split_the_adapters_as_the_weights(llama_case):
    """Two ranks (gloo, worker processes): B split by rows where the projection is split by
    its outputs (q/k/v, gate/up), A by columns where by its inputs (o, down), the delta summed
    by the base matmul's all-reduce; the same tokens as PEFT, and a bad adapter refused by the
    ranks without stopping them."""
    base, adapters = llama_case
    llm = lora_llm(base, tensor_parallel_size=2)
    try:
        check_parity(base, adapters, llm)
        with pytest.raises(LoRAError, match="does not exist"):
            llm.engine.add_lora(LoRARequest("bad", 9, str(base / "missing")))
        alone = hf_greedy(base, PROMPTS[:1], NEW_TOKENS)[0]
        assert tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)) == [alone]
        # named by a request, not read before: the ranks fail that request alone, before its step
        done, failed = run_served(llm.engine, [("lost", PROMPTS[0], LoRARequest("lost", 10, str(base / "gone"))),
                                               ("base", PROMPTS[0], None)])
        assert done == {"base": alone} and list(failed) == ["lost"]
    finally:
        llm.engine.shutdown()
