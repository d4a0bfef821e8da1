"""The KV-cache memory profile (ModelRunner.profile_num_blocks) runs the worst-case steps
through the real `execute` (every sampling path, prompt logprobs, grammar masks) on the tiny
model, over a fake CUDA device whose memory figures the test sets: the CUDA code path with
made-up numbers. What it cannot show here is the real peak of a GPU."""

from __future__ import annotations

import pytest
import torch

from pageserve.runtime import model_runner
from pageserve.sampling import sampler
from pageserve.runtime.engine_args import EngineArgs
from pageserve.runtime.model_runner import ModelRunner, kv_block_bytes
from pageserve.runtime.models.loader import load_tokenizer, read_config
from pageserve.runtime.synthetic_steps import worst_case_steps
from pageserve.sampling.params import MAX_LOGPROBS
from tests.fake_cuda import GiB, FakeCuda
from pageserve.triton_kernels import torch_ops

pytestmark = pytest.mark.engine


def make_runner(model_dir, dev, max_model_len=256):
    args = EngineArgs(model=str(model_dir), dtype="float32", device="cpu", max_model_len=max_model_len)
    device = args.resolve_device()
    cfg = args.model_config(model_dir, read_config(model_dir), load_tokenizer(model_dir), device.device)
    return ModelRunner(cfg, device, 16, 0, dev=dev)


def counting(monkeypatch, module, name, calls):
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.setdefault(name, []).append(args[0].shape if isinstance(args[0], torch.Tensor) else None)
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, spy)


@pytest.mark.parametrize("budget, max_seqs", [(64, 16), (20, 48)])
def test_worst_case_steps_fill_the_budget_and_the_sequence_limit(budget, max_seqs):
    steps = worst_case_steps(budget, max_seqs, 512, (6, 512), 16, 8, 384, (2,))
    batch, prompt, split = steps
    assert batch.num_tokens == budget == len(batch.slot_mapping)
    assert sum(r.num_samples for r in batch.requests) == max_seqs  # n > 1 rows count as well
    assert len(batch.requests) == min(budget, max_seqs)
    assert all(r.matcher is not None for r in batch.requests)
    assert [len(r.token_ids) for r in prompt.requests] == [budget]
    assert [(len(r.token_ids), r.start_pos) for r in split.requests] == [(1, 511)] * 6
    assert max(s for step in steps for s in step.slot_mapping) < 8 * 16  # inside the temporary cache
    assert len(worst_case_steps(budget, max_seqs, 512, None, 16, 8, 384, (2,))) == 2  # no split path


def test_profile_runs_every_path_and_leaves_the_rest_to_the_kv_cache(tiny_model_dir, monkeypatch):
    dev = FakeCuda(total=80 * GiB, free=70 * GiB, allocated=2 * GiB, peak=5 * GiB)
    runner = make_runner(tiny_model_dir, dev)
    calls: dict[str, list] = {}
    for module, name in ((sampler, "apply_top_k_top_p"), (sampler, "apply_min_p"),
                         (sampler, "apply_penalties"), (sampler, "topk_logprobs"),
                         (model_runner, "topk_logprobs"), (torch_ops, "apply_token_bitmask")):
        counting(monkeypatch, module, name, calls)
    results = []
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda out: results.append(execute(out).resolve()) or results[-1])

    blocks = runner.profile_num_blocks(0.9, 64, 16)

    block_bytes = kv_block_bytes(runner.model_cfg, 16)
    peak = 5 * GiB - 4 * block_bytes  # the temporary cache (64 tokens: 4 blocks) is not counted
    assert blocks == int((0.9 * 80 * GiB - (80 - 70 - 2) * GiB - peak) // block_bytes)
    vocab = runner.model_cfg.vocab_size
    assert calls["apply_top_k_top_p"][0] == (16, vocab)  # all 16 rows through the full sort
    assert calls["apply_min_p"][0] == (16, vocab) and calls["apply_penalties"][0] == (16, vocab)
    assert calls["apply_token_bitmask"] == [(16, vocab)]
    batch, release, prompt, release_again = results  # each step's requests finish before the next
    assert len(batch.sampled) == 16 and len(batch.logprobs) == 16
    assert all(len(lp.top) == MAX_LOGPROBS for lp in batch.logprobs.values())
    assert len(prompt.prompt_logprobs["profile-prompt-0"][1]) == 63
    assert not release.sampled and not release_again.sampled
    assert not runner.seeded and not runner.counts.rows  # released after the profile
    # penalty rows for max_num_seqs, reserved before the peak is measured, and no more (the
    # prompt step's row would have been a 17th had the batch's rows not been released first)
    assert runner.counts.counts.shape[0] == 16
    assert not runner.kv_caches  # the temporary cache is gone
    assert [e for e in dev.log if e[0] in ("reset_peak", "synchronize")] == [("reset_peak",), ("synchronize",)]


def test_profile_leaves_no_room_is_an_error_of_the_caller(tiny_model_dir):
    """A peak above the allowed fraction gives a negative count, which the cache config refuses."""
    runner = make_runner(tiny_model_dir, FakeCuda(total=8 * GiB, free=7 * GiB, allocated=GiB, peak=8 * GiB))
    blocks = runner.profile_num_blocks(0.5, 32, 4)
    assert blocks < 1
    with pytest.raises(ValueError, match="no room for a single block"):
        EngineArgs(model="unused").cache_config(blocks, 0, 16)


def test_profile_needs_a_cuda_device(tiny_model_dir):
    from pageserve.runtime.device import HostDevice

    with pytest.raises(NotImplementedError, match="CUDA only"):
        make_runner(tiny_model_dir, HostDevice()).profile_num_blocks(0.9, 32, 4)
