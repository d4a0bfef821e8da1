"""Pipeline parallelism on CPU (gloo, one worker process per rank): the layers split into
stages, hidden states handed from stage to stage, several batches in flight. The same greedy
tokens as one process in float32 under chunked prefill, prefix hits, swap, recompute, n > 1
block copies, a grammar, penalties and logprobs, at PP 2 and TP 2 x PP 2 with one and two
batches in flight; how layers are partitioned; a stage that dies or hangs stops the engine and
leaves no process behind."""

import os
import signal

import psutil
import pytest

from pageserve.loadtest.tiny_model import build_tiny_model
from pageserve.runtime import LLM, SamplingParams
from pageserve.runtime.config import ParallelConfig
from pageserve.runtime.engine_args import EngineArgs
from pageserve.runtime.executor import ExecutorDeadError
from pageserve.runtime.models.loader import ModelLoadError
from pageserve.runtime.pipeline import head_cost, layer_partition
from tests.conftest import assert_pool_clean
from tests.test_tensor_parallel import _children, run, workload

GiB = 1 << 30


@pytest.mark.unit
def test_layer_partition_even_uneven_and_given():
    assert layer_partition(30, 1) == (30,)
    assert layer_partition(30, 2) == (15, 15)
    assert layer_partition(30, 3) == (10, 10, 10)
    assert layer_partition(30, 4) == (7, 8, 8, 7)  # the remainder to the middle stages
    assert layer_partition(31, 2) == (16, 15)
    # the last stage also computes the logits: as many fewer layers as they cost
    assert layer_partition(30, 2, head_layers=8.0) == (19, 11)  # the default model's vocabulary
    assert layer_partition(80, 2, head_layers=1.23) == (41, 39)  # a 70B model's
    assert layer_partition(4, 2, head_layers=10.0) == (3, 1)  # at least one layer each
    assert layer_partition(30, 3, "8,10,12") == (8, 10, 12)
    for bad in ("8,10", "8,10,13", "0,15,15", "a,b,c"):
        with pytest.raises(ValueError, match="--pp-layer-partition"):
            layer_partition(30, 3, bad)
    with pytest.raises(ValueError, match="more stages than the model's 2 layers"):
        layer_partition(2, 3)


@pytest.mark.unit
def test_the_logits_cost_the_layers_of_their_weights():
    smollm2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                   vocab_size=49152)
    assert head_cost(smollm2) == pytest.approx(8.0)  # 49152 x 576 against 3.54M weights a layer
    llama70b = dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                    vocab_size=128256)
    assert head_cost(llama70b) == pytest.approx(1.228, abs=1e-3)


@pytest.mark.unit
def test_ranks_count_from_the_last_stage_and_nodes_take_whole_stages():
    p = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3, batches_in_flight=3)
    assert p.world_size == 6
    assert [p.stage_of(r) for r in range(6)] == [2, 2, 1, 1, 0, 0]  # rank 0 samples
    assert [list(p.stage_ranks(s)) for s in range(3)] == [[4, 5], [2, 3], [0, 1]]
    with pytest.raises(ValueError, match="--max-batches-in-flight must be in 1..--pipeline-parallel-size"):
        ParallelConfig(pipeline_parallel_size=2, batches_in_flight=3)
    with pytest.raises(ValueError, match="split a tensor-parallel group of 4 unevenly"):
        ParallelConfig(tensor_parallel_size=4, pipeline_parallel_size=3, nnodes=2, master_port=1,
                       secret=b"x" * 16, batches_in_flight=1)  # 6 ranks a node: a stage and a half
    ok = ParallelConfig(tensor_parallel_size=8, pipeline_parallel_size=2, nnodes=2, master_port=1, secret=b"x" * 16)
    assert ok.ranks_per_node == 8 and list(ok.stage_ranks(1)) == list(range(8))  # node 0: the last stage


@pytest.mark.unit
def test_what_stages_cannot_run_yet_is_refused_before_loading(tiny_model_dir):
    from pageserve.runtime.models.loader import read_config
    hf = read_config(tiny_model_dir)
    for kw, what in ((dict(enable_lora=True), "--enable-lora"),
                     (dict(speculative_config={"model": str(tiny_model_dir)}), "a draft model")):
        with pytest.raises(ModelLoadError, match=f"does not take {what}"):
            EngineArgs(model=str(tiny_model_dir), pipeline_parallel_size=2, **kw).pipeline_stages(
                "LlamaForCausalLM", hf)


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-4-layers"), num_hidden_layers=4)


def engine(path, tp, pp, blocks, swap_blocks, **kw):
    """The same number of blocks (and swap blocks) in every layout: a rank's block holds its
    stage's layers (an even split here) and its KV heads (2 KV heads, head_dim 16, float32,
    blocks of 16)."""
    per_rank = 2 * (4 // pp) * (2 // tp) * 16 * 16 * 4
    if pp > 1:
        kw["pp_layer_partition"] = ",".join([str(4 // pp)] * pp)
    return LLM(str(path), dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp, max_model_len=512,
               kv_cache_memory=blocks * per_rank / GiB, swap_space=swap_blocks * per_rank / GiB,
               max_num_batched_tokens=128, debug_checks=True, **kw)


def in_flight_depths(llm) -> list[int]:
    """Record, at each collect, how many steps were in the pipeline."""
    eng, depths = llm.engine, []
    collect = eng.executor.collect

    def counting(handle):
        depths.append(len(eng._in_flight) + 1)
        return collect(handle)
    eng.executor.collect = counting
    return depths


@pytest.fixture(scope="module")
def one_process(four_layers):
    """The workload's results in one process, with the same blocks."""
    prompts, params = workload()
    return run(engine(four_layers, 1, 1, blocks=44, swap_blocks=14), prompts, params)


@pytest.mark.engine
@pytest.mark.parametrize("tp,pp,in_flight", [(1, 2, 2), (1, 2, 1), (2, 2, 2)])
def test_stages_give_the_tokens_of_one_process_under_pressure(four_layers, one_process, tp, pp, in_flight):
    prompts, params = workload()
    expected = one_process
    llm = engine(four_layers, tp, pp, blocks=44, swap_blocks=14, max_batches_in_flight=in_flight)
    try:
        assert len(llm.engine.executor.pids) == tp * pp
        depths = in_flight_depths(llm)
        assert run(llm, prompts, params) == expected
        sched = llm.engine.scheduler
        assert sched.num_preemptions > 0 and sched.num_swapped_out_blocks > 0 and sched.num_recomputed > 0, \
            (sched.num_preemptions, sched.num_swapped_out_blocks, sched.num_recomputed)
        assert llm.engine.kv.prefix_hits > 0
        assert max(depths) == in_flight
        assert_pool_clean(llm.engine)
    finally:
        llm.engine.shutdown()


@pytest.mark.engine
def test_batches_in_flight_split_the_requests_and_keep_them_apart(four_layers):
    """Two batches in flight: each step takes about half of the requests, and no request is in
    two steps at once (its next token is not known before its step is out)."""
    llm = engine(four_layers, 1, 2, blocks=400, swap_blocks=0)
    eng = llm.engine
    steps, submit = [], eng.executor.submit

    def recording(out):
        ids = {r.request_id for r in out.requests}
        held = set().union(*(s for s, done in steps if not done)) if steps else set()
        assert not ids & held, ids & held
        steps.append([ids, False])
        return submit(out)
    collect = eng.executor.collect

    def done(handle):
        next(s for s in steps if not s[1])[1] = True
        return collect(handle)
    eng.executor.submit, eng.executor.collect = recording, done
    try:
        outs = llm.generate([[5 + i] * 20 for i in range(8)], SamplingParams(temperature=0, max_tokens=16,
                                                                             ignore_eos=True), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
        sizes = [len(ids) for ids, _ in steps if ids]
        assert max(sizes) == 4 and sizes.count(4) > 10, sizes  # 8 requests, two batches of 4
    finally:
        eng.shutdown()


@pytest.mark.engine
def test_a_stage_that_dies_stops_the_engine_and_leaves_no_process(four_layers):
    before = _children()
    llm = engine(four_layers, 1, 2, blocks=200, swap_blocks=0)
    eng, pids = llm.engine, llm.engine.executor.pids
    for i in range(4):
        eng.add_request([5 + i] * 50, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    for _ in range(3):
        eng.step()
    os.kill(pids[1], signal.SIGKILL)  # rank 1: the first stage
    # whichever the engine hears of first: the death, or the last stage's lost connection
    with pytest.raises(ExecutorDeadError, match=r"(?s)rank 1 \(pid \d+\) died|rank 0 failed:.*Connection reset"):
        for _ in range(100):
            eng.step()
    assert not any(psutil.pid_exists(p) for p in pids)
    assert _children() <= before


@pytest.mark.engine
def test_a_stage_that_hangs_stops_the_engine(four_layers):
    llm = engine(four_layers, 1, 2, blocks=200, swap_blocks=0)
    eng, pids = llm.engine, llm.engine.executor.pids
    eng.executor.execute_timeout = 3.0
    eng.add_request([5] * 50, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    eng.step()
    os.kill(pids[1], signal.SIGSTOP)  # the first stage: the last one waits for its hidden states
    with pytest.raises(ExecutorDeadError, match=r"did not answer within 3 s"):
        for _ in range(10):
            eng.step()
    assert not any(psutil.pid_exists(p) for p in pids)


@pytest.mark.slow
def test_default_model_stages_same_tokens_as_one_process():
    """SmolLM2-135M (30 layers, tied embeddings: the last stage holds the embedding as its
    lm_head): long prompts chunked at 64 tokens, a shared prefix, a KV pool that preempts. PP 2
    takes the default split, 19 and 11 layers (the logits cost 8 layers' weights); PP 3 is given
    one."""
    text = ("PagedAttention stores the key-value cache in fixed-size blocks, like pages of virtual "
            "memory, so that requests of any length share one pool. ")
    prompts = [text * k for k in (1, 3, 6)] + [text * 6 + "In short,", text * 5 + "Briefly,",
                                               "The capital of France is"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    per_rank = 2 * 16 * 3 * 64 * 4  # K/V, block, KV heads, head_dim, float32: per layer
    results, stats = {}, {}
    for stages, part in ((1, None), (2, None), (3, "8,10,12")):
        layers = max(map(int, part.split(","))) if part else {1: 30, 2: 19}[stages]
        llm = LLM(None, dtype="float32", pipeline_parallel_size=stages, pp_layer_partition=part,
                  kv_cache_memory=32 * layers * per_rank / GiB, swap_space=4 * layers * per_rank / GiB,
                  max_model_len=512, max_num_batched_tokens=64, debug_checks=True)
        try:
            # then a prompt that finds its prefix cached (in the first round, each batch in flight
            # admits its share of the prompts at once, before any prefix is cached)
            results[stages] = [o.outputs[0].token_ids for batch in (prompts, [text * 4 + "To sum up,"])
                               for o in llm.generate(batch, params, use_tqdm=False)]
            sched = llm.engine.scheduler
            stats[stages] = (sched.num_swapped_out_blocks, sched.num_recomputed, llm.engine.kv.prefix_hits)
            assert llm.engine.config.model.pp_layers == {1: (), 2: (19, 11), 3: (8, 10, 12)}[stages]
        finally:
            llm.engine.shutdown()
    assert results[2] == results[1] and results[3] == results[1]
    assert all(n > 0 for n in stats[2] + stats[3]), stats  # swapped, recomputed, prefix hits
