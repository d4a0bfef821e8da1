"""Which matmul a float32 linear layer runs on CPU, the C kernel (cpu_kernels.CpuKernels) or
torch's, by the number of rows in the step: timed once at start-up on the model's own
weights."""

from __future__ import annotations

import bisect
import logging
import time

import torch
import torch.nn.functional as F

from pageserve.triton_kernels.cpu_kernels import CpuKernels, in_features

logger = logging.getLogger(__name__)


# rows of a step at which the two paths are timed; a step takes the choice of the next bucket up
# (a mixed step of 64 decodes and a prompt or two has 100-500 rows)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class LinearPlan:
    """Which matmul a float32 linear layer runs, by the number of rows in the step. Measured
    once at start-up on the model's own weights (`measure`); until then, and for steps above
    the largest bucket, torch's matmul."""

    def __init__(self, kernel: CpuKernels):
        self.kernel = kernel
        self.use_kernel = [False] * len(ROW_BUCKETS)
        self.timings: dict[int, tuple[float, float]] = {}  # rows -> (torch s, kernel s)

    def uses_kernel(self, rows: int) -> bool:
        return rows <= ROW_BUCKETS[-1] and self.use_kernel[bisect.bisect_left(ROW_BUCKETS, rows)]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.uses_kernel(x.shape[0]):
            return self.kernel(x, weight, bias)  # which checks the dtypes
        return F.linear(x, self.widened(weight, x.dtype), bias)

    def widened(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """weight in the activations' dtype: a matrix kept in bfloat16 or GGUF blocks for the C
        linear is widened (exactly) for torch's matmul, per call (bfloat16: 2% of a 512-row
        step's matmuls)."""
        if weight.dtype == dtype:
            return weight
        return self.kernel.widen(weight) if weight.dtype == torch.uint8 else weight.to(dtype)

    def measure(self, weights: list[torch.Tensor], reps: int = 3) -> None:
        """Time both paths over `weights` (the runner passes two decoder layers'; the lm_head
        follows their choice) at each row bucket, alternating, best of `reps`: the faster one
        runs steps of that size. Weights in bfloat16 (float32 activations) time torch's
        matmul with the float32 copy it is then given."""
        if not weights or any(w.dtype not in (torch.float32, torch.bfloat16, torch.uint8) for w in weights):
            return
        widened = lambda x, w: F.linear(x, self.widened(w, x.dtype))  # noqa: E731
        for i, rows in enumerate(ROW_BUCKETS):
            xs = {in_features(w): torch.randn(rows, in_features(w)) for w in weights}
            best = [float("inf"), float("inf")]
            for _ in range(reps):
                for j, fn in enumerate((widened, self.kernel)):
                    t = time.perf_counter()
                    for w in weights:
                        fn(xs[in_features(w)], w)
                    best[j] = min(best[j], time.perf_counter() - t)
            self.timings[rows] = (best[0], best[1])
            self.use_kernel[i] = best[1] < best[0]
        logger.info("CPU linear, rows: torch / kernel ms, chosen: %s", ", ".join(
            f"{r}: {t * 1e3:.2f}/{k * 1e3:.2f} {'kernel' if use else 'torch'}"
            for (r, (t, k)), use in zip(self.timings.items(), self.use_kernel)))
