"""Decode steps as CUDA graphs (runtime/cuda_graphs.py), run on the CPU through the fake CUDA
device, whose graphs replay by running the captured function again on the static buffers:
the capture sizes, the padding of a batch up to a captured size, which steps fall back to
eager, and the same greedy tokens with and without graphs. A real GPU's capture and replay
are what loadtest/gpu_check.py's graphs section measures."""

from __future__ import annotations

import pytest
import torch

from pageserve.runtime import SamplingParams
from pageserve.runtime import model_runner
from pageserve.runtime.cuda_graphs import DecodeGraphs, capture_sizes
from pageserve.runtime.engine import LLMEngine
from pageserve.runtime.engine_args import EngineArgs
from pageserve.runtime.kernels import AttentionMetadata, TorchKernels
from tests.conftest import assert_pool_clean
from tests.fake_cuda import GiB, FakeCuda

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("sizes, max_num_seqs, expected", [
    (None, 256, [1, 2, 4] + list(range(8, 257, 8))),
    (None, 1024, [1, 2, 4] + list(range(8, 513, 8))),  # capped at 512
    (None, 12, [1, 2, 4, 8, 12]),  # the largest batch the scheduler builds is captured too
    ((20,), 256, [1, 2, 4, 8, 16, 20]),
    ((3, 1, 64, 7), 32, [1, 3, 7]),  # listed sizes as given, none above max_num_seqs
    ((1,), 256, [1]),
    ((512,), 100, [1, 2, 4] + list(range(8, 97, 8)) + [100]),  # the largest batch the scheduler builds
])
def test_capture_sizes(sizes, max_num_seqs, expected):
    assert capture_sizes(sizes, max_num_seqs) == expected


def test_bad_graph_sizes_are_refused():
    with pytest.raises(ValueError, match="cuda_graph_sizes must be >= 1"):
        EngineArgs(cuda_graph_sizes=[8, 0])


def engine(tiny_model_dir, monkeypatch, graphs: bool, **kw) -> LLMEngine:
    """The tiny model on a fake CUDA device; graphs: whether the torch kernels count as
    capturable (on a GPU only the Triton ones do)."""
    monkeypatch.setattr(model_runner, "device_for", lambda device: FakeCuda())
    monkeypatch.setattr(TorchKernels, "graph_safe", graphs)
    args = dict(model=str(tiny_model_dir), dtype="float32", device="cpu", kv_cache_memory=0.0004, max_model_len=512,
                swap_space=0.0002, max_num_batched_tokens=64, max_num_seqs=12,
                cuda_graph_sizes=[1, 2, 4, 8], debug_checks=True)
    return LLMEngine.from_engine_args(EngineArgs(**{**args, **kw}))


def run(eng: LLMEngine, prompts, max_tokens) -> tuple[dict, list[int]]:
    """Greedy outputs by prompt index, and the size of every decode-only step."""
    ids = {eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)): i
           for i, (p, m) in enumerate(zip(prompts, max_tokens))}
    out, decode_sizes = {}, []
    real = eng.runner.execute

    def spy(step):
        if step.requests and all(len(r.token_ids) == 1 for r in step.requests):
            decode_sizes.append(len(step.requests))
        return real(step)
    eng.runner.execute = spy
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[ids[o.request_id]] = o.outputs[0].token_ids
    eng.runner.execute = real
    assert_pool_clean(eng)
    return out, decode_sizes


def test_graph_decodes_give_the_eager_tokens(tiny_model_dir, monkeypatch):
    """Eleven requests of staggered lengths: decode batches of every size 1..11 (sizes 3, 5,
    6, 7 padded, 9-11 above the largest graph and eager), prefix hits (shared prefixes) and
    preemptions (a pool of 52 blocks of 16 tokens for up to 11 requests of 13-276)."""
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 380, (40,), generator=g).tolist()
    prompts = [shared[:8 + 3 * i] + torch.randint(3, 380, (5 + 7 * i,), generator=g).tolist()
               for i in range(11)]
    max_tokens = [6 + 13 * i for i in range(11)]
    eager = engine(tiny_model_dir, monkeypatch, graphs=False)
    assert eager.runner.graphs is None
    want, _ = run(eager, prompts, max_tokens)
    del eager

    eng = engine(tiny_model_dir, monkeypatch, graphs=True)
    graphs = eng.runner.graphs
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    captures = [e for e in eng.runner.dev.log if e[0] == "capture"]
    assert [shape[0] for _, shape in captures] == [8, 4, 2, 1]  # largest first
    graphs.replays = 0
    got, sizes = run(eng, prompts, max_tokens)
    assert got == want
    assert set(sizes) >= {1, 3, 5, 8, 10}, sizes
    assert graphs.replays == sum(1 for s in sizes if s <= 8)  # every decode step up to 8: a graph
    assert eng.scheduler.num_preemptions > 0 and eng.kv.prefix_hits > 0


def test_padding_rows_write_nothing_and_are_dropped(tiny_model_dir, monkeypatch):
    """A decode of three requests replayed at size 4: the fourth row's slot is -1 and its
    context one token; the hidden states are the eager ones; the KV pool changes only in the
    three requests' slots."""
    eng = engine(tiny_model_dir, monkeypatch, graphs=True, cuda_graph_sizes=[4])
    runner = eng.runner
    graphs: DecodeGraphs = runner.graphs
    assert sorted(graphs.graphs) == [1, 2, 4]
    kv = runner._kv_storage
    kv.normal_(generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([5, 6, 7])
    pos = torch.tensor([3, 9, 20])
    slots = [16 * 1 + 3, 16 * 2 + 9, 16 * 4 + 4]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.arange(4, dtype=torch.int32),
        seq_lens=torch.tensor([4, 10, 21], dtype=torch.int32),
        block_tables=torch.tensor([[1, 0], [2, 0], [3, 4]], dtype=torch.int32),
        max_query_len=1, max_seq_len=21)
    before = kv.clone()
    assert graphs.size_for(meta) == 4
    with torch.inference_mode():  # the engine's mode, in which the static buffers were made
        graphs.slot_mapping.fill_(7)  # stale values the padding must overwrite
        graphs.seq_lens.fill_(5)
        got = graphs.run(4, ids, pos, meta).clone()
        assert graphs.slot_mapping[3] == -1 and graphs.seq_lens[3] == 1
        after_graph = kv.clone()
        kv.copy_(before)
        runner.kernels.prepare(meta)
        want = runner.model(ids, pos, meta, runner.kv_caches)
    assert got.shape == want.shape == (3, runner.model_cfg.hidden_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    changed = (after_graph != before).flatten(3).any(-1)  # [layer, k/v, block]
    assert set(changed.nonzero()[:, 2].tolist()) == {1, 2, 4}  # the three slots' blocks alone


def test_steps_a_graph_cannot_serve_run_eagerly(tiny_model_dir, monkeypatch):
    eng = engine(tiny_model_dir, monkeypatch, graphs=True)
    graphs = eng.runner.graphs

    def meta(q_lens, max_seq_len=10):
        n = len(q_lens)
        return AttentionMetadata(
            slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64),
            query_start_loc=torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32),
            seq_lens=torch.full((n,), max_seq_len, dtype=torch.int32),
            block_tables=torch.zeros(n, 1, dtype=torch.int32), max_query_len=max(q_lens),
            max_seq_len=max_seq_len)
    assert graphs.size_for(meta([1] * 3)) == 4
    assert graphs.size_for(meta([1] * 8)) == 8
    assert graphs.size_for(meta([1] * 9)) is None  # above the largest graph
    assert graphs.size_for(meta([1, 2])) is None  # a prompt chunk in the step
    assert graphs.size_for(meta([1] * 2, max_seq_len=500)) == 2  # long contexts too


@pytest.mark.parametrize("kw", [dict(enforce_eager=True), dict(), dict(device_type="cpu")])
def test_no_graphs_where_they_do_not_apply(tiny_model_dir, monkeypatch, kw):
    """--enforce-eager, kernels that read plans on the host (the torch backend on a GPU), and
    the CPU capture nothing."""
    device_type = kw.pop("device_type", "cuda")
    if device_type == "cuda":
        monkeypatch.setattr(model_runner, "device_for", lambda device: FakeCuda())
    monkeypatch.setattr(TorchKernels, "graph_safe", "enforce_eager" in kw or device_type == "cpu")
    eng = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), dtype="float32", device="cpu",
                                                kv_cache_memory=0.004, swap_space=0, **kw))
    assert eng.runner.graphs is None and eng.runner.graph_sizes(256) == []


def test_memory_profile_keeps_room_for_the_graphs(tiny_model_dir, monkeypatch):
    """The graphs' pool holds a decode step's activations at the largest size for good: the
    profile measures that step and gives the KV cache that much less (the fake device reports
    a peak 3 GiB over what is allocated)."""
    from pageserve.runtime.model_runner import ModelRunner, kv_block_bytes
    from pageserve.runtime.models.loader import load_tokenizer, read_config

    args = EngineArgs(model=str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=256)
    device = args.resolve_device()
    cfg = args.model_config(tiny_model_dir, read_config(tiny_model_dir), load_tokenizer(tiny_model_dir),
                            device.device)
    blocks = {}
    for graphs in (False, True):
        monkeypatch.setattr(TorchKernels, "graph_safe", graphs)
        runner = ModelRunner(cfg, device, 16, 0, dev=FakeCuda(total=80 * GiB, free=70 * GiB,
                                                              allocated=2 * GiB, peak=5 * GiB))
        blocks[graphs] = runner.profile_num_blocks(0.9, 64, 16)
        assert runner.profiled_graph_pool == (3 * GiB if graphs else 0)
    assert blocks[False] - blocks[True] == pytest.approx(3 * GiB / kv_block_bytes(cfg, 16), abs=1)
