"""MoE permute / unpermute (kprof.kernels.moe_permute) against their references: positions
exactly (the stable-sort order), rows, the weighted combine and the grads of x, the expert outputs
and the weights, fp32 and bf16, incl. no tokens, empty experts and all tokens on one expert.

The reference runs on the same (dtype-rounded) inputs upcast to fp64 and is cast back; the grads'
upstream dy is rounded to the kernel's dtype first, as autograd gives it to the kernel.
"""

from __future__ import annotations

import pytest
import torch

from kprof.errors import KprofError
from kprof.kernels import moe_permute as P
from kprof.kernels import moe_router as R
from kprof.kernels.common import assert_close

slow = pytest.mark.slow
DTYPES = [torch.float32, torch.bfloat16]
# (tokens, experts, k, hidden)
SHAPES = [
    (37, 10, 3, 33),
    (5, 64, 4, 7),  # most experts empty
    (0, 8, 2, 16),  # no tokens
    pytest.param((300, 5, 2, 130), marks=slow),  # several chunks of 128 slots, a second column block
    pytest.param((2048, 64, 8, 1024), marks=pytest.mark.gpu),
]


def routing(t, e, k, device, one_expert=False, seed=0):
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(seed)).to(device)
    if one_expert:
        logits[:, 1] = 30.0
    return R.moe_router_reference(logits, k)


def run(x, r, yscale, dy, impl):
    """permute -> (rows * yscale, a stand-in for the experts) -> unpermute; returns y and grads."""
    x = x.detach().clone().requires_grad_()
    w = r.weights.detach().clone().to(x.dtype if x.dtype == torch.float64 else torch.float32).requires_grad_()
    permute, unpermute = (P.moe_permute, P.moe_unpermute) if impl == "kernel" else (
        P.moe_permute_reference, P.moe_unpermute_reference)
    xp, pos = permute(x, r.indices, r.offsets)
    y = unpermute(xp * yscale.to(x.dtype), pos, w)
    gx, gw = torch.autograd.grad(y, (x, w), dy.to(x.dtype)) if y.numel() else (torch.zeros_like(x), torch.zeros_like(w))
    return xp, pos, y, gx, gw


@pytest.mark.parametrize("one_expert", [False, True], ids=["spread", "one_expert"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(shape, dtype, one_expert, device):
    t, e, k, h = shape
    r = routing(t, e, k, device, one_expert)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, h, generator=g).to(dtype).to(device)
    # Powers of two: the stand-in expert (rows * yscale) is exact in bf16 as in fp64, so the two
    # sides differ only by the kernels' own rounding (a random scale rounded in bf16 on one side
    # only moved d weights by ~0.05 at |w grad| ~ 1: the test's error, not the kernel's).
    yscale = (2.0 ** torch.randint(-1, 2, (t * k, 1), generator=g).float()).to(device)
    dy = torch.randn(t, h, generator=g).to(dtype).to(device)  # as autograd hands it to the kernel
    xp, pos, y, gx, gw = run(x, r, yscale, dy, "kernel")
    xpr, posr, yr, gxr, gwr = run(x.double(), r, yscale.double(), dy.double(), "reference")
    assert torch.equal(pos, posr), "positions"
    assert torch.equal(xp.double(), xpr), "permuted rows"  # a copy: exact
    assert_close(y, yr, msg="y")
    assert_close(gx, gxr, msg="d x")
    assert_close(gw, gwr, torch.float32 if dtype == torch.float32 else dtype, msg="d weights")
    if one_expert and t:
        assert sorted(pos[:, 0].tolist()) == list(range(int(r.offsets[0]), int(r.offsets[1])))


def test_positions_are_expert_contiguous_and_token_ordered(device):
    r = routing(50, 6, 2, device)
    _, pos = P.moe_permute(torch.randn(50, 8, device=device), r.indices, r.offsets)
    starts = torch.cat([torch.zeros(1, dtype=torch.int32, device=device), r.offsets[:-1]])
    for e in range(6):
        rows = pos[r.indices == e]  # token-major order
        assert rows.tolist() == list(range(int(starts[e]), int(r.offsets[e])))


def test_errors():
    with pytest.raises(KprofError, match="indices must be"):
        P.moe_permute(torch.zeros(4, 8), torch.zeros(3, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(KprofError, match="T\\*k"):
        P.moe_unpermute(torch.zeros(5, 8), torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 2))
