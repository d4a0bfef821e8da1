"""Tensor parallelism across nodes, on one machine: two processes act as two nodes (--nnodes 2,
--tensor-parallel-size 2, one rank each, gloo on 127.0.0.1). Node 0 runs the engine (the
offline API, or the real server) and rank 0; node 1 runs `pageserve serve --headless` and
rank 1, which gets every step from rank 0 over torch.distributed, signed with the nodes' shared
secret. The tokens are those of one rank; a clean stop of node 0 ends node 1 with status 0; a
node 0 killed outright ends node 1 (non-zero) within seconds; no process is left behind either
way; a message that the secret did not sign is refused before it is read."""

import os
import signal
import subprocess
import sys
import time

import openai
import psutil
import pytest

from pageserve.runtime import LLM, SamplingParams
from pageserve.runtime.config import SECRET_ENV
from pageserve.runtime.ports import free_port
from tests.live_server import ROOT, SubprocessServer
from tests.test_tensor_parallel import _children, gone, spawned_ranks
from tests.test_tensor_parallel_models import prompts

SECRET = "a secret the two test nodes share"
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "0.01", "--swap-space", "0",
                "--max-num-batched-tokens", "64"]


@pytest.fixture(autouse=True)
def _shared_secret(monkeypatch):
    """Both nodes take it from the environment (the subprocesses inherit it)."""
    monkeypatch.setenv(SECRET_ENV, SECRET)


class HeadlessNode:
    """`pageserve serve --headless` as node 1 of 2, its log in a file; `layout`: the parallel
    flags (two ranks in all)."""

    def __init__(self, model_dir, port: int, log_name: str, layout: tuple[str, ...] = ("--tensor-parallel-size", "2")):
        self.log_path = ROOT / ".cache" / log_name
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pageserve.app.cli", "serve", str(model_dir), "--headless", "--nnodes", "2",
             "--node-rank", "1", *layout, "--master-addr", "127.0.0.1",
             "--master-port", str(port), *ENGINE_FLAGS], cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)

    def ranks(self) -> list[psutil.Process]:
        """Its rank processes."""
        return spawned_ranks(self.proc.pid)

    def wait_for_ranks(self, timeout: float = 60) -> list[psutil.Process]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if ranks := self.ranks():
                return ranks
            time.sleep(0.1)
        raise AssertionError(f"node 1 started no rank:\n{self.output()}")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.log.close()

    def output(self) -> str:
        return self.log_path.read_text()


@pytest.mark.engine
def test_two_nodes_same_tokens_as_one_rank_and_clean_stop(tiny_model_dir):
    ps = prompts()  # chunked at 64 tokens, a shared prefix
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    kw = dict(dtype="float32", max_model_len=512, kv_cache_memory=0.01, swap_space=0, max_num_batched_tokens=64)

    def run(llm):
        return [(o.outputs[0].token_ids, [sorted(p) for p in o.outputs[0].logprobs])
                for o in llm.generate(ps, params, use_tqdm=False)]
    one = LLM(str(tiny_model_dir), **kw)
    expected = run(one)
    before = _children()
    port = free_port()
    node1 = HeadlessNode(tiny_model_dir, port, f"headless-{port}.log")
    try:
        llm = LLM(str(tiny_model_dir), tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1",
                  master_port=port, debug_checks=True, **kw)
        ranks1 = node1.ranks()
        assert len(llm.engine.executor.pids) == 1 and len(ranks1) == 1  # one rank on each node
        assert run(llm) == expected
        assert llm.engine.kv.prefix_hits > 0
        llm.engine.shutdown()
        assert node1.wait(30) == 0, node1.output()
    finally:
        if node1.proc.poll() is None:
            node1.wait(0)
    assert gone(ranks1)
    assert _children() <= before
    assert "every rank has stopped" in node1.output()


@pytest.mark.server
def test_served_across_two_nodes_then_node0_killed(tiny_model_dir):
    """The real server as node 0: the OpenAI client gets one rank's greedy text. Then node 0 is
    killed with SIGKILL: node 1 exits non-zero on its own and leaves no rank. (A clean stop of
    two nodes is the engine test above; of a served TP engine, test_tensor_parallel_served.)"""
    prompt = "def add(a, b):"
    one = LLM(str(tiny_model_dir), dtype="float32", max_model_len=512, kv_cache_memory=0.01, swap_space=0)
    expected = one.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    port = free_port()
    node1 = HeadlessNode(tiny_model_dir, port, f"headless-{port}.log")
    srv = None
    try:
        ranks1 = node1.wait_for_ranks()
        srv = SubprocessServer(str(tiny_model_dir), *ENGINE_FLAGS, "--tensor-parallel-size", "2", "--nnodes", "2",
                               "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(port))
        ranks0 = spawned_ranks(srv.proc.pid)
        assert len(ranks0) == 1
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == expected
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait()
        assert node1.wait(60) not in (0, None), node1.output()
        # node 0's rank either tells node 1 the engine is gone before it follows its parent, or
        # dies first and node 1's rank loses its connection: both end node 1, non-zero
        assert ("the engine's process is gone" in node1.output()
                or "the engine's node is gone); stopping this node" in node1.output()), node1.output()
        srv.stop()
    finally:  # a failed check above still stops both nodes
        if srv is not None and srv.proc.poll() is None:
            srv.stop()
        if node1.proc.poll() is None:
            node1.wait(0)
    deadline = time.monotonic() + 10  # node 0's rank follows its killed parent within a second
    while not gone(ranks0 + ranks1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(ranks0 + ranks1)


@pytest.mark.unit
def test_node_flags_resolve_and_refuse_what_cannot_run(monkeypatch):
    from pageserve.app.cli import build_parser
    from pageserve.runtime.config import ParallelConfig
    from pageserve.runtime.engine_args import EngineArgs

    monkeypatch.setenv("MASTER_ADDR", "10.9.9.9")
    monkeypatch.setenv("MASTER_PORT", "29400")
    ns = build_parser().parse_args(["serve", "m", "-tp", "16", "--nnodes", "2", "--node-rank", "1",
                                    "--master-port", "29500", "--headless"])
    assert ns.headless
    parallel = EngineArgs.from_cli_args(ns).parallel_config()
    # the flag beats the environment, the environment fills what no flag gives
    assert (parallel.master_addr, parallel.master_port) == ("10.9.9.9", 29500)
    assert parallel.ranks_per_node == 8 and list(parallel.node_ranks) == list(range(8, 16))
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(ValueError, match="--nnodes above 1 needs .* --master-port"):
        EngineArgs(tensor_parallel_size=4, nnodes=2)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size x --pipeline-parallel-size \(3\) must be a multiple of --nnodes \(2\)"):
        ParallelConfig(tensor_parallel_size=3, nnodes=2, master_port=1)
    with pytest.raises(ValueError, match=r"--node-rank must be in 0\.\.1, got 2"):
        ParallelConfig(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=1, secret=SECRET.encode())
    # several nodes need the shared secret: from the environment, or the flag over it
    assert parallel.secret == SECRET.encode()
    ns = build_parser().parse_args(["serve", "m", "-tp", "2", "--nnodes", "2", "--master-port", "1",
                                    "--distributed-secret", "x" * 16])
    assert EngineArgs.from_cli_args(ns).parallel_config().secret == b"x" * 16
    assert "secret" not in repr(parallel) and SECRET not in repr(parallel)
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(ValueError, match=f"needs a shared secret of at least 16 bytes.*{SECRET_ENV}"):
        EngineArgs(tensor_parallel_size=2, nnodes=2, master_port=1).parallel_config()
    assert ParallelConfig(tensor_parallel_size=2).secret == b""  # one node: nothing crosses a network


@pytest.mark.unit
def test_a_sealed_message_opens_only_with_its_secret_and_its_number():
    from pageserve.runtime.worker import NotAuthentic, seal, unseal

    key, payload = b"k" * 32, b"the step's bytes"
    assert unseal(key, 7, seal(key, 7, payload)) == payload
    for bad in (seal(key, 6, payload),  # replayed or out of order
                seal(b"x" * 32, 7, payload),  # another secret
                seal(key, 7, payload)[:-1] + b"!",  # tampered
                b"short"):
        with pytest.raises(NotAuthentic, match="refused"):
            unseal(key, 7, bad)


@pytest.mark.unit
def test_a_message_recorded_in_another_run_is_refused(monkeypatch):
    """Relay signs with a key of the run (the secret and every rank's random bytes), so a
    message recorded in an earlier run with the same secret fails in this one."""
    from pageserve.runtime import worker

    monkeypatch.setattr(worker.dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(worker.dist, "all_gather", lambda parts, mine, group: [p.copy_(mine) for p in parts])
    relay = object.__new__(worker.Relay)
    relay.group = None
    first, second = relay._run_key(b"s" * 32), relay._run_key(b"s" * 32)
    recorded = worker.seal(first, 1, b"allocate_kv_cache")
    assert worker.unseal(first, 1, recorded) == b"allocate_kv_cache"
    with pytest.raises(worker.NotAuthentic, match="refused"):
        worker.unseal(second, 1, recorded)


# node 0's rank 0 as someone who reached the master port without the secret: it joins the
# process group, answers the KV sizing, then relays a pickle that would write a file if unpickled
_FORGER = """
import datetime, os, pickle, sys
import torch.distributed as dist
from pageserve.runtime.config import ParallelConfig
from pageserve.runtime.worker import Relay

class Payload:
    def __reduce__(self):
        return (open, (sys.argv[2], "w"))

port = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
relay = Relay(ParallelConfig(tensor_parallel_size=2, nnodes=2, master_port=port, secret=b"not the nodes' secret"))
relay.min(1 << 30)
relay.send(pickle.dumps(("execute", (Payload(),))))
"""


@pytest.mark.engine
def test_a_node_refuses_a_message_its_secret_did_not_sign(tiny_model_dir, tmp_path):
    port = free_port()
    marker = tmp_path / "unpickled"
    node1 = HeadlessNode(tiny_model_dir, port, f"headless-{port}.log")
    forger = subprocess.Popen([sys.executable, "-c", _FORGER, str(port), str(marker)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert node1.wait(60) == 1, node1.output()
        assert "relayed message 1 is not signed with this node's secret" in node1.output()
        assert not marker.exists()
    finally:
        if node1.proc.poll() is None:
            node1.wait(0)
        forger.kill()
        forger.wait()


@pytest.mark.unit
def test_a_node_above_0_runs_only_headless_and_node_0_never_does(tiny_model_dir):
    from pageserve.runtime.engine_args import EngineArgs
    from pageserve.runtime.executor import run_headless_node

    before = _children()
    with pytest.raises(ValueError, match="--node-rank 1 runs only workers: .* --headless"):
        LLM(str(tiny_model_dir), tensor_parallel_size=2, nnodes=2, node_rank=1, master_port=1)
    with pytest.raises(ValueError, match="--headless runs the workers of a node other than the engine's"):
        run_headless_node(EngineArgs(model=str(tiny_model_dir), tensor_parallel_size=2, nnodes=2, master_port=1))
    assert _children() <= before
