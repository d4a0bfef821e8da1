"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter (small shapes:
it is slow), or on CUDA when there is a GPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
