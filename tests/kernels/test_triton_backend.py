"""The tiny random-weight model end to end on the Triton backend (under the interpreter on
CPU): greedy tokens equal the torch backend's, through chunked prefill mixed with decodes and
prefix-cache hits."""

from __future__ import annotations

import pytest
import torch

from pageserve.runtime import LLM, SamplingParams
from pageserve.runtime.engine_args import EngineArgs
from pageserve.runtime.models.layers import Experts
from pageserve.triton_kernels import torch_ops
from tests.conftest import assert_pool_clean
from tests.fake_cuda import FakeCuda

pytestmark = [pytest.mark.engine, pytest.mark.slow]


SHARED = list(range(3, 60))
PROMPTS = [[5, 6, 7], list(range(10, 100)), SHARED + [70, 71], SHARED + [80], [9] * 33]


def generate(model_dir, device: str, backend: str, block_size: int, prompts=PROMPTS,
             max_tokens: int = 12) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model_dir), dtype="float32", device=device, attention_backend=backend,
              block_size=block_size, kv_cache_memory=0.01, max_num_batched_tokens=48, max_num_seqs=len(prompts),
              seed=0,  # the sequence limit keeps the engine's warm-up step (interpreted) small
              # step by step on CUDA too: a step scheduled while the one before runs cannot hit
              # the blocks that one is writing, and the shared prompts here arrive together
              async_scheduling=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def test_triton_backend_generates_the_torch_backends_tokens(tiny_model_dir, device):
    """One block size end to end (the interpreter makes each ~25 s); the kernels' own tests
    (test_paged_attention.py) cover block sizes 8, 16 and 32 against a reference."""
    want, _ = generate(tiny_model_dir, device, "torch", 16)
    got, llm = generate(tiny_model_dir, device, "triton", 16)
    backend = llm.engine.runner.kernels
    assert backend.name == "triton" and backend.ops.rms_norm.__module__ == "pageserve.triton_kernels.rms_norm"
    assert got == want
    assert all(len(t) == 12 for t in got)
    assert llm.engine.kv.prefix_hits > 0  # the shared prompts reused cached blocks
    assert_pool_clean(llm.engine)


def test_triton_backend_without_cuda_or_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = EngineArgs(model="unused", device="cpu", attention_backend="triton")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        args.resolve_device()
    assert EngineArgs(model="unused", device="cpu").resolve_device().attention_backend == "torch"


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_moe_models_on_the_triton_backend(tmp_path, device, arch):
    """The MoE feed-forward through the Triton fused_moe (q/k norms and the shared expert
    through the Triton rms_norm and matmuls), against the torch backend's tokens: a prompt
    chunked past the step's budget beside a short one, then decodes of both (the prefix cache
    and the block sizes are the test above's and the kernels' own)."""
    from pageserve.loadtest.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / arch, arch=arch)
    prompts = PROMPTS[:2]
    want, _ = generate(model_dir, device, "torch", 16, prompts, max_tokens=6)
    got, llm = generate(model_dir, device, "triton", 16, prompts, max_tokens=6)
    assert llm.engine.runner.kernels.ops.fused_moe.__module__ == "pageserve.triton_kernels.fused_moe"
    assert got == want


@pytest.mark.parametrize("fmt", ["ct-w4a16", "fp8-block"])
def test_quantized_experts_on_the_triton_backend(tmp_path, device, fmt, monkeypatch):
    """Quantized experts: one grouped GEMM an expert with tokens (the Triton fused_moe takes
    dense experts only), the torch backend's tokens; no CUDA graphs (the loop reads the
    experts' token counts)."""
    from pageserve.loadtest.quantized_copy import quantized_copy
    from pageserve.loadtest.tiny_model import build_tiny_model

    src = build_tiny_model(tmp_path / "src", "qwen3_moe", moe_intermediate_size=64, head_dim=32)
    model_dir = quantized_copy(src, tmp_path / fmt, fmt, group_size=32)
    prompts = PROMPTS[:2]
    want, _ = generate(model_dir, device, "torch", 16, prompts, max_tokens=6)
    got, llm = generate(model_dir, device, "triton", 16, prompts, max_tokens=6)
    assert llm.engine.runner.model.layers[0].mlp.experts.parts["w2"][0].quant.group_size == 32
    assert got == want
    runner = llm.engine.runner
    monkeypatch.setattr(runner, "dev", FakeCuda())  # a GPU would capture this model's decode steps...
    experts = [m for m in runner.model.modules() if isinstance(m, Experts)]
    assert runner.graph_sizes(8) == []  # ...but for the quantized experts
    monkeypatch.setattr(experts[0], "parts", {})
    monkeypatch.setattr(experts[1], "parts", {})
    assert runner.graph_sizes(8) == [1, 2, 4, 8]


@pytest.mark.parametrize("fmt", ["ct-w4a16-asym", "ct-fp8", "fp8-block", "fp8-static", "modelopt-nvfp4", "gptq-int8",
                                 "ct-w8a16", "ct-mxfp4", "bnb-nf4"])
def test_quantized_checkpoints_on_the_triton_backend(tmp_path, device, fmt):
    """A quantized checkpoint's linear layers through the Triton grouped GEMM (W4A16, block-wise
    FP8, NVFP4, 8-bit GPTQ) and the FP8 / INT8 scaled GEMM (activations quantized per token), in the engine: the
    grouped GEMM multiplies the same values as the torch backend (the same tokens); W8A8 also
    rounds each token's activations to 8 bits (per token, or with AutoFP8's static scales),
    which the weight-only torch backend does not, so only each prompt's first token is held to
    the torch backend's."""
    from pageserve.loadtest.quantized_copy import quantized_copy
    from pageserve.loadtest.tiny_model import build_tiny_model

    src = build_tiny_model(tmp_path / "src")
    model_dir = quantized_copy(src, tmp_path / fmt, fmt, group_size=32)
    prompts = PROMPTS[:2]
    want, _ = generate(model_dir, device, "torch", 16, prompts, max_tokens=6)
    got, llm = generate(model_dir, device, "triton", 16, prompts, max_tokens=6)
    weight = llm.engine.runner.model.layers[0].mlp.down_proj.weight
    kinds = {"ct-w4a16-asym": "int4", "modelopt-nvfp4": "fp4", "ct-mxfp4": "fp4", "gptq-int8": "int8",
             "ct-w8a16": "int8", "bnb-nf4": "nf4"}
    assert weight.quant.kind == kinds.get(fmt, "fp8")
    assert weight.quant.group_size == {"ct-fp8": 0, "fp8-static": 0, "modelopt-nvfp4": 16, "bnb-nf4": 64}.get(fmt, 32)
    assert weight.quant.input_scale == (pytest.approx(1 / 56) if fmt == "fp8-static" else None)  # down_proj's
    if fmt == "fp8-static":  # the backend quantizes x with the layer's static scale: inputs past 8 clamp
        x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.device) * 20
        y = llm.engine.runner.kernels.matmul(x, weight)
        static = torch_ops.scaled_linear(x, weight, weight.quant.scales, "fp8", None, weight.quant.input_scale)
        assert torch.allclose(y, static, rtol=1e-4, atol=1e-4 * static.abs().max().item())
        assert not torch.allclose(y, torch_ops.scaled_linear(x, weight, weight.quant.scales, "fp8"), rtol=0.05)
    if fmt in ("ct-w4a16-asym", "fp8-block", "modelopt-nvfp4", "gptq-int8", "ct-w8a16", "ct-mxfp4", "bnb-nf4"):
        # weight-only: the same values
        assert got == want
    else:
        assert [t[0] for t in got] == [t[0] for t in want]
    assert_pool_clean(llm.engine)
