"""MoE router (kprof.kernels.moe_router) against its reference: indices, counts and offsets
exactly, weights and d logits within the dtype's tolerance, softmax/sigmoid x renormalise, fp32 and
bf16, odd shapes incl. no tokens, empty experts and all tokens on one expert.

CPU: the Triton kernel in the interpreter, and the CUDA source compiled by nvcc for sm_90 (not
run). GPU: the CUDA kernel forced ($KPROF_MOE_ROUTER_BACKEND=cuda, so a silent fallback fails),
and the Triton kernel beside it. Logits are distinct within each row (in bf16 too), so the
selection has no ties; ties are tested on their own.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kprof.errors import KprofError
from kprof.kernels import moe_router as R
from kprof.kernels.common import assert_close

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")
slow = pytest.mark.slow
DTYPES = [torch.float32, torch.bfloat16]
# (tokens, experts, k)
SHAPES = [
    (37, 10, 3),
    (5, 64, 4),  # 20 slots over 64 experts: most experts empty
    (0, 8, 2),  # no tokens
    (1, 1, 1),
    pytest.param((129, 60, 4), marks=slow),  # Qwen-MoE-like
    pytest.param((67, 256, 8), marks=slow),  # DeepSeek-like
    pytest.param((4096, 256, 8), marks=pytest.mark.gpu),
]
MODES = [("softmax", True), ("softmax", False), ("sigmoid", True), ("sigmoid", False)]


def distinct_logits(t, e, dtype, device, seed=0):
    """Each row a permutation of e values 0.05 apart: distinct in bf16 too (|x| < 6.4 < 8, where
    the bf16 spacing is 1/32 < 0.05)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(e, generator=g) for _ in range(t)]
    x = (torch.stack(rows).float() - e / 2) * 0.05 if t else torch.empty(0, e)
    return x.to(dtype).to(device)


def check(logits, k, score, renorm, seed=1):
    x = logits.detach().clone().requires_grad_()
    out = R.moe_router(x, k, score, renorm)
    hi = torch.float64
    xr = logits.detach().to(hi).requires_grad_()
    ref = R.moe_router_reference(xr, k, score, renorm)
    assert torch.equal(out.indices, ref.indices), "indices"
    assert torch.equal(out.counts, ref.counts) and torch.equal(out.offsets, ref.offsets), "counts/offsets"
    assert out.weights.dtype == torch.float32 and out.indices.dtype == torch.int32
    assert_close(out.weights, ref.weights, torch.float32, msg="weights")  # computed in fp32 for every input dtype
    dw = torch.randn(out.weights.shape, generator=torch.Generator().manual_seed(seed)).to(logits.device)
    (gx,) = torch.autograd.grad((out.weights * dw).sum(), x) if x.numel() else (torch.zeros_like(x),)
    (gr,) = torch.autograd.grad((ref.weights * dw.to(hi)).sum(), xr) if x.numel() else (torch.zeros_like(xr),)
    assert gx.dtype == logits.dtype
    assert_close(gx, gr, msg="d logits")
    return out


@pytest.fixture(params=["triton", "cuda"] if torch.cuda.is_available() else ["triton"])
def backend(request, monkeypatch):
    monkeypatch.setenv("KPROF_MOE_ROUTER_BACKEND", request.param)
    return request.param


@pytest.mark.parametrize("score, renorm", MODES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(shape, dtype, score, renorm, backend, device):
    t, e, k = shape
    check(distinct_logits(t, e, dtype, device), k, score, renorm)
    assert R.router_backend(device) == backend


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [1, 2])
def test_all_tokens_on_one_expert(k, dtype, backend, device):
    logits = distinct_logits(33, 8, dtype, device)
    logits[:, 5] = 20.0  # every token's first choice
    out = check(logits, k, "softmax", k > 1)
    assert int(out.counts[5]) == 33 and int(out.counts.sum()) == 33 * k
    if k == 1:
        assert out.offsets.tolist() == [0] * 5 + [33] * 3


def test_ties_go_to_the_lower_expert(backend, device):
    out = R.moe_router(torch.zeros(3, 6, device=device), 4)
    assert out.indices.tolist() == [[0, 1, 2, 3]] * 3
    assert_close(out.weights, torch.full((3, 4), 0.25), torch.float32)


def test_no_grad_through_indices(device):
    x = distinct_logits(4, 8, torch.float32, device).requires_grad_()
    out = R.moe_router(x, 2)
    assert out.weights.requires_grad and not out.indices.requires_grad and not out.offsets.requires_grad


def test_backend_choice_on_cpu(monkeypatch):
    assert R.router_backend("cpu") == "triton"  # the interpreter (tests/conftest.py)
    monkeypatch.setenv("KPROF_MOE_ROUTER_BACKEND", "reference")
    assert R.router_backend("cpu") == "reference"
    monkeypatch.setenv("KPROF_MOE_ROUTER_BACKEND", "cuda")
    with pytest.raises(KprofError, match="cuda"):
        R.router_backend("cpu")
    monkeypatch.setenv("KPROF_MOE_ROUTER_BACKEND", "fast")
    with pytest.raises(KprofError, match="auto, cuda, triton or reference"):
        R.router_backend("cpu")


@pytest.mark.parametrize("bad, match", [
    (lambda: R.moe_router(torch.zeros(2, 4), 5), "k=5"),
    (lambda: R.moe_router(torch.zeros(2, 40), 33), "k=33"),
    (lambda: R.moe_router(torch.zeros(2, 3, 4), 1), "tokens, experts"),
    (lambda: R.moe_router(torch.zeros(2, 4), 1, score="relu"), "softmax"),
])
def test_errors(bad, match):
    with pytest.raises(KprofError, match=match):
        bad()


# ----- the CUDA source compiles for sm_90 (nvcc, not run), without spills -----

CSRC = Path(R.__file__).parent / "csrc" / "moe_router.cu"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
def test_cuda_source_compiles_for_sm90(tmp_path):
    out = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-O3", "-std=c++17", "-Xptxas", "-v", "-o",
                          str(tmp_path / "r.cubin"), str(CSRC)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", out.stderr)]
    assert spills and not any(spills), out.stderr  # 6 kernels: fwd and bwd x 3 dtypes
    assert (tmp_path / "r.cubin").stat().st_size > 1000


# ----- GPU: cache hit in a second process, fallback without a compiler -----


@pytest.mark.gpu
def test_second_process_loads_cached_extension(tmp_path):
    env = {**os.environ, "KPROF_CACHE_DIR": str(tmp_path)}
    script = ("import time, torch; from kprof.kernels import cuda_jit, moe_router as R; t = time.perf_counter(); "
              "_, how = cuda_jit.load(R.extension_source(), cuda_jit.arch_of(torch.device('cuda'))); "
              "print(how, f'{time.perf_counter() - t:.3f}')")
    first = subprocess.run(["python", "-c", script], capture_output=True, text=True, env=env, timeout=900)
    second = subprocess.run(["python", "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert first.stdout.split()[0] == "built", first.stderr[-2000:]
    assert second.stdout.split()[0] == "cached", second.stderr[-2000:]
    print(f"router extension: first load {first.stdout.split()[1]} s, cached load {second.stdout.split()[1]} s")


@pytest.mark.gpu
def test_no_compiler_falls_back_to_triton(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("KPROF_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(R, "_ext_failed", {})
    monkeypatch.setattr(R, "_noticed", set())
    monkeypatch.setattr(R.cuda_jit, "_loaded", {})
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler.*Triton") as w:
        assert R.router_backend("cuda") == "triton"
    assert len(str(w[0].message).splitlines()) == 1
    check(distinct_logits(37, 10, torch.bfloat16, "cuda"), 3, "softmax", True)
