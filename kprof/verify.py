"""First-call verification: a patched unit against its original, on the real input.

At the first call of a patched module (or function), both versions run forward and backward on
detached copies of the real arguments, with the same RNG state (dropout masks match) and the same
random output cotangents. Compared:

- forward outputs, elementwise at the per-dtype tolerance of `kprof.kernels._common.TOLERANCE`
  (|a - b| <= atol + rtol * |b|): the same contract every kernel is tested to against its
  reference;
- gradients of the floating inputs that require grad and of the unit's parameters, by relative
  norm error ||a - b|| / ||b|| <= rtol of the same table. Not elementwise because a parameter
  gradient is a sum over all B*T rows and the two sides sum in different orders: where the sum
  cancels to near zero an elementwise bound fails on a correct kernel, while a wrong kernel shows
  a relative error of order 1 (the fault-injection test sees > 0.1).

The tolerance dtype is the lowest precision the unit computes in: the lowest of its floating
inputs, its parameters and the active autocast dtype (a bf16 autocast region is judged as bf16
even when weights are fp32).

Gradients are taken with `torch.autograd.grad`, so nothing accumulates into `.grad`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from kprof.kernels._common import TOLERANCE, Tol

# Precision order: larger = less precise (used to pick the tolerance dtype).
_COARSENESS = {torch.float64: 0, torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}


@dataclass
class Check:
    what: str  # "output 0", "grad input 0", "grad weight"
    metric: str  # "elementwise" | "rel-norm"
    error: float  # worst |a-b| - (atol + rtol|b|) excess ratio (elementwise) or ||a-b||/||b||
    limit: float
    ok: bool

    def __str__(self) -> str:
        return f"{self.what}: {self.metric} error {self.error:.3g} (limit {self.limit:.3g})"


@dataclass
class Verification:
    ok: bool
    dtype: torch.dtype
    checks: list[Check] = field(default_factory=list)
    error: str | None = None  # the patched path raised

    @property
    def worst(self) -> Check | None:
        bad = [c for c in self.checks if not c.ok]
        pool = bad or self.checks
        return max(pool, key=lambda c: c.error / c.limit if c.limit else c.error) if pool else None

    def summary(self) -> str:
        if self.error:
            return f"patched code raised: {self.error}"
        w = self.worst
        verdict = "ok" if self.ok else "FAILED"
        return f"{verdict} ({str(self.dtype).replace('torch.', '')} tolerance; worst {w})" if w else verdict


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def tolerance_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    dts = {t.dtype for t in tensors if _floating(t)}
    for dev in {t.device.type for t in tensors if isinstance(t, torch.Tensor)}:
        if torch.is_autocast_enabled(dev):
            dts.add(torch.get_autocast_dtype(dev))
    dts = [d for d in dts if d in _COARSENESS] or [torch.float32]
    return max(dts, key=_COARSENESS.__getitem__)


def _tol(dtype: torch.dtype) -> Tol:
    return TOLERANCE.get(dtype, TOLERANCE[torch.float32])


def _elementwise(a: torch.Tensor, b: torch.Tensor, tol: Tol) -> float:
    """Largest |a-b| / (atol + rtol|b|): <= 1 passes."""
    a, b = a.detach().double(), b.detach().double()
    bound = tol.atol + tol.rtol * b.abs()
    nan_mismatch = (a.isnan() != b.isnan()).any()
    if nan_mismatch:
        return float("inf")
    diff = (a - b).abs().nan_to_num(0.0)
    return float((diff / bound).max()) if diff.numel() else 0.0


def _rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if (fa != fb).any():
        return float("inf")
    num = (a - b)[fa].norm()
    den = b[fb].norm()
    if den == 0:
        return float(num)  # both should be zero; any difference counts at absolute scale
    return float(num / den)


def _clone_args(args, kwargs):
    """Detached copies; floating tensors that required grad get requires_grad (their grads are
    compared)."""
    leaves: list[torch.Tensor] = []

    def copy(t):
        if not isinstance(t, torch.Tensor):
            return t
        c = t.detach().clone()
        if t.requires_grad and t.is_floating_point():
            c.requires_grad_(True)
            leaves.append(c)
        return c

    return pytree.tree_map(copy, (args, kwargs)), leaves


def _outputs(out: Any, select: Callable[[Any], Any] | None) -> list[torch.Tensor]:
    if select is not None:
        out = select(out)
    if hasattr(out, "to_tuple"):  # transformers ModelOutput
        out = out.to_tuple()
    return [t for t in pytree.tree_leaves(out) if _floating(t)]


def _run(fn, args, kwargs, params, select, seed: int, cotangents=None):
    (a, kw), leaves = _clone_args(args, kwargs)
    devices = sorted({t.device.index or 0 for t in leaves + list(params) if t.is_cuda})
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        torch.manual_seed(seed)
        outs = _outputs(fn(*a, **kw), select)
    diff = [o for o in outs if o.requires_grad]
    wrt = leaves + list(params)
    grads: list[torch.Tensor | None] = []
    if diff and wrt:
        if cotangents is None:
            g = torch.Generator(device="cpu").manual_seed(seed + 1)
            cotangents = [torch.randn(o.shape, generator=g).to(o.device, o.dtype) for o in diff]
        grads = list(torch.autograd.grad(diff, wrt, cotangents, allow_unused=True))
    return [o.detach() for o in outs], grads, cotangents, leaves


def verify_call(
    original: Callable,
    patched: Callable,
    args: tuple,
    kwargs: dict,
    params: Sequence[torch.nn.Parameter] = (),
    *,
    select: Callable[[Any], Any] | None = None,
    param_names: Sequence[str] | None = None,
    seed: int = 1234,
) -> Verification:
    """Run `original` and `patched` on copies of (args, kwargs) and compare (see module doc)."""
    params = [p for p in params if p.requires_grad]
    ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    dtype = tolerance_dtype(ins + params)
    tol = _tol(dtype)
    ref_out, ref_grads, cot, leaves = _run(original, args, kwargs, params, select, seed)
    try:
        out, grads, _, _ = _run(patched, args, kwargs, params, select, seed, cotangents=cot)
    except Exception as e:  # a kernel that rejects the real input is a failed patch, reported  # noqa: BLE001
        return Verification(False, dtype, error=f"{type(e).__name__}: {e}")
    checks: list[Check] = []
    if len(out) != len(ref_out):
        return Verification(False, dtype, error=f"patched returned {len(out)} floating outputs, original {len(ref_out)}")
    for i, (a, b) in enumerate(zip(out, ref_out)):
        if a.shape != b.shape:
            checks.append(Check(f"output {i} shape {tuple(a.shape)} vs {tuple(b.shape)}", "shape", float("inf"), 1.0, False))
            continue
        e = _elementwise(a, b, tol)
        checks.append(Check(f"output {i}", "elementwise", e, 1.0, e <= 1.0))
    names = [f"grad input {i}" for i in range(len(leaves))] + [
        f"grad {n}" for n in (param_names or [f"param {j}" for j in range(len(params))])
    ]
    for name, a, b in zip(names, grads, ref_grads):
        if a is None and b is None:
            continue
        if a is None or b is None:
            checks.append(Check(f"{name} (missing on one side)", "rel-norm", float("inf"), tol.rtol, False))
            continue
        e = _rel_norm(a, b)
        checks.append(Check(name, "rel-norm", e, tol.rtol, e <= tol.rtol))
    return Verification(all(c.ok for c in checks), dtype, checks)
