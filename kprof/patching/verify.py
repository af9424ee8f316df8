"""First-call verification: a patched unit against its original, on the real input.

At the first call of a patched module (or function), both versions run forward and backward on
detached copies of the real arguments, with the same RNG state (dropout masks match) and the same
random output cotangents. How the results are judged depends on the precision the unit computes
in (the lowest of its floating inputs, its parameters and the active autocast dtype; a bf16
autocast region is judged as bf16 even when weights are fp32):

bf16 / fp16 units: against an fp32 truth. Comparing two half-precision computations with each
other under a fixed tolerance gives false failures: Hugging Face's eager code rounds to bf16 after
every op while a kprof kernel computes in fp32 and rounds once, so the two differ by a few bf16
ulps per op, and a weight gradient (a sum over all B*T rows that nearly cancels at random init)
amplifies that difference. Measured on the H200 (2026-11-29), Llama 1B at B*T = 8192: gate_proj
weight grads 0.088 apart by relative norm, against a bf16 table rtol of 0.016, on a kernel that
passes its own fp64-reference tests. So, as flash-attention's tests do (tests/test_flash_attn.py:
"FlashAttention's numerical error is at most twice the numerical error of a Pytorch
implementation"), the ORIGINAL code also runs on an fp32 copy of the inputs, parameters and
floating buffers (autocast off), and for every output and gradient

    err(kprof)  = ||kprof - truth|| / ||truth||      (relative norm, in fp64)
    err(eager)  = ||eager - truth|| / ||truth||
    ok  iff  err(kprof) <= K * err(eager) + floor

K = 2 (flash-attention's factor): a correct kernel that rounds once is usually *more* accurate
than eager (err ratio < 1), and 2 leaves room for a kernel that reorders a reduction differently
without letting through a real bug, whose error against the truth is of order 1 (the
fault-injection tests see > 0.1 where eager's is ~1e-3). floor = max(u, fp32 table rtol): u is the
unit roundoff of the coarser dtype of the two compared tensors (bf16 2^-8, fp16 2^-11): one
correct rounding moves every element by at most u|x|, so by at most u in relative norm. It admits
a kernel whose only error is rounding its fp32 result once where eager happens to be almost exact
(a mean loss kept in fp32 by eager but returned in bf16; tiny Llama: eager 2e-5, kprof 3.1e-3).
For fp32 tensors u = 6e-8 is too tight: an fp32 gradient summed over many rows in another order
(GPT example on the H200, 2026-11-29: LayerNorm's fp32 bias grad under autocast, 4096 rows,
kprof 2.7e-7 against eager's exact 0) is bounded by ~sqrt(K) u, not u, so the floor is at least
the fp32 rtol of the kernel tests' table (2e-5). A real bug is of order 1 (> 0.1).
It plays the role of flash-attention's `(ref + 0.3 - 0.3 - ref)` term, as a bound instead of a
sample (a sampled rounding error can be ~0 for a scalar that happens to be representable).

The truth is skipped, and the tolerance-table check below used instead, where it can't be had:
the fp32 run raises or runs out of memory, or eager's own error against it exceeds
`TRUTH_SANE` (then the fp32 run did not compute the same thing, e.g. a dtype-dependent dropout
mask, and is no truth). The reason is recorded in `Verification.note`.

fp32 / fp64 units (and the fallback): the two sides against each other with the per-dtype
tolerance of `kprof.kernels.common.TOLERANCE`: forward outputs elementwise
(|a - b| <= atol + rtol * |b|, the contract every kernel is tested to against its reference);
gradients of the floating inputs that require grad and of the unit's parameters by relative norm
error <= rtol (not elementwise: a parameter gradient is a sum over all rows and the two sides sum
in different orders; where the sum cancels to near zero an elementwise bound fails on a correct
kernel). In fp32 both sides are within ~1e-6 of each other, far inside the table.

Gradients are taken with `torch.autograd.grad`, so nothing accumulates into `.grad`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree

from kprof.kernels.common import TOLERANCE, Tol, rel_norm

# Precision order: larger = less precise (used to pick the tolerance dtype).
COARSENESS = {torch.float64: 0, torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_HALF = (torch.float16, torch.bfloat16)

K = 2.0  # err(kprof) may be at most K x err(eager), both against the fp32 truth (flash-attention's 2)
# Eager's own relative error against its fp32 run above which that run is not a truth (a bf16
# computation is within a few 1e-3 of its fp32 version, at most ~1e-1 for a cancelling weight
# gradient: 0.088 measured between two bf16 versions at B*T = 8192); 0.5 means "a different
# computation", e.g. other dropout masks.
TRUTH_SANE = 0.5


@dataclass
class Check:
    what: str  # "output 0", "grad input 0", "grad weight"
    metric: str  # "elementwise" | "rel-norm" | "vs-fp32" | "shape" | "exact" (a rule's own check)
    error: float  # elementwise: worst |a-b| / (atol + rtol|b|); rel-norm: ||a-b||/||b||; vs-fp32: err(kprof)
    limit: float
    ok: bool
    baseline: float | None = None  # vs-fp32: err(eager), the same original code in the unit's dtype

    def __str__(self) -> str:
        if self.metric == "vs-fp32":
            return (f"{self.what}: kprof {self.error:.2g} vs eager {self.baseline:.2g} from fp32 "
                    f"(limit {self.limit:.2g})")
        if self.metric == "exact":  # a rule's own yes/no check (Rule.check): `what` says the result
            return self.what
        return f"{self.what}: {self.metric} error {self.error:.3g} (limit {self.limit:.3g})"


@dataclass
class Verification:
    ok: bool
    dtype: torch.dtype
    checks: list[Check] = field(default_factory=list)
    error: str | None = None  # the patched path raised
    method: str = "table"  # "fp32 truth" | "table"
    note: str = ""  # why the fp32 truth was not used, where it was wanted

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
        how = ("vs fp32 truth" if self.method == "fp32 truth"
               else f"{str(self.dtype).replace('torch.', '')} tolerance")
        note = f"; {self.note}" if self.note else ""
        return f"{verdict} ({how}; worst {w}{note})" if w else verdict


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def tolerance_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    dts = {t.dtype for t in tensors if _floating(t)}
    for dev in {t.device.type for t in tensors if isinstance(t, torch.Tensor)}:
        if torch.is_autocast_enabled(dev):
            dts.add(torch.get_autocast_dtype(dev))
    dts = [d for d in dts if d in COARSENESS] or [torch.float32]
    return max(dts, key=COARSENESS.__getitem__)


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


def _clone_args(args, kwargs, upcast: bool = False):
    """Detached copies (half-precision floats upcast to fp32 with `upcast`); floating tensors that
    required grad get requires_grad (their grads are compared)."""
    leaves: list[torch.Tensor] = []

    def copy(t):
        if not isinstance(t, torch.Tensor):
            return _private(t)
        c = t.detach().clone()
        if upcast and c.dtype in _HALF:
            c = c.float()
        if t.requires_grad and t.is_floating_point():
            c.requires_grad_(True)
            leaves.append(c)
        return c

    return pytree.tree_map(copy, (args, kwargs)), leaves


_PLAIN = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, type(None))


def _private(obj: Any) -> Any:
    """A copy of an object argument for one run (a KV cache the unit appends to), its tensors
    shared: otherwise the two runs and the real call would all write the caller's object, and
    the second run would read the first's entries (and their freed graph). Objects that can't
    be copied are shared, as before."""
    import copy

    if isinstance(obj, _PLAIN) or isinstance(obj, (type, torch.nn.Module)) or callable(obj):
        return obj
    memo: dict = {}
    todo, seen = [obj], 0
    while todo and seen < 4096:  # the tensors it reaches map to themselves: only containers copy
        x = todo.pop()
        seen += 1
        if isinstance(x, (torch.Tensor, torch.nn.Module)):  # a module it refers to is not copied
            memo[id(x)] = x
        elif isinstance(x, (list, tuple)):
            todo += list(x)
        elif isinstance(x, dict):
            todo += list(x.values())
        elif hasattr(x, "__dict__") and not isinstance(x, type):
            todo += list(vars(x).values())
    try:
        return copy.deepcopy(obj, memo)
    except Exception:  # an uncopyable object (a lock, a handle): shared  # noqa: BLE001
        return obj


def _outputs(out: Any, select: Callable[[Any], Any] | None) -> list[torch.Tensor]:
    if select is not None:
        out = select(out)
    if hasattr(out, "to_tuple"):  # transformers ModelOutput
        out = out.to_tuple()
    return [t for t in pytree.tree_leaves(out) if _floating(t)]


def _keep(t):
    return t


def _run(fn, args, kwargs, params, select, seed: int, cotangents=None, upcast: bool = False):
    (a, kw), leaves = _clone_args(args, kwargs, upcast)
    devices = sorted({t.device.index or 0 for t in leaves + list(params) if t.is_cuda})
    # Identity saved-tensor hooks: when this call sits inside a checkpointed block (the
    # activation_checkpointing patch on an outer module), that checkpoint's hooks would capture
    # this graph's saved tensors, and the grad below would recompute the block from inside its
    # own forward. The innermost hooks win, so this graph saves its tensors as usual.
    with torch.random.fork_rng(devices=devices), torch.enable_grad(), \
            torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
        torch.manual_seed(seed)
        outs = _outputs(fn(*a, **kw), select)
    diff = [o for o in outs if o.requires_grad]
    wrt = leaves + list(params)
    grads: list[torch.Tensor | None] = []
    if diff and wrt:
        if cotangents is None:
            g = torch.Generator(device="cpu").manual_seed(seed + 1)
            cotangents = [torch.randn(o.shape, generator=g).to(o.device, o.dtype) for o in diff]
        elif len(cotangents) == len(diff):  # the truth run: the same values, in its outputs' dtype
            cotangents = [c.to(o.dtype) for c, o in zip(cotangents, diff)]
        grads = list(torch.autograd.grad(diff, wrt, cotangents, allow_unused=True))
    return [o.detach() for o in outs], grads, cotangents, leaves


@contextlib.contextmanager
def _upcast_in_place(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Half-precision parameters and buffers swapped to fp32 copies (`.data`, so Parameter
    identity, autograd leaves and tied weights are kept), restored on exit whatever happens."""
    saved = []
    seen: set[int] = set()
    try:
        for t in tensors:
            if id(t) in seen or not _floating(t) or t.dtype not in _HALF:
                continue
            seen.add(id(t))
            saved.append((t, t.data))
            t.data = t.data.float()
        yield
    finally:
        for t, d in reversed(saved):
            t.data = d


@contextlib.contextmanager
def _no_autocast(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    with contextlib.ExitStack() as st:
        for dev in {t.device.type for t in tensors if isinstance(t, torch.Tensor)}:
            if torch.is_autocast_enabled(dev):
                st.enter_context(torch.autocast(dev, enabled=False))
        yield


def _floor(*dtypes: torch.dtype) -> float:
    """max(u of the coarsest of `dtypes`, the fp32 table rtol): one correct rounding, or an fp32
    accumulation in another order (module docstring)."""
    dt = max((d for d in dtypes if d in COARSENESS), key=COARSENESS.__getitem__, default=torch.float32)
    return max(torch.finfo(dt).eps / 2, TOLERANCE[torch.float32].rtol)


def _truth_checks(names, out, ref_out, tru_out, grads, ref_grads, tru_grads) -> list[Check] | str:
    """vs-fp32 checks, or a string saying why the truth is unusable."""
    checks = []
    pairs = [(f"output {i}", a, b, t) for i, (a, b, t) in enumerate(zip(out, ref_out, tru_out))]
    pairs += [(n, a, b, t) for n, a, b, t in zip(names, grads, ref_grads, tru_grads)]
    for name, a, b, t in pairs:
        if a is None and b is None:
            continue
        if a is None or b is None:
            checks.append(Check(f"{name} (missing on one side)", "vs-fp32", float("inf"), 0.0, False, 0.0))
            continue
        if t is None or t.shape != b.shape:
            return f"fp32 run gave no comparable {name}"
        if a.shape != b.shape:
            checks.append(Check(f"{name} shape {tuple(a.shape)} vs {tuple(b.shape)}", "shape", float("inf"), 1.0, False))
            continue
        e_eager = rel_norm(b, t)
        if not e_eager <= TRUTH_SANE:  # also NaN/inf
            return f"eager's {name} is {e_eager:.2g} from its fp32 run (not the same computation)"
        e = rel_norm(a, t)
        limit = K * e_eager + _floor(a.dtype, b.dtype)
        checks.append(Check(name, "vs-fp32", e, limit, e <= limit, e_eager))
    return checks


def _table_checks(names, out, ref_out, grads, ref_grads, tol: Tol) -> list[Check]:
    checks: list[Check] = []
    for i, (a, b) in enumerate(zip(out, ref_out)):
        if a.shape != b.shape:
            checks.append(Check(f"output {i} shape {tuple(a.shape)} vs {tuple(b.shape)}", "shape", float("inf"), 1.0, False))
            continue
        e = _elementwise(a, b, tol)
        checks.append(Check(f"output {i}", "elementwise", e, 1.0, e <= 1.0))
    for name, a, b in zip(names, grads, ref_grads):
        if a is None and b is None:
            continue
        if a is None or b is None:
            checks.append(Check(f"{name} (missing on one side)", "rel-norm", float("inf"), tol.rtol, False))
            continue
        e = rel_norm(a, b)
        checks.append(Check(name, "rel-norm", e, tol.rtol, e <= tol.rtol))
    return checks


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
    state: Sequence[torch.Tensor] = (),
) -> Verification:
    """Run `original` and `patched` on copies of (args, kwargs) and compare (see module doc).

    `params`: the trainable parameters whose grads are compared. `state`: every tensor the
    original code reads besides its arguments (all parameters and floating buffers of the unit);
    with `params`, these are upcast in place for the fp32 truth run of a half-precision unit."""
    params = list(params)
    names_all = list(param_names or [f"param {j}" for j in range(len(params))])
    keep = [i for i, p in enumerate(params) if p.requires_grad]
    pnames = [names_all[i] for i in keep] if len(names_all) == len(params) else names_all
    params = [params[i] for i in keep]
    ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    dtype = tolerance_dtype(ins + params + [t for t in state if _floating(t)])
    ref_out, ref_grads, cot, leaves = _run(original, args, kwargs, params, select, seed)
    try:
        out, grads, _, _ = _run(patched, args, kwargs, params, select, seed, cotangents=cot)
    except Exception as e:  # a kernel that rejects the real input is a failed patch, reported  # noqa: BLE001
        return Verification(False, dtype, error=f"{type(e).__name__}: {e}")
    if len(out) != len(ref_out):
        return Verification(False, dtype, error=f"patched returned {len(out)} floating outputs, original {len(ref_out)}")
    names = [f"grad input {i}" for i in range(len(leaves))] + [f"grad {n}" for n in pnames]

    note = ""
    if dtype in _HALF:
        try:
            with _upcast_in_place(list(params) + list(state)), _no_autocast(ins + params):
                tru_out, tru_grads, _, _ = _run(original, args, kwargs, params, select, seed, cotangents=cot,
                                                upcast=True)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            note = "fp32 truth did not fit in memory"
        except Exception as e:  # the original code refused fp32: judge against the table  # noqa: BLE001
            note = f"fp32 run of the original raised {type(e).__name__}"
        else:
            checks = (_truth_checks(names, out, ref_out, tru_out, grads, ref_grads, tru_grads)
                      if len(tru_out) == len(ref_out) else "fp32 run returned a different number of outputs")
            del tru_out, tru_grads
            if isinstance(checks, list):
                return Verification(all(c.ok for c in checks), dtype, checks, method="fp32 truth")
            note = f"no fp32 truth: {checks}"
    checks = _table_checks(names, out, ref_out, grads, ref_grads, _tol(dtype))
    return Verification(all(c.ok for c in checks), dtype, checks, method="table", note=note)
