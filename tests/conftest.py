import gc
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the default model's GGUF is converted once into the repo's own cache, not the user's
os.environ.setdefault("PAGESERVE_CACHE", str(ROOT / ".cache" / "pageserve"))

from pageserve.loadtest.tiny_model import build_tiny_model  # noqa: E402
from pageserve.runtime.engine_args import EngineArgs  # noqa: E402

_swap_space_gib = EngineArgs.swap_space_gib


def _test_swap_space_gib(self, device):
    """In-process engines on a CPU: 64 MiB of swap space unless a test asks for more. Each
    engine zero-fills its swap space at start-up, and 1 GiB took seconds an engine late in the
    suite, when dropped engines' memory still waits for the collector."""
    if self.swap_space is None and device.type == "cpu":
        return 1 / 16
    return _swap_space_gib(self, device)


EngineArgs.swap_space_gib = _test_swap_space_gib


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    from pageserve.runtime import LLM

    return LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01,
               max_num_batched_tokens=64, debug_checks=True)


@pytest.fixture(scope="session")
def native_kernels():
    """The C kernels built from this checkout for this CPU (what an engine here loads), once:
    in the cache the engines load them from (keyed by the sources and flags)."""
    from pageserve.runtime.models.loader import cache_root
    from pageserve.triton_kernels import cpu_kernels

    k = cpu_kernels.load(cache_root() / "kernels")
    if k is None:
        pytest.skip("no C compiler here: the CPU path keeps torch's ops")
    return k


@pytest.fixture
def own_cache(tmp_path, monkeypatch) -> Path:
    """A $PAGESERVE_CACHE of the test's own (for what it converts and caches), holding a copy of
    the C kernels this run built, so that its engines do not compile them again (15 s)."""
    import shutil

    from pageserve.runtime.models.loader import cache_root
    from pageserve.triton_kernels import cpu_kernels

    built = cpu_kernels.load(cache_root() / "kernels")
    cache = tmp_path / "cache"
    (cache / "kernels").mkdir(parents=True)
    if built is not None:
        shutil.copy2(built.path, cache / "kernels")
    monkeypatch.setenv("PAGESERVE_CACHE", str(cache))
    return cache


@pytest.fixture(scope="session")
def avx2_kernels(tmp_path_factory):
    """The C kernels built for AVX2 on a CPU that has AVX-512 (the path older CPUs take), once."""
    from pageserve.runtime.config import cpu_flags
    from pageserve.triton_kernels import cpu_kernels

    if "avx512f" not in cpu_flags():
        pytest.skip("no AVX-512 here: the native build is the AVX2 one")
    k = cpu_kernels.load(tmp_path_factory.mktemp("avx2"), extra_flags=("-mno-avx512f",))
    assert k.isa == "AVX2"
    return k


@pytest.fixture(scope="session")
def portable_kernels(tmp_path_factory):
    """The C kernels built for any x86-64 (no AVX2, no F16C: the scalar paths, the software
    half-float conversion), once."""
    import platform

    from pageserve.triton_kernels import cpu_kernels

    if platform.machine() != "x86_64":
        pytest.skip("the portable build is an x86-64 one")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_kernels, "FLAGS", [f if f != "-march=native" else "-march=x86-64" for f in cpu_kernels.FLAGS])
        k = cpu_kernels.load(tmp_path_factory.mktemp("portable"))
    assert k is not None and not k.vectorized
    return k


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir):
    """The real server on the tiny model, in this process, for a module's tests."""
    from pageserve.runtime.engine_args import EngineArgs
    from tests.live_server import InProcessServer

    s = InProcessServer(EngineArgs(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01,
                                   max_model_len=512))
    yield s
    s.stop()


def assert_pool_clean(engine) -> None:
    """Every block back in the pool, nothing left running, counts add up."""
    assert not engine.requests, f"requests left behind: {list(engine.requests)}"
    assert not engine.scheduler.has_unfinished()
    assert not engine.kv.req_blocks
    engine.kv.check_integrity()
    free, cached, in_use = engine.kv.pool.counts()
    assert in_use == 0 and free + cached == engine.kv.pool.num_blocks
    images = engine.scheduler.encoder_cache
    assert images.used == 0 and not images.refs and not any(images.held.values())


@pytest.fixture(autouse=True)
def _pool_intact_after_engine_tests(request):
    """After every test that used the shared engine, its pool must be whole again."""
    yield
    if "tiny_llm" in request.fixturenames:
        assert_pool_clean(request.getfixturevalue("tiny_llm").engine)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_collected_at = [0]


def pytest_runtest_teardown(item, nextitem):
    """An engine that a test dropped is cyclic garbage (a GiB of swap space and its KV pool)
    until the collector's next full pass: collected once the process has grown 512 MB, else the
    suite's engines pile up past the machine's memory (22 GB by half-way through)."""
    if _resident_bytes() > _collected_at[0] + (512 << 20):
        gc.collect()
        _collected_at[0] = _resident_bytes()


def pytest_collection_modifyitems(items):
    """Tests on the default model (the `server` fixture loads it: most of a minute on 2 cores)
    are slow; `pytest -m "not slow"` is the fast loop."""
    for item in items:
        if "server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def server():
    """The real server on the default model, in this process (so tests can look inside the
    engine). float32: unlike bfloat16, its greedy output does not depend on what else is in the
    batch, so streamed, concurrent and alone results can be compared token for token."""
    from pageserve.runtime.engine_args import EngineArgs
    from tests.live_server import InProcessServer

    srv = InProcessServer(EngineArgs(dtype="float32", kv_cache_memory=0.25, swap_space=0.05,
                                     max_model_len=2048, max_num_seqs=32),
                          served_model_names=("SmolLM2-135M-Instruct", "default"))
    yield srv
    srv.stop()
