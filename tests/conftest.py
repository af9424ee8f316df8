"""Test setup: without CUDA, Triton kernels run through the interpreter on CPU tensors.

TRITON_INTERPRET must be set before triton is imported (triton.jit reads it at decoration time),
so it is set here, at the top of the first conftest, before any kprof.kernels import.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA (GPU test; run on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE
