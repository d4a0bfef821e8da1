"""An all-sliding Mistral on the Triton backend (under the interpreter on CPU) with requests
longer than the whole KV pool: the blocks before the window are freed and their block-table
entries become placeholders, which the kernel never reads; greedy tokens equal the torch
backend's."""

from __future__ import annotations

import pytest

from pageserve.loadtest.tiny_model import build_tiny_model
from pageserve.runtime import LLM, SamplingParams
from tests.conftest import assert_pool_clean

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # the tiny model's 16-token block, float32


def generate(model_dir, device: str, backend: str) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model_dir), dtype="float32", device=device, attention_backend=backend,
              kv_cache_memory=6 * BLOCK_BYTES / 2 ** 30, max_num_batched_tokens=16, max_model_len=512,
              swap_space=0, debug_checks=True)
    prompts = [list(range(10, 80)), [9] * 21]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_pool_clean(llm.engine)
    return [o.outputs[0].token_ids for o in outs], llm


def test_freed_blocks_on_the_triton_backend(tmp_path, device):
    model_dir = build_tiny_model(tmp_path / "mistral", arch="mistral")
    want, _ = generate(model_dir, device, "torch")
    got, llm = generate(model_dir, device, "triton")
    assert llm.engine.runner.kernels.name == "triton" and llm.engine.kv.sliding_window == 12
    assert 70 + 30 > 6 * 16  # longer than the pool
    assert got == want
