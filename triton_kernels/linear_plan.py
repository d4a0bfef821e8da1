"""Which matmul a float32 linear layer runs on CPU, the C kernel (cpu_kernels.CpuKernels) or
torch's, by the number of rows in the step: timed once at start-up on the model's own
weights."""

from __future__ import annotations

import bisect
import logging
import time

import torch
import torch.nn.functional as F

from pageserve.triton_kernels.cpu_kernels import CpuKernels, blocks, in_features

logger = logging.getLogger(__name__)


# rows of a step at which the two paths are timed; a step takes the choice of the next bucket up
# (a mixed step of 64 decodes and a prompt or two has 100-500 rows)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# values of the weights timed at most: a larger model's are timed on an even share of each
# matrix's rows, all its columns (an 8B model's two layers, 436M values: 41 s of a start)
MEASURED_VALUES = 64 << 20


def rows_share(weights: list[torch.Tensor], budget: int = MEASURED_VALUES) -> list[torch.Tensor]:
    """`weights`, or the first rows of each, the same share of every matrix, within `budget`
    values (blocks stay blocks)."""
    total = sum(w.shape[0] * in_features(w) for w in weights)
    if total <= budget:
        return weights
    out = []
    for w in weights:
        rows = max(1, w.shape[0] * budget // total)
        fmt = getattr(w, "block_format", None)
        out.append(w.detach()[:rows] if fmt is None else blocks(w.data[:rows], fmt, in_features(w)))
    return out


class LinearPlan:
    """Which matmul a float32 linear layer runs, by the number of rows in the step. Measured
    once at start-up on the model's own weights (`measure`); until then torch's matmul. Steps
    above the largest bucket take its choice (both paths' time grows with the rows from there)."""

    def __init__(self, kernel: CpuKernels):
        self.kernel = kernel
        self.bf16 = kernel.bf16_dot  # the kernel multiplies in bfloat16: so must torch's matmul
        self.multiplied = kernel.multiplied
        self.use_kernel = [False] * len(ROW_BUCKETS)
        self.timings: dict[int, tuple[float, float]] = {}  # rows -> (torch s, kernel s)

    def uses_kernel(self, rows: int) -> bool:
        return self.use_kernel[min(bisect.bisect_left(ROW_BUCKETS, rows), len(ROW_BUCKETS) - 1)]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.uses_kernel(x.shape[0]):
            return self.kernel(x, weight, bias)  # which checks the dtypes
        return self.torch_linear(x, weight, bias)

    def torch_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """torch's matmul of what the C linear computes: a matrix kept in bfloat16 or GGUF blocks
        widened (exactly) per call (bfloat16: 2% of a 512-row step's matmuls); where the kernel
        multiplies in bfloat16, torch's bfloat16 matmul of the rounded values, y in float32."""
        if self.bf16:
            y = F.linear(x.bfloat16(), self.multiplied(weight).bfloat16()).float()
            return y if bias is None else (y + bias).bfloat16().float()
        return F.linear(x, weight if weight.dtype == x.dtype else self.multiplied(weight), bias)

    def measure(self, weights: list[torch.Tensor], reps: int = 3) -> None:
        """Time both paths over `weights` (the runner passes two decoder layers'; the lm_head
        follows their choice; rows_share of a large model's) at each row bucket, alternating,
        best of `reps`: the faster one runs steps of that size. Weights kept compact time
        torch's matmul with the copy it is then given (torch_linear)."""
        if not weights or any(w.dtype not in (torch.float32, torch.bfloat16, torch.uint8) for w in weights):
            return
        weights = rows_share(weights)
        for i, rows in enumerate(ROW_BUCKETS):
            xs = {in_features(w): torch.randn(rows, in_features(w)) for w in weights}
            best = [float("inf"), float("inf")]
            for _ in range(reps):
                for j, fn in enumerate((self.torch_linear, self.kernel)):
                    t = time.perf_counter()
                    for w in weights:
                        fn(xs[in_features(w)], w)
                    best[j] = min(best[j], time.perf_counter() - t)
            self.timings[rows] = (best[0], best[1])
            self.use_kernel[i] = best[1] < best[0]
        logger.info("CPU linear, rows: torch / kernel ms, chosen: %s", ", ".join(
            f"{r}: {t * 1e3:.2f}/{k * 1e3:.2f} {'kernel' if use else 'torch'}"
            for (r, (t, k)), use in zip(self.timings.items(), self.use_kernel)))
