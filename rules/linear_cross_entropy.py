"""An lm head whose logits reach a cross-entropy -> fused linear + cross-entropy.

Eager materialises the (B*T, V) logits (bf16, then an fp32 copy for the loss), their log-softmax
and their gradient: at B*T = 8192, V = 128256 that is 2.1 GB of bf16 logits plus 4.2 GB fp32 per
copy, the largest activation of a Llama-3 step. The fused kernel streams the vocabulary in chunks,
computing loss and the hidden/weight gradients without ever holding full logits.

Structure, not names: the head is an `nn.Linear` H -> V of the model for which the model has an
`nn.Embedding` of V rows of width H (the token embedding; tied or not). Wherever the loss is
computed (in the model's forward, in a `loss_function` it calls, or in the training loop through
`nn.CrossEntropyLoss` / `F.cross_entropy`), the call sites stay as they are: the patched head
returns `LazyLogits`, a tensor that holds (hidden, W, b) and stands for F.linear(hidden, W, b):

- `view`/`reshape`/`flatten` of the leading dims, slicing them (`logits[..., :-1, :]`, the
  shift), `.contiguous()`, `.float()` / `.to(dtype)` stay lazy (applied to `hidden`);
- `F.cross_entropy(lazy (N, V), target (N,), ignore_index=, reduction=, label_smoothing=)` runs
  the fused kernel (no class weights: those decline to the eager path);
- anything else (printing, argmax, a softcap `tanh`, returning it to code that reads it)
  materialises the logits exactly as the head would have, so the result is unchanged.

Verification: the head's first call compares its (materialised) output with the original's; the
first cross-entropy on lazy logits, wherever it is called, checks the fused loss and its gradients
against the eager loss on the same values (the rule of kprof/patching/verify.py: error against an
fp64 truth at most twice eager's plus one rounding); if that fails, every later call takes the
eager path and `state["failed"]` says why. The head Linear's forward is the patched object (the
model's own forward stays free for the traced rules).
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from kprof.rules.engine import ProfilePattern, Rule, kernel_fn

KERNEL = "fused_linear_cross_entropy:linear_cross_entropy"
IGNORE = -100  # HF's and F.cross_entropy's default ignore_index


def find_head(model: nn.Module) -> str | None:
    """Path of the Linear H -> V for which the model embeds V tokens of width H: one whose weight
    is an embedding's (tied) first, else one applied once (not inside a ModuleList of repeated
    blocks, where an MLP projection can have V outputs by coincidence); largest V wins."""
    embs = [e for e in model.modules() if isinstance(e, nn.Embedding)]
    vocab = {(e.num_embeddings, e.embedding_dim) for e in embs}
    tied = {id(e.weight) for e in embs}
    repeated = set()
    for path, m in model.named_modules():
        if isinstance(m, nn.ModuleList):
            repeated |= {id(c) for c in m.modules()}
    best = None
    for path, m in model.named_modules():
        if not isinstance(m, nn.Linear) or "forward" in m.__dict__ or (m.out_features, m.in_features) not in vocab:
            continue
        rank = (id(m.weight) in tied, id(m) not in repeated, m.out_features)
        if rank[0] or rank[1]:
            if best is None or rank > best[0]:
                best = (rank, path)
    return best[1] if best else None


def find(model: nn.Module) -> list[tuple[str, nn.Module, str, dict]]:
    """The head, patched where it is: the forward of the head Linear itself, so the model's own
    forward (and any traced rewrite of it) stays free."""
    head = find_head(model)
    if head is None:
        return []
    return [(head, model.get_submodule(head), "forward",
             {"state": {"checked": False, "failed": "", "fused_calls": 0}})]


def replace(head: nn.Module, p: dict) -> dict:
    state = p["state"]

    def forward(x: torch.Tensor) -> torch.Tensor:
        dtype = _autocast_dtype(x) or torch.promote_types(x.dtype, head.weight.dtype)
        return LazyLogits(x, head.weight, head.bias, dtype, state)

    return {"": forward}


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


_META = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_floating_point,
         torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
         torch.Tensor.ndim.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.layout.__get__,
         torch.Tensor.__len__, torch.Tensor.ndimension, torch.Tensor.nelement, torch.Tensor.get_device}


class LazyLogits(torch.Tensor):
    """F.linear(hidden, weight, bias) in `dtype`, not computed until something needs its values."""

    @staticmethod
    def __new__(cls, hidden, weight, bias, dtype, state):
        shape = (*hidden.shape[:-1], weight.shape[0])
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=hidden.device)
        t.hidden, t.weight, t.bias, t.state = hidden, weight, bias, state
        return t

    def __init__(self, *args, **kwargs):
        pass

    def materialise(self) -> torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            y = F.linear(self.hidden, self.weight, self.bias)
            return y if y.dtype == self.dtype else y.to(self.dtype)

    def _like(self, hidden, dtype=None):
        return LazyLogits(hidden, self.weight, self.bias, dtype or self.dtype, self.state)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Below autograd nothing can be materialised with a gradient: every entry is caught in
        # __torch_function__ first, so reaching here is a path it does not know.
        raise TypeError(f"LazyLogits reached the dispatcher through {func}; call .materialise() first")

    def __repr__(self):
        return f"LazyLogits(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    # Dynamo must not trace this: it re-enters __torch_function__ from its own frame hooks and
    # recursed without end on a patched HF Llama under torch.compile. Disabled, the lazy head
    # runs eagerly between compiled graphs.
    @torch.compiler.disable
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _META:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.requires_grad.__get__:
            s = args[0]
            return s.hidden.requires_grad or s.weight.requires_grad
        if args and isinstance(args[0], LazyLogits):
            r = _lazy(func, args[0], args[1:], kwargs)
            if r is not NotImplemented:
                return r
        args, kwargs = pytree.tree_map(lambda a: a.materialise() if isinstance(a, LazyLogits) else a, (args, kwargs))
        return func(*args, **kwargs)


def materialise(out):
    """`out` with every LazyLogits computed (for verification and for code that needs values)."""
    if hasattr(out, "to_tuple"):  # transformers ModelOutput
        out = out.to_tuple()
    return pytree.tree_map(lambda a: a.materialise() if isinstance(a, LazyLogits) else a, out)


def _shape_arg(rest):
    return tuple(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) else tuple(rest)


def _lazy(func, s: LazyLogits, rest, kwargs):
    V, nd = s.shape[-1], s.dim()
    name = getattr(func, "__name__", "")
    if func in (torch.Tensor.view, torch.Tensor.reshape, torch.reshape) and not kwargs:
        shape = _shape_arg(rest)
        if not shape or not all(isinstance(d, int) for d in shape):
            return NotImplemented
        last = shape[-1]
        if last == -1:
            rest_n = math.prod(d for d in shape[:-1] if d != -1)
            if -1 in shape[:-1] or not rest_n or s.numel() // rest_n != V:
                return NotImplemented
        elif last != V:
            return NotImplemented
        return s._like(s.hidden.reshape(*shape[:-1], s.hidden.shape[-1]))
    if func in (torch.Tensor.flatten, torch.flatten):
        start = rest[0] if rest else kwargs.get("start_dim", 0)
        end = rest[1] if len(rest) > 1 else kwargs.get("end_dim", -1)
        if end % nd == nd - 1 or start % nd > end % nd:
            return NotImplemented
        return s._like(s.hidden.flatten(start % nd, end % nd))
    if func is torch.Tensor.__getitem__:
        idx = rest[0] if isinstance(rest[0], tuple) else (rest[0],)
        if any(i is None for i in idx) or sum(i is Ellipsis for i in idx) > 1:
            return NotImplemented
        if Ellipsis in idx:
            if idx[-1] != slice(None):
                return NotImplemented
        elif len(idx) >= nd and idx[nd - 1] != slice(None):
            return NotImplemented
        if any(isinstance(i, int) for i in idx[: nd - 1]) and Ellipsis in idx:
            return NotImplemented
        return s._like(s.hidden[idx])
    if func is torch.Tensor.contiguous:
        return s
    if func is torch.Tensor.float:
        return s._like(s.hidden, torch.float32)
    if func in (torch.Tensor.to, torch.Tensor.type_as):
        target = rest[0] if rest else kwargs.get("dtype", kwargs.get("other"))
        if isinstance(target, torch.Tensor):
            target = target.dtype if target.device == s.device else None
        if isinstance(target, torch.device) or isinstance(target, str):
            return s if torch.device(target) == s.device else NotImplemented
        if isinstance(target, torch.dtype) and len(rest) <= 1 and set(kwargs) <= {"dtype"}:
            return s._like(s.hidden, target)
        return NotImplemented
    if func is F.cross_entropy or name == "cross_entropy":
        return _cross_entropy(s, rest, kwargs)
    return NotImplemented


def _cross_entropy(s: LazyLogits, rest, kwargs):
    names = ("target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
    a = dict(zip(names, rest))
    a.update(kwargs)
    target = a.get("target")
    if (s.dim() != 2 or not isinstance(target, torch.Tensor) or target.dim() != 1 or a.get("weight") is not None
            or a.get("size_average") is not None or a.get("reduce") is not None or s.state["failed"]):
        return NotImplemented  # class weights, legacy flags, (N, V, d) inputs: the eager path
    reduction = a.get("reduction", "mean")
    ignore, smoothing = int(a.get("ignore_index", IGNORE)), float(a.get("label_smoothing", 0.0))
    if not s.state["checked"]:
        s.state["checked"] = True
        why = _self_check(s, target, ignore, reduction, smoothing)
        if why:
            s.state["failed"] = why
            warnings.warn(f"kprof linear_cross_entropy: fused loss failed its first-call check ({why}); "
                          "the eager loss is used", stacklevel=3)
            return NotImplemented
    s.state["fused_calls"] += 1
    return _fused(s.hidden, s.weight, s.bias, target, ignore, reduction, smoothing, s.dtype)


def _fused(hidden, weight, bias, target, ignore, reduction, smoothing, out_dtype):
    ac = _autocast_dtype(hidden)
    dt = ac or hidden.dtype
    # The caller gets the dtype the replaced code returned: cross-entropy on logits of `out_dtype`
    # (fp32 where Hugging Face upcasts them), and fp32 under autocast, which runs cross-entropy in
    # fp32. The kernel sums in fp32 and rounds once, to that dtype: never via the input dtype.
    want = torch.float32 if ac is not None else out_dtype
    with (torch.autocast(hidden.device.type, enabled=False) if ac else contextlib.nullcontext()):
        loss = kernel_fn(KERNEL)(hidden.to(dt), weight.to(dt), target, None if bias is None else bias.to(dt),
                                 ignore_index=ignore, reduction=reduction, label_smoothing=smoothing,
                                 loss_dtype=want)
    return loss if loss.dtype == want else loss.to(want)


def _eager(hidden, weight, bias, target, ignore, reduction, smoothing, dtype):
    y = F.linear(hidden, weight, bias).to(dtype)
    return F.cross_entropy(y, target, ignore_index=ignore, reduction=reduction, label_smoothing=smoothing)


def _self_check(s: LazyLogits, target, ignore, reduction, smoothing) -> str:
    """'' if the fused loss and its gradients are within verify.py's bound of eager's."""
    from kprof.kernels.common import TOLERANCE

    def run(fn, upcast):
        leaves = [t.detach().double() if upcast else t.detach() for t in (s.hidden, s.weight)]
        b = None if s.bias is None else (s.bias.detach().double() if upcast else s.bias.detach())
        leaves = [t.requires_grad_() for t in leaves]
        with torch.enable_grad():
            dt = torch.float64 if upcast else s.dtype
            loss = fn(*leaves, b, target, ignore, reduction, smoothing, dt)
            g = torch.autograd.grad(loss.sum(), leaves)
        return [loss.detach(), *g]

    truth = run(_eager, True)
    eager = run(_eager, False)
    fused = run(_fused, False)
    # one rounding of the loss in the dtype the kernel computes in (autocast's, else hidden's)
    unit = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}.get(_autocast_dtype(s.hidden) or s.hidden.dtype, 0.0)
    floor = max(unit, TOLERANCE[torch.float32].rtol)
    for what, t, e, f in zip(("loss", "d hidden", "d weight"), truth, eager, fused):
        den = t.norm().item() or 1.0
        err_e = (e.double() - t).norm().item() / den
        err_f = (f.double() - t).norm().item() / den
        if not err_f <= 2 * err_e + floor:
            return f"{what}: error {err_f:.2e} against an fp64 truth, eager's {err_e:.2e}"
    return ""


def problem(ops) -> dict | None:
    from kprof.rules.problems import to_dtype

    mm = ops[(ops["phase"] == "fwd") & ops["op"].str.contains(r"::(?:mm|addmm|matmul|linear)$", regex=True)]
    best = None
    for shapes, dtypes in zip(mm["input_shapes"], mm["input_dtypes"]):
        s = [tuple(x) for x in shapes if x is not None and len(x)]
        if len(s) >= 2 and len(s[1]) == 2:
            rows = 1
            for d in s[0][:-1]:
                rows *= d
            vocab = max(s[1])
            if best is None or vocab > best["vocab"]:
                best = {"n_rows": rows, "hidden": s[0][-1], "vocab": vocab, "dtype": to_dtype(dtypes[0])}
    return best


RULE = Rule(
    id="linear_cross_entropy",
    title="lm head + cross-entropy -> fused linear cross-entropy (no logits in memory)",
    kernels=(KERNEL,),
    match=None,
    replace=replace,
    find=find,
    profile=ProfilePattern(own_any=("log_softmax", "nll_loss", "cross_entropy_loss", "nll_loss_nd"), root_only=True,
                           evidence=("own:log_softmax", "own:nll_loss", "own:nll_loss_forward", "own:to",
                                     "own:_to_copy", "own:copy_", "own:log_softmax_backward_data",
                                     "own:nll_loss_backward", "childmod:mm", "childmod:linear")),
    problem=problem,
    outputs=materialise,
    tensor_core=True,
    change="kprof linear_cross_entropy kernel (vocab-chunked; logits never materialised)",
)
