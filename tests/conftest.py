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
from hypothesis import settings  # noqa: E402

# CI runs hypothesis derandomized, so a run's outcome depends on the code, not on the seed; local
# runs keep exploring new examples. (A random example once found a wrong test premise: see
# tests/kernels/test_layer_norm.py::test_property_invariants.)
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

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
