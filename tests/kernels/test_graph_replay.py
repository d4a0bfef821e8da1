"""Decode steps replayed from (fake) CUDA graphs through the Triton kernels under the
interpreter: the static buffers, the padding rows (slot -1, one token of context) and the
one-pass decode that a graph captures give the eager greedy tokens. tests/test_cuda_graphs.py
covers the rest on the torch kernels; a real GPU's capture is gpu_check's graphs section."""

from __future__ import annotations

import pytest

from pageserve.runtime import LLM, SamplingParams
from pageserve.runtime import model_runner
from tests.fake_cuda import FakeCuda

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("weights", ["dense", "w4a16"])
def test_triton_graph_replays_give_the_eager_tokens(tiny_model_dir, device, monkeypatch, tmp_path, weights):
    """w4a16: a 4-bit checkpoint's layers through the Triton W4A16 GEMM (split-K at these
    batch sizes) inside the captured steps."""
    if device == "cuda":
        pytest.skip("a real GPU captures real graphs: gpu_check's graphs section")
    if weights == "w4a16":
        from pageserve.loadtest.quantized_copy import quantized_copy

        tiny_model_dir = quantized_copy(tiny_model_dir, tmp_path / "w4", "ct-w4a16-asym", group_size=32)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 9)]
    lengths = [7, 3, 5]  # decode batches of 3, 2 and 1: 3 replays at size 4, padded
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths]
    kw = dict(dtype="float32", device=device, attention_backend="triton", kv_cache_memory=0.004,
              swap_space=0, max_num_batched_tokens=64, max_num_seqs=4, seed=0)
    want = [o.outputs[0].token_ids for o in LLM(str(tiny_model_dir), **kw).generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(model_runner, "device_for", lambda device: FakeCuda())
    llm = LLM(str(tiny_model_dir), cuda_graph_sizes=[1, 2, 4], **kw)
    graphs = llm.engine.runner.graphs
    assert sorted(graphs.graphs) == [1, 2, 4]
    graphs.replays = 0
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want and [len(t) for t in got] == lengths
    assert graphs.replays >= 6  # every decode step: (7 - 1) steps hold a decode


def test_triton_graph_replays_with_lora_adapters(tiny_model_dir, device, monkeypatch, tmp_path):
    """Two adapters and the base model in the same decode batches: the Triton shrink and
    expand captured in the graphs read each replay's token groups from the static buffers
    (and a replay with no adapter token leaves the base model's rows alone)."""
    if device == "cuda":
        pytest.skip("a real GPU captures real graphs: gpu_check's graphs section")
    from pageserve.loadtest.tiny_lora import peft_adapter
    from pageserve.runtime import LoRARequest

    loras = [LoRARequest(f"a{i}", i + 1, str(peft_adapter(tiny_model_dir, tmp_path / f"a{i}", rank=8, seed=i)))
             for i in range(2)]
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 9, 4)]
    per_prompt = [loras[0], None, loras[1], loras[0]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (6, 3, 5, 2)]
    kw = dict(dtype="float32", device=device, attention_backend="triton", kv_cache_memory=0.004,
              swap_space=0, max_num_batched_tokens=64, max_num_seqs=4, seed=0, enable_lora=True, max_loras=2,
              max_lora_rank=8)
    eager = LLM(str(tiny_model_dir), enforce_eager=True, **{**kw, "attention_backend": "torch"})
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)]
    assert eager.generate(prompts[:1], params[0], use_tqdm=False)[0].outputs[0].token_ids != want[0]
    monkeypatch.setattr(model_runner, "device_for", lambda device: FakeCuda())
    llm = LLM(str(tiny_model_dir), cuda_graph_sizes=[1, 2, 4], **kw)
    graphs = llm.engine.runner.graphs
    graphs.replays = 0
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)]
    assert got == want
    assert graphs.replays >= 4
    alone = llm.generate(prompts[1:2], params[1], use_tqdm=False)  # base only: the groups emptied
    assert alone[0].outputs[0].token_ids == want[1]
