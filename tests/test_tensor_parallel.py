"""Tensor parallelism on CPU (gloo, two worker processes of one thread each): the same greedy
tokens as one rank in float32 under chunked prefill, prefix hits, swap, recompute, n > 1 block
copies and a grammar, with 4 KV heads (split) and 1 (replicated); how checkpoint tensors are
split; a worker that dies or hangs stops the engine and leaves no process behind."""

import ipaddress
import os
import random
import signal
import time

import psutil
import pytest
import torch

from pageserve.loadtest.tiny_model import build_tiny_model
from pageserve.runtime import LLM, SamplingParams
from pageserve.runtime.config import ModelConfig
from pageserve.runtime.executor import ExecutorDeadError
from pageserve.runtime.models import parallel
from pageserve.sampling.params import StructuredOutputsParams, ThinkingBudget
from tests.conftest import assert_pool_clean

pytestmark = pytest.mark.engine

GiB = 1 << 30


def block_bytes(kv_heads_per_rank: int) -> int:
    return 2 * 2 * kv_heads_per_rank * 16 * 16 * 4  # layers, K/V, heads, block size, head dim, fp32


def engine(model_dir, tp, kv_heads, blocks, swap_blocks, **kw):
    """The same number of blocks (and swap blocks) at any tp: the memory flags are per rank."""
    per_rank = block_bytes(max(1, kv_heads // tp))
    return LLM(str(model_dir), dtype="float32", tensor_parallel_size=tp, max_model_len=512,
               kv_cache_memory=blocks * per_rank / GiB, swap_space=swap_blocks * per_rank / GiB,
               max_num_batched_tokens=128, debug_checks=True, **kw)


def workload(seed=0):
    """Long prompts (chunked at 128 tokens), half of them behind one shared 96-token prefix,
    greedy; an n = 2 seeded request (its fork copies a partial block), a choice grammar, and
    requests that read all their tokens on rank 0 (penalties, prompt logprobs)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 384) for _ in range(96)]
    prompts, params = [], []
    for i in range(20):
        own = [rng.randrange(3, 384) for _ in range(rng.randrange(60, 300))]
        prompts.append(shared + own if i % 2 else own)
        params.append(SamplingParams(temperature=0, max_tokens=rng.randrange(8, 40), ignore_eos=True))
    prompts.append(shared + [7, 8, 9])
    params.append(SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=20, ignore_eos=True))
    prompts.append([11, 12, 13])
    params.append(SamplingParams(temperature=0, max_tokens=10,
                                 structured_outputs=StructuredOutputsParams(choice=("yes", "no", "maybe"))))
    prompts.append([rng.randrange(3, 40) for _ in range(200)])  # few distinct tokens: penalties bite
    params.append(SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.5,
                                 frequency_penalty=0.7))
    prompts.append([rng.randrange(3, 384) for _ in range(150)])
    params.append(SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3))
    prompts.append([rng.randrange(3, 384) for _ in range(30)])
    params.append(SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True))
    prompts.append([rng.randrange(3, 384) for _ in range(20)])  # a thinking budget's mask crosses the wire
    params.append(SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                 thinking_budget=ThinkingBudget(5, (381, 382))))
    return prompts, params


def run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [([c.token_ids for c in o.outputs], [None if p is None else sorted(p) for p in o.prompt_logprobs or []],
             [sorted(p) for c in o.outputs for p in c.logprobs or []]) for o in outs]


@pytest.fixture(scope="module", params=[4, 1], ids=["kv4-split", "kv1-replicated"])
def model(request, tmp_path_factory):
    kv = request.param
    return kv, build_tiny_model(tmp_path_factory.mktemp(f"tiny-kv{kv}"), num_key_value_heads=kv)


def test_tp2_same_tokens_as_tp1_under_pressure(model):
    kv, path = model
    prompts, params = workload()
    results, stats = {}, {}
    for tp in (1, 2):
        # room for about two long requests; the swap space for one short one, so that long ones
        # fall back to recompute
        llm = engine(path, tp, kv, blocks=44, swap_blocks=14)
        try:
            results[tp] = run(llm, prompts, params)
            sched = llm.engine.scheduler
            stats[tp] = (sched.num_preemptions, sched.num_swapped_out_blocks, sched.num_recomputed,
                         llm.engine.kv.prefix_hits)
            assert_pool_clean(llm.engine)
        finally:
            llm.engine.shutdown()
    assert results[2] == results[1]
    preemptions, swapped, recomputed, hits = stats[2]
    assert preemptions > 0 and swapped > 0 and recomputed > 0, stats
    assert hits > 0, stats
    assert stats[2] == stats[1]  # the same schedule: the ranks' pools are the same size as one rank's
    n2 = results[2][-6][0]
    assert n2[0] != n2[1]  # n = 2 drew two different sequences
    assert len(results[2][-3][1]) == 150  # prompt logprobs compared at every position
    assert len(results[2][-2][2]) == 12  # and sample logprobs at every output token
    assert results[2][-1][0][0][5:7] == [381, 382]  # the budget's end, after five tokens


def _children() -> set[int]:
    """This process's live children, but multiprocessing's resource tracker (started with the
    first spawned process, it lives as long as this process)."""
    alive = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                alive.add(p.pid)
        except psutil.Error:  # gone meanwhile
            pass
    return alive


def gone(procs: list[psutil.Process]) -> bool:
    """None of `procs` is still running (a zombie counts as gone)."""
    def running(p):
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    return not any(running(p) for p in procs)


def spawned_ranks(pid: int) -> list[psutil.Process]:
    """The rank processes under `pid` (spawned by multiprocessing), living ones only: not the
    resource tracker, nor a short-lived helper (the grammar compiler, a C build) that may be a
    zombie at the moment it is listed."""
    ranks = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:  # a zombie, or gone meanwhile
            continue
        if "spawn_main" in cmd and "resource_tracker" not in cmd:
            ranks.append(p)
    return ranks


def test_tp2_adds_row_parallel_biases_once(tmp_path):
    """o_proj's and down_proj's biases are whole on each rank and added once, after the
    all-reduce (on each rank they would count twice); gate/up's split with their rows."""
    from tests.test_parity import biased_llama, random_prompts

    path = biased_llama(tmp_path / "biased")
    prompts = random_prompts(384)[:6]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = {}
    for tp in (1, 2):
        llm = engine(path, tp, 2, blocks=64, swap_blocks=8)
        try:
            results[tp] = run(llm, prompts, [params] * len(prompts))
        finally:
            llm.engine.shutdown()
    assert results[2] == results[1]


def test_killed_worker_stops_the_engine_and_leaves_no_process(model):
    kv, path = model
    before = _children()
    llm = engine(path, 2, kv, blocks=200, swap_blocks=0)
    pids = llm.engine.executor.pids
    assert len(pids) == 2 and set(pids) <= _children()
    for pid in pids:  # the rendezvous store and gloo on the loopback only (torch's store: every interface)
        listening = [c.laddr for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        assert all(ipaddress.ip_address(a.ip).is_loopback for a in listening), (pid, listening)
    assert any(psutil.Process(pids[0]).net_connections("tcp"))
    eng = llm.engine
    for i in range(4):
        eng.add_request([5 + i] * 50, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    for _ in range(3):
        eng.step()
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(ExecutorDeadError, match=r"rank 1 \(pid \d+\) died"):
        for _ in range(100):
            eng.step()
    assert not any(psutil.pid_exists(p) for p in pids)
    assert _children() <= before
    with pytest.raises(ExecutorDeadError, match="stopped"):  # no step runs again
        eng.step()


def test_hung_worker_stops_the_engine(tiny_model_dir):
    llm = engine(tiny_model_dir, 2, 2, blocks=200, swap_blocks=0)
    pids = llm.engine.executor.pids
    eng = llm.engine
    eng.executor.execute_timeout = 3.0
    eng.add_request([5] * 50, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    eng.step()
    os.kill(pids[0], signal.SIGSTOP)  # rank 1 then waits for it in the first all-reduce
    with pytest.raises(ExecutorDeadError, match=r"rank\(s\) \[0, 1\] did not answer within 3 s"):
        eng.step()
    assert not any(psutil.pid_exists(p) for p in pids)


def _cfg(tp, rank, heads=8, kv=2, d=4, vocab=64):
    return ModelConfig(path="", architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=heads * d,
                       intermediate_size=48, num_layers=1, num_heads=heads, num_kv_heads=kv, head_dim=d,
                       rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None, max_position_embeddings=64,
                       tie_word_embeddings=False, qkv_bias=False, eos_token_ids=(0,), dtype=torch.float32,
                       max_model_len=64, tp_size=tp, tp_rank=rank)


def test_shards_cover_each_weight_once_and_replicate_kv_heads():
    full = {"layers.0.self_attn.q_proj.weight": torch.randn(32, 32),
            "layers.0.self_attn.k_proj.weight": torch.randn(8, 32),
            "layers.0.self_attn.o_proj.weight": torch.randn(32, 32),
            "layers.0.mlp.gate_proj.weight": torch.randn(48, 32),
            "layers.0.mlp.down_proj.weight": torch.randn(32, 48),
            "embed_tokens.weight": torch.randn(64, 32), "norm.weight": torch.randn(32)}
    rows = {"q_proj": 0, "gate_proj": 0, "embed_tokens": 0, "o_proj": 1, "down_proj": 1}
    for tp in (2, 4):
        parts = {n: [parallel.shard(n, t, _cfg(tp, r)) for r in range(tp)] for n, t in full.items()}
        for name, t in full.items():
            dim = next((d for key, d in rows.items() if key in name), None)
            if dim is not None:  # split: the ranks' parts in order are the tensor
                assert torch.equal(torch.cat(parts[name], dim=dim), t), name
            elif "k_proj" not in name:  # replicated
                assert all(torch.equal(p, t) for p in parts[name]), name
        k = full["layers.0.self_attn.k_proj.weight"]
        # 2 KV heads: split at tp 2; at tp 4 ranks 0, 1 read head 0 and ranks 2, 3 head 1
        expect = [k[0:4], k[4:8]] if tp == 2 else [k[0:4], k[0:4], k[4:8], k[4:8]]
        assert all(torch.equal(a, b) for a, b in zip(parts["layers.0.self_attn.k_proj.weight"], expect)), tp
        # rank r's query heads read the KV head that rank holds (GQA group of 4 query heads)
        for r in range(tp):
            q_heads = range(r * 8 // tp, (r + 1) * 8 // tp)
            assert {h // 4 for h in q_heads} == {r * 2 // tp}
    # Phi-3 stores q/k/v (and gate/up) fused: split alike
    fused = torch.cat([full["layers.0.self_attn.q_proj.weight"], k, torch.randn(8, 32)])
    for r in range(2):
        cfg = _cfg(2, r)
        part = parallel.shard("layers.0.self_attn.qkv_proj.weight", fused, cfg)
        q, kk, v = fused.split([32, 8, 8])
        assert torch.equal(part, torch.cat([parallel.shard("a.q_proj.weight", q, cfg),
                                            parallel.shard("a.k_proj.weight", kk, cfg),
                                            parallel.shard("a.v_proj.weight", v, cfg)]))


def test_sizes_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\) and --tensor-parallel-size \(3\)"):
        _cfg(3, 0, heads=6, vocab=66)
    with pytest.raises(ValueError, match=r"num_attention_heads \(8\) must be divisible"):
        _cfg(3, 0, kv=1)


@pytest.mark.slow
def test_default_model_tp3_same_tokens_as_tp1():
    """SmolLM2-135M (9 heads, 3 KV heads, tied embeddings): TP 3 splits it (TP 2 cannot)."""
    text = ("PagedAttention stores the key-value cache in fixed-size blocks, like pages of virtual "
            "memory, so that requests of any length share one pool. ")
    prompts = [text * k for k in (1, 3, 6)] + ["The capital of France is"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for tp in (1, 3):
        llm = LLM(None, dtype="float32", tensor_parallel_size=tp, kv_cache_memory=0.05, swap_space=0,
                  max_model_len=1024, max_num_batched_tokens=64)
        try:
            results[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.engine.shutdown()
    assert results[3] == results[1]


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    from pageserve.runtime.config import DeviceConfig, ParallelConfig, SchedulerConfig
    from pageserve.runtime.engine_args import EngineArgs
    from pageserve.runtime.executor import MultiprocExecutor

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    before = _children()
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 needs 2 GPUs .* has 1"):
        MultiprocExecutor(EngineArgs(), ParallelConfig(tensor_parallel_size=2), _cfg(2, 0),
                          DeviceConfig(torch.device("cuda"), "triton", 1), SchedulerConfig(8, 64, 64, True))
    assert _children() <= before


def test_ranks_lost_during_a_fork_end_the_engine_not_the_request(tiny_model_dir):
    """An n > 1 fork copies its partial block on every rank after the step; ExecutorDeadError
    there is the engine's end, not a failure of that one request."""
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01, max_model_len=256, swap_space=0)

    def dead(pairs):
        raise ExecutorDeadError("tensor-parallel worker rank 1 (pid 1) died (exit code -9)")
    llm.engine.executor.copy_blocks = dead
    llm.engine.add_request(list(range(3, 23)), SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=4))
    with pytest.raises(ExecutorDeadError, match="died"):
        for _ in range(10):
            llm.engine.step()
    assert not llm.engine.take_failures()


def test_stopping_the_async_engine_stops_the_workers(tiny_model_dir):
    """The server's shutdown (AsyncEngine.stop) ends the rank processes itself, while this
    process lives on: not left to the interpreter's exit."""
    import asyncio

    from pageserve.runtime.async_engine import AsyncEngine
    from pageserve.runtime.engine_args import EngineArgs

    before = _children()

    async def serve_one() -> tuple[list[int], list[int]]:
        eng = AsyncEngine.build(EngineArgs(model=str(tiny_model_dir), dtype="float32", tensor_parallel_size=2,
                                           kv_cache_memory=0.01, max_model_len=256, swap_space=0))
        pids = eng.engine.executor.pids
        eng.start()
        stream = eng.new_stream()
        eng.add_request(stream, "r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        tokens = [out.outputs[0].token_ids async for out in stream][-1]
        assert set(pids) <= _children()
        await eng.stop()
        return pids, tokens

    pids, tokens = asyncio.run(serve_one())
    assert len(tokens) == 4
    assert not any(psutil.pid_exists(p) for p in pids)
    assert _children() <= before


def test_a_rank_failing_beside_a_dead_peer_reports_the_death():
    """A rank whose collective lost its peer fails with the collective's error, often before the
    peer's exit is seen: the executor names the dead peer (the cause), with the other's error."""
    import multiprocessing
    import weakref

    from pageserve.runtime import wire
    from pageserve.runtime.executor import MultiprocExecutor, _stop

    ctx = multiprocessing.get_context("spawn")
    alive, dead = ctx.Process(target=time.sleep, args=(30,)), ctx.Process(target=os._exit, args=(9,))
    alive.start(), dead.start()
    dead.join(10)
    answer, answered = ctx.Pipe()
    silent, _ = ctx.Pipe()
    answered.send_bytes(wire.encode(("error", "Traceback ...\nRuntimeError: Connection closed by peer")))
    ex = object.__new__(MultiprocExecutor)
    ex._procs, ex._conns, ex._dead = [alive, dead], [answer, silent], False
    ex._finalizer = weakref.finalize(ex, _stop, ex._procs, ex._conns)
    with pytest.raises(ExecutorDeadError, match=r"rank 1 \(pid \d+\) died \(exit code 9\); rank 0 failed with it: "
                                                 r"RuntimeError: Connection closed by peer"):
        ex._collect(10)
    assert not alive.is_alive()
