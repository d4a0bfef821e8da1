"""Pipeline parallelism across nodes, on one machine: two processes act as two nodes
(--nnodes 2, --pipeline-parallel-size 2, one stage each, gloo on 127.0.0.1). Node 0 runs the
real server and the last stage (rank 0, which samples); node 1 runs `pageserve serve
--headless` and the first stage, which gets every step from rank 0's relay and sends its hidden
states back over torch.distributed. The openai client streams a chat with one process's text;
SIGTERM on node 0 ends both nodes with status 0; SIGKILL of either node ends the other
non-zero, and no rank is left behind."""

import os
import signal
import time

import openai
import psutil
import pytest

from pageserve.runtime import LLM, SamplingParams
from pageserve.runtime.config import SECRET_ENV
from tests.live_server import SubprocessServer
from tests.test_tensor_parallel import gone, spawned_ranks
from tests.test_tensor_parallel_nodes import ENGINE_FLAGS, SECRET, HeadlessNode, free_port

pytestmark = pytest.mark.server
LAYOUT = ("--pipeline-parallel-size", "2")
MESSAGES = [{"role": "user", "content": "Say something about paged attention."}]


@pytest.fixture(autouse=True)
def _shared_secret(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)


def two_nodes(model_dir):
    """Node 1 (headless, the first stage), then node 0's server (the last stage)."""
    port = free_port()
    node1 = HeadlessNode(model_dir, port, f"headless-pp-{port}.log", LAYOUT)
    try:
        node1.wait_for_ranks()
        srv = SubprocessServer(str(model_dir), *ENGINE_FLAGS, *LAYOUT, "--nnodes", "2", "--node-rank", "0",
                               "--master-addr", "127.0.0.1", "--master-port", str(port))
    except BaseException:
        node1.wait(0)
        raise
    return srv, node1


def stop_both(srv, node1) -> None:
    if srv.proc.poll() is None:
        srv.stop()
    if node1.proc.poll() is None:
        node1.wait(0)


def test_two_stages_on_two_nodes_stream_a_chat_then_sigterm_ends_both(tiny_model_dir):
    one = LLM(str(tiny_model_dir), dtype="float32", max_model_len=512, kv_cache_memory=0.01, swap_space=0)
    expected = one.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    srv, node1 = two_nodes(tiny_model_dir)
    try:
        ranks = spawned_ranks(srv.proc.pid) + node1.ranks()
        assert len(ranks) == 2  # one stage on each node
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert len([p for p in pieces if p]) > 1 and "".join(pieces) == expected
        assert srv.stop() == 0, srv.output()  # SIGTERM on node 0
        assert node1.wait(30) == 0, node1.output()
    finally:
        stop_both(srv, node1)
    assert gone(ranks)


@pytest.mark.parametrize("victim", ["node0", "node1"])
def test_a_node_killed_ends_the_other_non_zero_and_leaves_no_rank(tiny_model_dir, victim):
    srv, node1 = two_nodes(tiny_model_dir)
    try:
        ranks = spawned_ranks(srv.proc.pid) + node1.ranks()
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        assert client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4).choices[0].message
        if victim == "node0":
            os.kill(srv.proc.pid, signal.SIGKILL)
            assert node1.wait(60) not in (0, None), node1.output()
        else:
            stage0 = node1.ranks()
            os.kill(node1.proc.pid, signal.SIGKILL)
            psutil.wait_procs(stage0, timeout=10)  # its rank follows it; the engine's next step fails
            with pytest.raises(openai.APIError):  # the engine fails at its next step
                client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)
            assert srv.proc.wait(60) != 0, srv.output()
    finally:
        stop_both(srv, node1)
    deadline = time.monotonic() + 15
    while not gone(ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(ranks)
