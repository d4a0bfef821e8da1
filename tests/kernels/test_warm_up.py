"""Kernel warm-up (ModelRunner.warm_up_kernels) launches every variant serving can launch: after
it, a mixed load (chunked prefills beside decodes, a long decode alone, which takes the split-KV
path, and a grammar-constrained request) adds no variant. Variants are counted by their
specialization keys (triton_kernels.variants), which the interpreter lets us compute but not
compile: that the CUDA compile cache agrees is checked by loadtest/gpu_check.py."""

from __future__ import annotations

import pytest

from pageserve.runtime import LLM, SamplingParams
from pageserve.sampling.params import StructuredOutputsParams
from pageserve.triton_kernels.variants import VariantLog, launched_kernels

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def mixed_load(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in ([5, 6, 7], list(range(10, 90)), [9] * 33)],
                 greedy, use_tqdm=False)
    # a context past one 512-token partition, decoding alone: the split-KV decode and its reduce
    llm.generate([{"prompt_token_ids": [7] * 515}], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                 use_tqdm=False)
    choice = SamplingParams(temperature=0.0, max_tokens=4,
                            structured_outputs=StructuredOutputsParams(choice=["ab", "ba"]))
    llm.generate([{"prompt_token_ids": [4, 5]}], choice, use_tqdm=False)


def test_serving_compiles_nothing_after_warm_up(tiny_model_dir, device):
    with VariantLog() as log:
        llm = LLM(str(tiny_model_dir), dtype="float32", device=device, attention_backend="triton",
                  kv_cache_memory=0.01, max_num_batched_tokens=64, max_num_seqs=4, seed=0)
        llm.engine.runner.warm_up_kernels()
        warmed = log.snapshot()
        mixed_load(llm)
    assert set(warmed) == set(launched_kernels())  # every kernel, the split reduce included
    assert len(warmed["_paged_attention_kernel"]) == 3  # mixed, one-pass decode, split decode
    added = {name: keys - warmed.get(name, frozenset()) for name, keys in log.snapshot().items()}
    assert not any(added.values()), added


def test_warm_up_is_a_no_op_on_the_torch_backend(tiny_model_dir, device, monkeypatch):
    runner = LLM(str(tiny_model_dir), dtype="float32", device=device, attention_backend="torch",
                 kv_cache_memory=0.01, swap_space=0).engine.runner
    monkeypatch.setattr(runner, "execute", lambda out: pytest.fail("warm-up ran a step"))
    runner.warm_up_kernels()
    assert runner.kernels.name == "torch"


def test_largest_split_decode_is_the_last_batch_that_splits():
    import torch

    from pageserve.runtime.kernels import TritonKernels
    from pageserve.triton_kernels.paged_attention import split_partitions

    cpu = torch.device("cpu")  # 128 SMs assumed off CUDA
    backend = TritonKernels(16, 8, 2)
    num_seqs, ctx = backend.largest_split_decode(4096, cpu)
    assert (num_seqs, ctx) == (63, 4096)
    assert split_partitions(num_seqs, 2, 1, ctx, cpu) == 8
    assert split_partitions(num_seqs + 1, 2, 1, ctx, cpu) == 0
    assert backend.largest_split_decode(512, cpu) is None  # one partition holds any context
    assert backend.decode_shapes(4096, cpu) == [(1, 1), (1, 513)]
    assert backend.decode_shapes(512, cpu) == [(1, 1)]
    # CUDA graphs of batches that split capture the split for the longest context
    assert backend.graph_max_seq_len(num_seqs, ctx, cpu) == ctx
    assert backend.graph_max_seq_len(num_seqs + 1, ctx, cpu) == 1 and backend.graph_max_seq_len(1, 512, cpu) == 1
