"""The C float32 linear kernel of the CPU path (triton_kernels/cpu_linear.c) against a float64
matmul, the per-step-size choice between it and torch, and greedy parity with HF when every
step runs it."""

import pytest
import torch
import torch.nn.functional as F

from pageserve.runtime import LLM
from pageserve.triton_kernels import cpu_linear
from pageserve.loadtest.tiny_model import build_tiny_model
from tests.hf_reference import hf_greedy
from tests.test_parity import random_prompts, run_ours

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    k = cpu_linear.load(tmp_path_factory.mktemp("kernels"))
    if k is None:
        pytest.skip("no C compiler here: the CPU path keeps torch's matmul")
    return k


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17, 64])
@pytest.mark.parametrize("out_features,in_features", [(1, 1), (7, 13), (64, 576), (130, 1536), (3, 40)])
def test_matches_a_float64_matmul(kernel, rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen)
    for bias in (None, b):
        want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        got = kernel(x, w, bias)
        assert got.dtype == torch.float32 and got.shape == (rows, out_features)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4 * in_features ** 0.5)


def test_strided_rows_and_a_weight_slice(kernel):
    """Row views of a wider tensor (q/k/v split, a fused weight's rows) are read in place."""
    x = torch.randn(6, 100)[:, 10:74]  # row stride 100
    w = torch.randn(300, 64)[100:200]  # rows of a fused weight
    assert torch.allclose(kernel(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    x3 = torch.randn(2, 3, 64)  # leading dims kept
    assert torch.allclose(kernel(x3, w), F.linear(x3, w), rtol=1e-5, atol=1e-4)


def test_wrong_input_is_an_error(kernel):
    with pytest.raises(TypeError):
        kernel(torch.randn(1, 8, dtype=torch.bfloat16), torch.randn(4, 8))
    with pytest.raises(ValueError):
        kernel(torch.randn(1, 8), torch.randn(4, 9))
    with pytest.raises(ValueError):
        kernel(torch.randn(1, 8), torch.randn(8, 4).t())  # columns not contiguous


def test_the_plan_runs_the_faster_path_per_step_size(kernel):
    plan = cpu_linear.LinearPlan(kernel)
    calls = []
    plan.kernel = lambda x, w, b=None: calls.append(x.shape[0]) or kernel(x, w, b)
    plan.measure([torch.randn(256, 128), torch.randn(128, 256)], reps=1)
    assert set(plan.timings) == set(cpu_linear.ROW_BUCKETS)
    assert all(t > 0 and k > 0 for t, k in plan.timings.values())
    plan.use_kernel = [rows <= 4 for rows in cpu_linear.ROW_BUCKETS]
    calls.clear()
    w = torch.randn(16, 8)
    for rows in (1, 3, 4, 5, 200):
        x = torch.randn(rows, 8)
        assert torch.allclose(plan(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert calls == [1, 3, 4]  # 5 takes the bucket of 8, 200 is past the last bucket


def test_no_compiler_keeps_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert cpu_linear.load(tmp_path / "empty") is None
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PAGESERVE_NO_CPU_KERNELS", "1")
    assert cpu_linear.load(tmp_path / "empty") is None


@pytest.mark.engine
def test_greedy_parity_with_the_kernel_on_every_step(tmp_path, kernel, monkeypatch):
    """Chunked prompts (up to 64 rows a step) and decodes all go through the kernel."""
    def everywhere(self, weights, reps=3):
        self.use_kernel = [True] * len(cpu_linear.ROW_BUCKETS)
    monkeypatch.setattr(cpu_linear.LinearPlan, "measure", everywhere)
    model_dir = build_tiny_model(tmp_path / "llama", arch="qwen2")  # q/k/v biases too
    prompts = random_prompts(384)[:10]
    expected = hf_greedy(model_dir, prompts, max_new_tokens=16)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=0.01, max_num_batched_tokens=64,
              debug_checks=True)
    plan = llm.engine.runner.kernels.linear_plan
    assert plan is not None and all(plan.use_kernel)
    assert run_ours(llm, prompts, 16) == expected
