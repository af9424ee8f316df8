"""FLOPs and minimal bytes of every op in the op table, from the shapes the profiler recorded.

Conventions (what the numbers mean):
- FLOPs: a multiply-add is 2 FLOPs (matmul M x K @ K x N = 2*M*N*K, torch.utils.flop_counter's
  convention, whose registered formulas are reused for matmuls, convolutions and attention).
  Elementwise ops count the arithmetic of their formula in the PyTorch docs per output element,
  a transcendental (exp, log, erf, tanh, sqrt, ...) counting as one (`ELEMENTWISE_FLOPS`).
- Bytes: the minimum traffic to device memory: each input read once (a broadcast dim, stride 0,
  is read once), each output written once; an in-place op reads and writes `self`. Caches are
  not modelled; the roofline compares the op with the time this minimum would take.
- Causal attention counts only the unmasked query/key pairs (flash kernels skip masked tiles;
  torch's flop counter counts the full square, which would overstate the achieved TFLOP/s ~2x).

An op's cost here is inclusive (its whole call). The op table nests ops (on CPU every op is a
row; on GPU every op that launched work), so `annotate` charges each row only what its child rows
do not: exclusive = max(0, inclusive - sum of children's inclusive). Composite ops (dispatcher key
CompositeImplicitAutograd: aten::linear, aten::matmul, ...) do no work of their own and cost 0;
their children carry it. With this, the FLOPs of a Linear (aten::linear > aten::t, aten::addmm
> aten::copy_) add up to exactly 2*M*N*K.

`cost_known` is False for any op without a formula here; `coverage` in tables.py reports the
share of device time that has one. Such rows get a generic estimate (`estimated bytes`: inputs
read once plus an output the size of the largest input), which tables.py reports separately and
which never counts as costed.
"""

from __future__ import annotations

import ast
import json
import math
import re
from functools import lru_cache
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import pandas as pd
import torch

from kprof.kernels.registry import Cost, TensorMeta
from kprof.kernels.registry import op_cost as kprof_op_cost

# ----------------------------------------------------------------------------------------------
# Arguments as the trace recorded them


class Arg(NamedTuple):
    kind: str  # "tensor" | "list" (TensorList) | "scalar" | "none" | "other"
    shape: tuple  # tensor: its sizes; list: tuple of element shapes
    dtype: Any  # tensor: dtype name; list: tuple of dtype names; else the trace type
    strides: tuple
    value: Any  # parsed Concrete Inputs value (scalars, int lists, bools), None if absent
    name: str = ""  # schema argument name, when the op's schema was found


def _parse_value(s: Any) -> Any:
    if not isinstance(s, str):
        return s
    if s == "":
        return None
    if s in ("True", "False"):
        return s == "True"
    try:
        return int(s)
    except ValueError:
        pass
    try:
        return float(s)
    except ValueError:
        pass
    if s.startswith("["):
        try:
            return ast.literal_eval(s)
        except (ValueError, SyntaxError):
            return s
    return s


_DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


@lru_cache(maxsize=None)
def itemsize(dtype: str) -> int | None:
    d = _DTYPE_NAMES.get(dtype)
    return None if d is None else d.itemsize


def _is_float(dtype: str) -> bool:
    d = _DTYPE_NAMES.get(dtype)
    return d is not None and (d.is_floating_point or d.is_complex)


# c10::ScalarType codes, as the trace records a `dtype` argument (checked in the tests against
# torch 2.13's profiler: x.to(torch.bfloat16) records dtype "15").
SCALAR_TYPES = {
    0: "uint8", 1: "int8", 2: "int16", 3: "int32", 4: "int64", 5: "float16", 6: "float32", 7: "float64",
    8: "complex32", 9: "complex64", 10: "complex128", 11: "bool", 15: "bfloat16", 23: "float8_e5m2",
    24: "float8_e4m3fn", 25: "float8_e5m2fnuz", 26: "float8_e4m3fnuz",
}


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1


def _unique_elems(shape: Sequence[int], strides: Sequence[int]) -> int:
    """Elements a kernel must read: broadcast dims (stride 0) hold one element's worth."""
    if not shape:
        return 1
    if strides and len(strides) == len(shape):
        return math.prod(s for s, st in zip(shape, strides) if st != 0) if all(shape) else 0
    return _numel(shape)


def tbytes(a: Arg) -> float:
    """Unique bytes of a tensor (or each tensor of a TensorList)."""
    if a.kind == "tensor":
        return _unique_elems(a.shape, a.strides) * (itemsize(a.dtype) or 0)
    if a.kind == "list":
        strides = a.strides if a.strides and len(a.strides) == len(a.shape) else [()] * len(a.shape)
        return sum(_unique_elems(s, st) * (itemsize(d) or 0) for s, st, d in zip(a.shape, strides, a.dtype))
    return 0.0


def obytes(shape: Sequence[int], dtype: str) -> float:
    return _numel(shape) * (itemsize(dtype) or 0)


# ----------------------------------------------------------------------------------------------
# Schema lookup: the trace records every argument in schema order, but not the overload.

_TENSOR_T = re.compile(r"^(Optional\[)?Tensor\]?$")


@lru_cache(maxsize=None)
def _schemas(op: str) -> tuple:
    try:
        return tuple(torch._C._jit_get_schemas_for_operator(op))
    except RuntimeError:
        return ()


def _type_score(trace_t: Any, schema_t: str) -> int:
    is_tensor_t = bool(_TENSOR_T.match(schema_t))
    if trace_t == "":
        return 1 if schema_t.startswith("Optional") else 0
    if trace_t == "TensorList":
        return 2 if "List[Tensor]" in schema_t or "List[Optional[Tensor]]" in schema_t else -5
    if trace_t == "ScalarList":
        return 2 if schema_t.startswith(("List", "Optional[List")) and "Tensor" not in schema_t else -5
    if trace_t == "Scalar":
        return 2 if not is_tensor_t and "List" not in schema_t else (1 if schema_t == "Tensor" else -5)
    if isinstance(trace_t, str):  # an element type: a tensor
        return 2 if is_tensor_t else (-1 if "Scalar" in schema_t or "number" in schema_t else -5)
    return 0


@lru_cache(maxsize=65536)
def _match(op: str, types: tuple) -> tuple[str, tuple[str, ...], tuple[bool, ...], bool]:
    """(overload name, argument names, kwarg-only flags, composite) of the best-matching schema,
    or ("?", (), (), False) if the op has no schema of that arity."""
    best, best_score = None, -10**9
    for s in _schemas(op):
        if len(s.arguments) != len(types):
            continue
        score = sum(_type_score(t, str(a.type)) for t, a in zip(types, s.arguments))
        if score > best_score:
            best, best_score = s, score
    if best is None:
        return "?", (), (), False
    full = op + (f".{best.overload_name}" if best.overload_name else "")
    try:
        composite = torch._C._dispatch_has_kernel_for_dispatch_key(full, "CompositeImplicitAutograd")
    except RuntimeError:
        composite = False
    return best.overload_name, tuple(a.name for a in best.arguments), tuple(a.kwarg_only for a in best.arguments), composite


class Call:
    """One op call: its arguments by position and (when the schema is known) by name."""

    def __init__(self, op: str, shapes, dtypes, strides, concrete, types):
        self.op = op
        n = len(types) if types else len(shapes or [])
        shapes = list(shapes or []) + [[]] * (n - len(shapes or []))
        dtypes = list(dtypes or []) + [""] * (n - len(dtypes or []))
        strides = list(strides or []) + [[]] * (n - len(strides or []))
        concrete = list(concrete or []) + [""] * (n - len(concrete or []))
        types = list(types or dtypes)
        self.overload, names, kwonly, self.composite = _match(op, tuple(t if isinstance(t, str) else "TensorList" for t in types))
        names = names or tuple(f"arg{i}" for i in range(n))
        kwonly = kwonly or (False,) * n
        args = []
        for i in range(n):
            t, d = types[i], dtypes[i]
            if t == "TensorList" or isinstance(d, list):
                el = tuple(tuple(s) for s in shapes[i]) if isinstance(shapes[i], list) else ()
                st = tuple(tuple(s) for s in strides[i]) if isinstance(strides[i], list) else ()
                dl = tuple(d) if isinstance(d, list) else ("float32",) * len(el)
                args.append(Arg("list", el, dl, st, None, names[i]))
            elif isinstance(d, str) and itemsize(d) is not None:
                args.append(Arg("tensor", tuple(shapes[i]), d, tuple(strides[i] or ()), _parse_value(concrete[i]), names[i]))
            elif t in ("Scalar", "ScalarList"):
                args.append(Arg("scalar", (), t, (), _parse_value(concrete[i]), names[i]))
            elif t == "":
                args.append(Arg("none", (), "", (), None, names[i]))
            else:
                args.append(Arg("other", (), t, (), _parse_value(concrete[i]), names[i]))
        # out= tensors are outputs, not inputs.
        self.outs = [a for a, k in zip(args, kwonly) if k and a.name.startswith("out") and a.kind == "tensor"]
        self.args = [a for a, k in zip(args, kwonly) if not (k and a.name.startswith("out") and a.kind == "tensor")]
        self.by_name = {a.name: a for a in self.args}

    @property
    def tensors(self) -> list[Arg]:
        return [a for a in self.args if a.kind == "tensor"]

    @property
    def lists(self) -> list[Arg]:
        return [a for a in self.args if a.kind == "list"]

    def get(self, name: str, pos: int | None = None) -> Arg | None:
        if name in self.by_name:
            return self.by_name[name]
        if pos is not None and pos < len(self.args):
            return self.args[pos]
        return None

    def value(self, name: str, pos: int | None = None, default: Any = None) -> Any:
        a = self.get(name, pos)
        return default if a is None or a.value is None else a.value

    def tensor(self, name: str, pos: int | None = None) -> Arg | None:
        a = self.get(name, pos)
        return a if a is not None and a.kind == "tensor" else None


# ----------------------------------------------------------------------------------------------
# Formulas. Each takes a Call and returns Cost, or None if it cannot cost this call.

# Views and metadata: no data moves (view, reshape-as-view, t, transpose, expand, permute, slice,
# select, as_strided, unsqueeze, detach, ...); allocation without initialisation.
ZERO_COST = frozenset("""
view _unsafe_view _reshape_alias reshape view_as t transpose transpose_ permute expand expand_as slice select
narrow as_strided as_strided_ unsqueeze unsqueeze_ squeeze squeeze_ detach detach_ alias lift_fresh unflatten
flatten split split_with_sizes unsafe_split unsafe_split_with_sizes chunk unbind diagonal movedim moveaxis
swapaxes swapdims numpy_T mT mH adjoint resolve_conj resolve_neg _conj conj view_as_real view_as_complex unfold
empty empty_like empty_strided new_empty new_empty_strided resize_ resize_as_ set_ result_type size stride
is_same_size is_nonzero _has_compatible_shallow_copy_type record_stream requires_grad_ retain_grad _version
_nested_tensor_from_mask _indices _values _coalesced_ align_to refine_names rename _reshape_from_tensor
_shape_as_tensor broadcast_tensors _unsafe_index_put_ _propagate_xla_data _assert_async _assert_tensor_metadata
sym_size sym_stride sym_numel sym_storage_offset _functional_assert_async _make_dep_token
to contiguous type_as item _is_any_true _is_all_true
""".split())

# FLOPs per output element, from each op's formula in the PyTorch docs (transcendentals = 1).
ELEMENTWISE_FLOPS: dict[str, int] = {
    # unary
    "neg": 1, "abs": 1, "exp": 1, "exp2": 1, "expm1": 1, "log": 1, "log2": 1, "log10": 1, "log1p": 1,
    "sqrt": 1, "rsqrt": 1, "sin": 1, "cos": 1, "tan": 1, "tanh": 1, "asin": 1, "acos": 1, "atan": 1,
    "sinh": 1, "cosh": 1, "erf": 1, "erfc": 1, "erfinv": 1, "reciprocal": 1, "square": 1, "sign": 1,
    "sgn": 1, "floor": 1, "ceil": 1, "round": 1, "trunc": 1, "frac": 1, "relu": 1, "relu6": 2,
    "sigmoid": 4,  # 1 / (1 + exp(-x)): neg, exp, add, reciprocal
    "silu": 5,  # x * sigmoid(x)
    "gelu": 5,  # 0.5 * x * (1 + erf(x / sqrt(2))): div, erf, add, mul, mul (tanh form: 9, see _gelu)
    "mish": 5, "softplus": 3, "elu": 3, "selu": 4, "celu": 3, "leaky_relu": 2, "hardtanh": 2,
    "hardsigmoid": 3, "hardswish": 4, "logical_not": 1, "bitwise_not": 1, "isnan": 1, "isinf": 1,
    "isfinite": 1, "nan_to_num": 1, "clamp": 2, "clamp_min": 1, "clamp_max": 1, "clip": 2,
    "logit": 3, "digamma": 1, "lgamma": 1, "polygamma": 1, "i0": 1, "sinc": 2, "deg2rad": 1, "rad2deg": 1,
    "positive": 0, "bitwise_left_shift": 1, "bitwise_right_shift": 1, "signbit": 1, "heaviside": 1,
    # binary
    "add": 1, "sub": 1, "rsub": 1, "mul": 1, "div": 1, "true_divide": 1, "floor_divide": 1, "remainder": 1,
    "fmod": 1, "pow": 1, "float_power": 1, "atan2": 1, "maximum": 1, "minimum": 1, "fmax": 1, "fmin": 1,
    "eq": 1, "ne": 1, "lt": 1, "le": 1, "gt": 1, "ge": 1, "logical_and": 1, "logical_or": 1,
    "logical_xor": 1, "bitwise_and": 1, "bitwise_or": 1, "bitwise_xor": 1, "hypot": 3, "xlogy": 2,
    "copysign": 1, "nextafter": 1, "ldexp": 2, "logaddexp": 4, "logaddexp2": 4, "masked_fill": 1,
    # ternary
    "where": 1, "lerp": 3, "addcmul": 3, "addcdiv": 3,
    # elementwise backward formulas (derivatives.yaml)
    "threshold_backward": 1, "sigmoid_backward": 3, "tanh_backward": 3, "hardtanh_backward": 2,
    "leaky_relu_backward": 2, "silu_backward": 9, "gelu_backward": 9, "elu_backward": 3,
    "softplus_backward": 5, "mish_backward": 10, "hardsigmoid_backward": 2, "hardswish_backward": 4,
    "native_dropout_backward": 2, "logit_backward": 3,
}
# Comparisons and predicates return bool whatever their inputs.
_BOOL_OUT = frozenset("eq ne lt le gt ge logical_and logical_or logical_xor logical_not isnan isinf isfinite signbit".split())
# In-place ops that only write self (no read): fills and random initialisation.
WRITE_ONLY = frozenset("fill_ zero_ normal_ uniform_ random_ exponential_ geometric_ cauchy_ log_normal_ bernoulli_".split())
# Matmul-class ops (run on tensor cores when the dtype allows): the roofline uses the tensor-core
# peak of their dtype for them, the CUDA-core fp32 peak for everything else.
TENSOR_CORE_OPS = frozenset("""
mm addmm bmm baddbmm _scaled_mm _int_mm addbmm addmv mv dot vdot addr outer matmul linear
convolution _convolution cudnn_convolution convolution_overrideable _slow_conv2d_forward convolution_backward
cudnn_convolution_transpose _scaled_dot_product_flash_attention _scaled_dot_product_efficient_attention
_scaled_dot_product_cudnn_attention _scaled_dot_product_flash_attention_backward
_scaled_dot_product_efficient_attention_backward _scaled_dot_product_cudnn_attention_backward
_flash_attention_forward _flash_attention_backward _efficient_attention_forward _efficient_attention_backward
_scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_flash_attention_for_cpu_backward
_scaled_dot_product_fused_attention_overrideable _scaled_dot_product_fused_attention_overrideable_backward
_grouped_mm _scaled_grouped_mm _cudnn_attention_forward _cudnn_attention_backward
""".split())


def _broadcast(shapes: list[tuple]) -> tuple | None:
    """NumPy/PyTorch broadcasting of shapes, None if they do not broadcast. (torch.broadcast_shapes
    would do, but its first call imports sympy: 2.5 s.)"""
    nd = max((len(s) for s in shapes), default=0)
    out = [1] * nd
    for s in shapes:
        for i, d in enumerate(s, start=nd - len(s)):
            if d != 1:
                if out[i] not in (1, d):
                    return None
                out[i] = d
    return tuple(out)


def _promote(tensors: list[Arg], scalars: list[Arg]) -> str:
    dims = [t for t in tensors if t.shape] or tensors
    d = _DTYPE_NAMES[dims[0].dtype]
    for t in dims[1:]:
        d = torch.promote_types(d, _DTYPE_NAMES[t.dtype])
    if not (d.is_floating_point or d.is_complex):
        zero_d_float = [t for t in tensors if not t.shape and _is_float(t.dtype)]
        if zero_d_float:
            d = _DTYPE_NAMES[zero_d_float[0].dtype]
        elif any(isinstance(s.value, float) for s in scalars):
            d = torch.float32  # torch.get_default_dtype(); training scripts keep the default
    return str(d).removeprefix("torch.")


def elementwise(c: Call, base: str, inplace: bool, flops_per: float) -> Cost | None:
    ts = c.tensors
    if not ts:
        return None
    if inplace:
        out_shape, out_dtype = ts[0].shape, ts[0].dtype
    else:
        out_shape = _broadcast([t.shape for t in ts])
        if out_shape is None:
            return None
        out_dtype = "bool" if base in _BOOL_OUT else _promote(ts, [a for a in c.args if a.kind == "scalar"])
        if base in ("div", "true_divide") and not _is_float(out_dtype):
            out_dtype = "float32"
    if c.outs:
        out_shape, out_dtype = c.outs[0].shape, c.outs[0].dtype
    reads = sum(tbytes(t) for t in ts)
    return Cost(flops_per * _numel(out_shape), reads + obytes(out_shape, out_dtype))


def _gelu_flops(c: Call, base: str) -> float:
    tanh = c.value("approximate") == "tanh"
    if base == "gelu":
        return 9 if tanh else 5  # tanh form: 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3)))
    return 15 if tanh else 9


def write_only(c: Call) -> Cost | None:
    ts = c.tensors
    if not ts:
        return None
    self_ = ts[0]
    return Cost(0.0, obytes(self_.shape, self_.dtype) + sum(tbytes(t) for t in ts[1:]))


def copy_like(c: Call) -> Cost | None:
    """copy_(self, src): read src, write self. _to_copy/clone/...: read self, write a copy."""
    ts = c.tensors
    if not ts:
        return None
    if c.op.endswith("copy_") and len(ts) >= 2:
        dst, src = ts[0], ts[1]
        return Cost(0.0, tbytes(src) + obytes(dst.shape, dst.dtype))
    src = ts[0]
    dtype = SCALAR_TYPES.get(c.value("dtype"), src.dtype) if isinstance(c.value("dtype"), int) else src.dtype
    return Cost(0.0, tbytes(src) + obytes(src.shape, dtype))


def _dtype_arg(c: Call, default: str = "float32") -> str:
    v = c.value("dtype")
    return SCALAR_TYPES.get(v, default) if isinstance(v, int) else default


def factory(c: Call) -> Cost | None:
    """zeros/ones/full/rand*/arange/...: write the output."""
    base = _base(c.op)
    if base.endswith("_like"):
        t = c.tensors[0] if c.tensors else None
        if t is None:
            return None
        return Cost(0.0, obytes(t.shape, SCALAR_TYPES.get(c.value("dtype"), t.dtype) if isinstance(c.value("dtype"), int) else t.dtype))
    if base.startswith("new_"):
        t = c.tensors[0] if c.tensors else None
        size = c.value("size", 1)
        if t is None or not isinstance(size, list):
            return None
        return Cost(0.0, obytes(size, _dtype_arg(c, t.dtype)))
    if base in ("arange", "linspace", "logspace"):
        if base == "arange":
            end = c.value("end")
            start = c.value("start", default=0) if "start" in c.by_name else 0
            step = c.value("step", default=1) if "step" in c.by_name else 1
            if end is None:
                end = c.value("arg0")
            if not isinstance(end, (int, float)) or not step:
                return None
            n = max(0, math.ceil((end - start) / step))
            dtype = _dtype_arg(c, "float32" if any(isinstance(v, float) for v in (start, end, step)) else "int64")
        else:
            n = c.value("steps")
            if not isinstance(n, int):
                return None
            dtype = _dtype_arg(c)
        return Cost(float(n), obytes((n,), dtype))
    if base == "scalar_tensor":
        return Cost(0.0, obytes((), _dtype_arg(c)))
    size = c.value("size", 0)
    if not isinstance(size, list):
        return None
    return Cost(0.0, obytes(size, _dtype_arg(c)))


def _dims(c: Call, ndim: int) -> list[int] | None:
    """The reduced dims (None: all)."""
    v = c.value("dim", 1)
    if v is None or v == []:
        return None
    dims = [v] if isinstance(v, int) else list(v) if isinstance(v, list) else None
    if dims is None:
        return None
    return [d % ndim if ndim else 0 for d in dims]


def reduction(c: Call) -> Cost | None:
    """sum/mean/amax/var/...: read the input, write the reduced output (+ indices for max.dim)."""
    ts = c.tensors
    if not ts:
        return None
    x = ts[0]
    if c.overload in ("other",) or (len(ts) >= 2 and ts[1].shape and c.overload != "dim"):  # max(a, b): elementwise
        return elementwise(c, _base(c.op), False, 1)
    has_dim = "dim" in c.by_name
    dims = _dims(c, len(x.shape)) if has_dim else None
    keep = bool(c.value("keepdim", default=False))
    if dims is None:
        out = tuple(1 for _ in x.shape) if keep else ()
    else:
        out = tuple((1 if i in dims else s) for i, s in enumerate(x.shape) if keep or i not in dims)
    base = _base(c.op)
    out_dtype = _dtype_arg(c, x.dtype) if "dtype" in c.by_name else x.dtype
    if base in ("argmax", "argmin"):
        out_dtype = "int64"
    if base in ("any", "all"):
        out_dtype = "bool"
    if c.outs:
        out, out_dtype = c.outs[0].shape, c.outs[0].dtype
    written = obytes(out, out_dtype)
    if base in ("max", "min", "mode", "median", "kthvalue") and has_dim:
        written += obytes(out, "int64")  # values and indices
    if base in ("var_mean", "std_mean", "aminmax"):
        written *= 2
    per = {"var": 3, "std": 4, "var_mean": 3, "std_mean": 4, "norm": 2, "linalg_vector_norm": 2,
           "logsumexp": 3}.get(base, 1)  # var: sub mean, square, add; norm: square, add
    return Cost(per * _numel(x.shape), tbytes(x) + written)


def cumulative(c: Call) -> Cost | None:
    ts = c.tensors
    if not ts:
        return None
    x = ts[0]
    dtype = _dtype_arg(c, x.dtype) if "dtype" in c.by_name else x.dtype
    return Cost(_numel(x.shape), tbytes(x) + obytes(x.shape, dtype))


# Matmuls ---------------------------------------------------------------------------------------


def _registry(name: str) -> Callable | None:
    from torch.utils.flop_counter import flop_registry

    packet = getattr(torch.ops.aten, name, None)
    return flop_registry.get(packet) if packet is not None else None


def matmul(c: Call) -> Cost | None:
    """mm/addmm/bmm/baddbmm/_scaled_mm with torch.utils.flop_counter's formulas; bytes: the
    operands and the output."""
    base = _base(c.op)
    ts = c.tensors
    try:
        if base == "mm":
            a, b = ts[0], ts[1]
            out, flops = (a.shape[0], b.shape[1]), _registry("mm")(a.shape, b.shape)
        elif base == "addmm":
            a, b = c.tensor("mat1", 1), c.tensor("mat2", 2)
            out, flops = (a.shape[0], b.shape[1]), _registry("addmm")(ts[0].shape, a.shape, b.shape)
        elif base == "bmm":
            a, b = ts[0], ts[1]
            out, flops = (a.shape[0], a.shape[1], b.shape[2]), _registry("bmm")(a.shape, b.shape)
        elif base == "baddbmm":
            a, b = c.tensor("batch1", 1), c.tensor("batch2", 2)
            out, flops = (a.shape[0], a.shape[1], b.shape[2]), _registry("baddbmm")(ts[0].shape, a.shape, b.shape)
        elif base == "_scaled_mm":
            a, b = ts[0], ts[1]
            out, flops = (a.shape[0], b.shape[1]), 2 * a.shape[0] * a.shape[1] * b.shape[1]
        elif base == "_int_mm":
            a, b = ts[0], ts[1]
            out, flops = (a.shape[0], b.shape[1]), 2 * a.shape[0] * a.shape[1] * b.shape[1]
        elif base in ("mv", "addmv"):
            m, v = (ts[0], ts[1]) if base == "mv" else (ts[1], ts[2])
            out, flops = (m.shape[0],), 2 * m.shape[0] * m.shape[1]
        elif base in ("dot", "vdot"):
            out, flops = (), 2 * ts[0].shape[0]
        elif base in ("outer", "addr"):
            u, v = (ts[0], ts[1]) if base == "outer" else (ts[1], ts[2])
            out, flops = (u.shape[0], v.shape[0]), u.shape[0] * v.shape[0] * (1 if base == "outer" else 3)
        else:
            return None
    except (IndexError, TypeError, ValueError, AttributeError, AssertionError):
        return None
    out_dtype = ts[0].dtype if base not in ("addmm", "baddbmm", "addmv", "addr") else c.tensors[1].dtype
    if base == "_scaled_mm":
        out_dtype = _dtype_arg(c, "bfloat16") if isinstance(c.value("out_dtype"), int) else a.dtype
        out_dtype = SCALAR_TYPES.get(c.value("out_dtype"), out_dtype)
    if base == "_int_mm":
        out_dtype = "int32"
    if c.outs:
        out, out_dtype = c.outs[0].shape, c.outs[0].dtype
    return Cost(float(flops), sum(tbytes(t) for t in ts) + obytes(out, out_dtype))


def _conv_out(x: tuple, w: tuple, stride, padding, dilation, transposed, output_padding, groups) -> tuple:
    n = len(x) - 2
    f = lambda v: list(v) if isinstance(v, list) else [v] * n  # noqa: E731
    stride, padding, dilation, output_padding = f(stride or 1), f(padding or 0), f(dilation or 1), f(output_padding or 0)
    spatial = []
    for i in range(n):
        k = w[2 + i]
        if transposed:
            spatial.append((x[2 + i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (k - 1) + output_padding[i] + 1)
        else:
            spatial.append((x[2 + i] + 2 * padding[i] - dilation[i] * (k - 1) - 1) // stride[i] + 1)
    cout = w[1] * (groups or 1) if transposed else w[0]
    return (x[0], cout, *spatial)


def convolution(c: Call) -> Cost | None:
    ts = c.tensors
    if len(ts) < 2:
        return None
    base = _base(c.op)
    try:
        if base == "convolution_backward":
            go, x, w = ts[0], ts[1], ts[2]
            mask = c.value("output_mask", default=[True, True, True])
            flops = _registry("convolution_backward")(
                go.shape, x.shape, w.shape, None, c.value("stride"), c.value("padding"), c.value("dilation"),
                bool(c.value("transposed", default=False)), c.value("output_padding"), c.value("groups"), mask,
                out_val=(x.shape, w.shape, None))
            written = (obytes(x.shape, x.dtype) if mask[0] else 0) + (obytes(w.shape, w.dtype) if mask[1] else 0)
            if len(mask) > 2 and mask[2]:
                written += obytes((w.shape[0],), w.dtype)
            return Cost(float(flops), tbytes(go) + tbytes(x) + tbytes(w) + written)
        x, w = ts[0], ts[1]
        transposed = bool(c.value("transposed", default=False))
        out = _conv_out(x.shape, w.shape, c.value("stride"), c.value("padding"), c.value("dilation"), transposed,
                        c.value("output_padding"), c.value("groups", default=1))
        flops = _registry("convolution")(x.shape, w.shape, None, None, None, None, transposed, out_val=out)
        return Cost(float(flops), sum(tbytes(t) for t in ts) + obytes(out, x.dtype))
    except (IndexError, TypeError, ValueError, KeyError, AssertionError):
        return None


# Attention -------------------------------------------------------------------------------------

# Per op: memory layout of q/k/v ("bhsd" as SDPA takes them, "bshd" for the kernel-level ops),
# whether it is a backward, and the name of the argument saying it is causal.
ATTENTION_OPS: dict[str, tuple[str, bool, str]] = {
    "_scaled_dot_product_flash_attention": ("bhsd", False, "is_causal"),
    "_scaled_dot_product_efficient_attention": ("bhsd", False, "is_causal"),
    "_scaled_dot_product_cudnn_attention": ("bhsd", False, "is_causal"),
    "_scaled_dot_product_flash_attention_for_cpu": ("bhsd", False, "is_causal"),
    "_scaled_dot_product_fused_attention_overrideable": ("bhsd", False, "is_causal"),
    "_scaled_dot_product_flash_attention_backward": ("bhsd", True, "is_causal"),
    "_scaled_dot_product_efficient_attention_backward": ("bhsd", True, "is_causal"),
    "_scaled_dot_product_cudnn_attention_backward": ("bhsd", True, "is_causal"),
    "_scaled_dot_product_flash_attention_for_cpu_backward": ("bhsd", True, "is_causal"),
    "_scaled_dot_product_fused_attention_overrideable_backward": ("bhsd", True, "is_causal"),
    # torch >= 2.11's cuDNN SDPA backend (aten::_scaled_dot_product_cudnn_attention calls it on
    # sm90; the H200 Llama-1B trace has these as the rows that launch the cudnn kernels)
    "_cudnn_attention_forward": ("bhsd", False, "is_causal"),
    "_cudnn_attention_backward": ("bhsd", True, "is_causal"),
    "_flash_attention_forward": ("bshd", False, "is_causal"),
    "_flash_attention_backward": ("bshd", True, "is_causal"),
    "_efficient_attention_forward": ("bshd", False, "custom_mask_type"),
    "_efficient_attention_backward": ("bshd", True, "custom_mask_type"),
}


def _causal_fraction(sq: int, sk: int) -> float:
    """Share of (query, key) pairs a causal mask keeps: query i sees keys j <= i (top-left
    aligned, torch's is_causal)."""
    if sq <= 0 or sk <= 0:
        return 1.0
    kept = sum(min(i + 1, sk) for i in range(sq)) if sq <= 4096 else (
        sq * (sq + 1) / 2 if sq <= sk else sk * (sk + 1) / 2 + (sq - sk) * sk)
    return kept / (sq * sk)


def attention(c: Call) -> Cost | None:
    layout, backward, causal_arg = ATTENTION_OPS[_base(c.op)]
    g = lambda n, p: c.tensor(n, p)  # noqa: E731
    if backward:  # argument 0 is grad_out
        q, k, v = g("query", 1), g("key", 2), g("value", 3)
    else:
        q, k, v = g("query", 0), g("key", 1), g("value", 2)
    if q is None or k is None or v is None or len(q.shape) != 4 or len(k.shape) != 4:
        return None
    for varlen in ("cum_seq_q", "cu_seqlens_q"):
        a = c.get(varlen)
        if a is not None and a.kind == "tensor" and a.shape:
            return None  # packed variable-length batch: per-sequence lengths are not in the trace
    to_bhsd = (lambda s: (s[0], s[2], s[1], s[3])) if layout == "bshd" else (lambda s: tuple(s))
    qs, ks, vs = to_bhsd(q.shape), to_bhsd(k.shape), to_bhsd(v.shape)
    # Grouped-query attention: kv heads are broadcast to the query heads; the FLOPs are those of
    # the expanded problem (torch < 2.12's formula asserts equal heads, so expand here).
    ks = (ks[0], qs[1], ks[2], ks[3])
    vs = (vs[0], qs[1], vs[2], vs[3])
    try:
        if backward:
            flops = _registry("_scaled_dot_product_flash_attention_backward")(qs[:3] + (vs[3],), qs, ks, vs)
        else:
            flops = _registry("_scaled_dot_product_flash_attention")(qs, ks, vs)
    except (AssertionError, ValueError, TypeError):
        return None
    causal = c.value(causal_arg, default=False)
    if causal_arg == "custom_mask_type":
        causal = causal in (1, 2)  # 1: causal from the top left, 2: from the bottom right
    if causal:
        flops *= _causal_fraction(qs[2], ks[2])
    lse = obytes((qs[0], qs[1], qs[2]), "float32")  # log-sum-exp rows, fp32
    qkv = tbytes(q) + tbytes(k) + tbytes(v)
    out = obytes(qs[:3] + (vs[3],), q.dtype)
    if backward:
        # read q, k, v, out, dout, lse; write dq, dk, dv
        return Cost(float(flops), 2 * qkv + 2 * out + lse)
    return Cost(float(flops), qkv + out + lse)


# Normalization, softmax, losses, embeddings, indexing ----------------------------------------------

_ACC = {"float16": "float32", "bfloat16": "float32", "float32": "float32", "float64": "float64"}


def layer_norm(c: Call) -> Cost | None:
    """native_layer_norm / _fused_rms_norm (+ backward). Per element: LN forward 7 FLOPs (sum,
    sub mean, square, sum, mul rstd, mul weight, add bias); RMSNorm forward 4 (square, sum, mul
    rstd, mul weight); backward about twice the forward."""
    base = _base(c.op)
    ts = c.tensors
    if not ts:
        return None
    rms = "rms" in base
    if base.endswith("_backward"):
        x = ts[1]
        mask = c.value("output_mask", default=[True, True, True])
        w = c.tensor("weight")
        written = obytes(x.shape, x.dtype) if mask[0] else 0
        if w is not None and len(mask) > 1 and mask[1]:
            written += obytes(w.shape, w.dtype)
        b = c.tensor("bias")
        if b is not None and len(mask) > 2 and mask[2]:
            written += obytes(b.shape, b.dtype)
        reads = sum(tbytes(t) for t in ts if t.name != "bias")
        return Cost((8 if rms else 14) * _numel(x.shape), reads + written)
    x = ts[0]
    norm = c.value("normalized_shape", 1)
    norm = norm if isinstance(norm, list) else [x.shape[-1]] if x.shape else []
    rows = _numel(x.shape) // max(_numel(norm), 1)
    stats = (1 if rms else 2) * obytes((rows,), _ACC.get(x.dtype, x.dtype))
    return Cost((4 if rms else 7) * _numel(x.shape), sum(tbytes(t) for t in ts) + obytes(x.shape, x.dtype) + stats)


def softmax(c: Call) -> Cost | None:
    """_softmax/_log_softmax: 5 FLOPs per element (max, sub, exp, sum, div/log-sub); backward
    (grad_output, output): 4 (mul, row sum, sub, mul)."""
    base = _base(c.op)
    ts = c.tensors
    if not ts:
        return None
    if base.endswith("_backward_data"):
        go, y = ts[0], ts[1]
        dtype = SCALAR_TYPES.get(c.value("input_dtype"), go.dtype) if isinstance(c.value("input_dtype"), int) else go.dtype
        return Cost(4 * _numel(go.shape), tbytes(go) + tbytes(y) + obytes(go.shape, dtype))
    x = ts[0]
    dtype = "float32" if c.value("half_to_float", default=False) else x.dtype
    return Cost(5 * _numel(x.shape), tbytes(x) + obytes(x.shape, dtype))


def embedding(c: Call) -> Cost | None:
    """embedding(weight, indices): read the indices and the rows they pick, write the output.
    embedding_dense_backward: read grad and indices, write the dense weight gradient."""
    base = _base(c.op)
    ts = c.tensors
    if len(ts) < 2:
        return None
    if base == "embedding":
        w, idx = ts[0], ts[1]
        out = tuple(idx.shape) + tuple(w.shape[1:])
        return Cost(0.0, tbytes(idx) + 2 * obytes(out, w.dtype))
    go, idx = ts[0], ts[1]
    nw = c.value("num_weights", 2)
    if not isinstance(nw, int):
        return None
    return Cost(float(_numel(go.shape)), tbytes(go) + tbytes(idx) + obytes((nw, go.shape[-1]), go.dtype))


def index_select(c: Call) -> Cost | None:
    ts = c.tensors
    x, idx = c.tensor("self", 0), c.tensor("index", 2)
    if x is None or idx is None:
        return None
    d = c.value("dim", 1, 0) % max(len(x.shape), 1)
    out = tuple(_numel(idx.shape) if i == d else s for i, s in enumerate(x.shape))
    del ts
    return Cost(0.0, tbytes(idx) + 2 * obytes(out, x.dtype))


def gather(c: Call) -> Cost | None:
    x, idx = c.tensor("self", 0), c.tensor("index", 2)
    if x is None or idx is None:
        return None
    return Cost(0.0, tbytes(idx) + 2 * obytes(idx.shape, x.dtype))


def sort(c: Call) -> Cost | None:
    """sort(self, dim, descending) / sort.stable(self, stable, dim, descending): read the input,
    write the sorted values and their int64 indices. FLOPs: n * ceil(log2 n) comparisons per
    sorted slice of length n (a comparison sort's count; a radix sort makes passes over the
    bytes instead, so this is the arithmetic, not the kernel's)."""
    x = c.tensors[0] if c.tensors else None
    if x is None:
        return None
    d = c.value("dim", default=-1)
    d = d if isinstance(d, int) else -1
    n = x.shape[d] if x.shape else 1
    flops = _numel(x.shape) * math.ceil(math.log2(n)) if n > 1 else 0
    return Cost(float(flops), tbytes(x) + obytes(x.shape, x.dtype) + obytes(x.shape, "int64"))


def topk(c: Call) -> Cost | None:
    """topk(self, k, dim, largest, sorted): read the input once (one comparison per element
    against the running k-th value), write k values and k int64 indices per slice."""
    x = c.tensors[0] if c.tensors else None
    k = c.value("k", 1)
    if x is None or not isinstance(k, int):
        return None
    d = c.value("dim", 2, -1)
    d = (d if isinstance(d, int) else -1) % max(len(x.shape), 1)
    out = tuple(k if i == d else s for i, s in enumerate(x.shape)) if x.shape else ()
    return Cost(float(_numel(x.shape)), tbytes(x) + obytes(out, x.dtype) + obytes(out, "int64"))


def histc(c: Call) -> Cost | None:
    """histc(self, bins, min, max): read the input, write `bins` counts (the input's dtype).
    FLOPs: 3 per element (subtract min, scale to a bin, add one to it)."""
    x = c.tensors[0] if c.tensors else None
    bins = c.value("bins", 1, 100)
    if x is None or not isinstance(bins, int):
        return None
    return Cost(3.0 * _numel(x.shape), tbytes(x) + obytes((bins,), x.dtype))


def data_dependent(c: Call) -> Cost | None:
    """nonzero/argwhere(self), masked_select(self, mask), bincount(self, weights, minlength): the
    output's size depends on the values (and sizing it is a host sync on a GPU), so only what is
    known is counted, a lower bound: read every input, one FLOP per element (a test, or a count's
    add), and for bincount its `minlength` counts written (int64, or the weights' dtype)."""
    ts = c.tensors
    if not ts:
        return None
    b = sum(tbytes(t) for t in ts)
    n = _numel(ts[0].shape)
    if _base(c.op) == "bincount":
        minlength = c.value("minlength", 2, 0)
        w = c.tensor("weights", 1)
        b += obytes((minlength if isinstance(minlength, int) else 0,), w.dtype if w is not None else "int64")
    return Cost(float(n), b)


def grouped_mm(c: Call) -> Cost | None:
    """_grouped_mm(mat_a, mat_b, offs, bias, out_dtype): G matmuls in one call (MoE experts).
    `offs` splits the 2-D operand's grouped dim, so every case is 2*M*N*K over the whole problem:
    2d x 3d: a [M_total, K], b [G, K, N] -> [M_total, N]; 3d x 2d: a [G, M, K], b [K, N_total]
    -> [M, N_total]; 2d x 2d: a [M, K_total], b [K_total, N] -> [G, M, N] (the weight gradient);
    3d x 3d: batched [G, M, K] @ [G, K, N]. Bytes: both operands, offs, bias, the output."""
    ts = c.tensors
    if len(ts) < 2:
        return None
    a, b = ts[0], ts[1]
    offs = c.tensor("offs", 2)
    sa, sb = a.shape, b.shape
    if len(sa) == 2 and len(sb) == 3:
        (m, k), n = sa, sb[2]
        flops, out = 2 * m * k * n, (m, n)
    elif len(sa) == 3 and len(sb) == 2:
        (_, m, k), n = sa, sb[1]
        flops, out = 2 * m * k * n, (m, n)
    elif len(sa) == 2 and len(sb) == 2:
        if offs is None or not offs.shape:
            return None
        (m, k), n = sa, sb[1]
        flops, out = 2 * m * k * n, (offs.shape[0], m, n)
    elif len(sa) == 3 and len(sb) == 3:
        g, m, k = sa
        n = sb[2]
        flops, out = 2 * g * m * k * n, (g, m, n)
    else:
        return None
    out_dtype = SCALAR_TYPES.get(c.value("out_dtype"), a.dtype) if isinstance(c.value("out_dtype"), int) else a.dtype
    return Cost(float(flops), sum(tbytes(t) for t in ts) + obytes(out, out_dtype))


def index_put(c: Call) -> Cost | None:
    """index_put_(self, indices, values, accumulate): write (accumulate: read-modify-write) the
    indexed elements, read the values. The profiler does not record `indices` (a list of optional
    tensors: torch 2.13 records '' for it), so the indexed region is taken from `values`: exact
    when values is not broadcast (the backward of x[idx], an assignment of a computed tensor);
    a 0-d or 1-element values (x[mask] = 0) leaves the region unknown. The index reads are not
    counted (unknown size): a lower bound."""
    x = c.tensor("self", 0)
    v = c.tensor("values", 2)
    if x is None or v is None or _numel(v.shape) <= 1:
        return None
    accumulate = bool(c.value("accumulate", 3, False))
    b = tbytes(v) + (2 if accumulate else 1) * obytes(v.shape, x.dtype)
    if not c.op.endswith("_"):
        b += 2 * obytes(x.shape, x.dtype)  # out-of-place copies self first
    return Cost(float(_numel(v.shape)) if accumulate else 0.0, b)


def scatter(c: Call) -> Cost | None:
    """scatter/scatter_add/scatter_reduce/index_add/index_copy/index_fill: read index
    and source, write (add: read-modify-write) the touched elements; out-of-place also copies self."""
    base = _base(c.op)
    inplace = c.op.endswith("_")
    x = c.tensor("self", 0)
    if x is None:
        return None
    src = c.tensor("src") or c.tensor("source") or c.tensor("values")
    idx = c.tensor("index")
    touched = src.shape if src is not None else (idx.shape if idx is not None else None)
    if touched is None:
        return None
    # scatter_add_/index_add_ too: the in-place form accumulates like the out-of-place one
    accumulate = base.rstrip("_") in ("scatter_add", "index_add", "scatter_reduce") or bool(
        c.value("accumulate", default=False))
    b = (tbytes(src) if src is not None else 0) + (tbytes(idx) if idx is not None else 0)
    b += (2 if accumulate else 1) * obytes(touched, x.dtype)
    if not inplace:
        b += 2 * obytes(x.shape, x.dtype)
    return Cost(float(_numel(touched)) if accumulate else 0.0, b)


def nll_loss(c: Call) -> Cost | None:
    """nll_loss_forward(self [N, C], target [N]): read target and the N picked log-probs, write
    the loss. nll_loss_backward: read grad and target, write the [N, C] gradient (mostly zeros)."""
    base = _base(c.op)
    ts = c.tensors
    if base.endswith("_backward"):
        go, x = ts[0], ts[1]
        target = c.tensor("target", 2)
        return Cost(float(_numel(target.shape) if target else 0),
                    tbytes(go) + (tbytes(target) if target else 0) + obytes(x.shape, x.dtype))
    x, target = ts[0], ts[1]
    n = _numel(target.shape)
    reduction = c.value("reduction", 3, 1)
    out = () if reduction else target.shape
    w = c.tensor("weight")
    return Cost(float(n), tbytes(target) + n * (itemsize(x.dtype) or 0) + (tbytes(w) if w else 0)
                + obytes(out, x.dtype) + obytes((), x.dtype))


def cat(c: Call) -> Cost | None:
    lists = c.lists
    if not lists:
        return None
    return Cost(0.0, 2 * tbytes(lists[0]))


def dropout(c: Call) -> Cost | None:
    """native_dropout(input, p, train): read input, write output and the bool mask."""
    x = c.tensors[0] if c.tensors else None
    if x is None:
        return None
    train = c.value("train", 2, True)
    if train is False:
        return Cost(0.0, tbytes(x) + obytes(x.shape, x.dtype))
    return Cost(2.0 * _numel(x.shape), tbytes(x) + obytes(x.shape, x.dtype) + obytes(x.shape, "bool"))


def shaped_copy(c: Call) -> Cost | None:
    """Ops that read the input once and write an output of a known shape: pad, repeat, tril,
    flip, roll, ..."""
    x = c.tensors[0] if c.tensors else None
    if x is None:
        return None
    base = _base(c.op)
    out = x.shape
    if base == "constant_pad_nd":
        pad = c.value("pad", 1) or []
        out = list(x.shape)
        for i in range(len(pad) // 2):
            out[-1 - i] += pad[2 * i] + pad[2 * i + 1]
    elif base == "repeat":
        reps = c.value("repeats", 1) or []
        shape = [1] * (len(reps) - len(x.shape)) + list(x.shape)
        out = [s * r for s, r in zip(shape, reps)]
    if c.op.endswith("_"):
        return Cost(0.0, tbytes(x) + obytes(x.shape, x.dtype))
    return Cost(0.0, tbytes(x) + obytes(out, x.dtype))


def view_backward(c: Call) -> Cost | None:
    """slice_backward/select_backward/...(grad_output, input_sizes, ...): write a zero tensor of
    the input's size and copy the gradient into its view."""
    go = c.tensors[0] if c.tensors else None
    sizes = c.value("input_sizes", 1)
    if go is None or not isinstance(sizes, list):
        return None
    return Cost(0.0, tbytes(go) + obytes(sizes, go.dtype))


def local_scalar(c: Call) -> Cost | None:
    x = c.tensors[0] if c.tensors else None
    return None if x is None else Cost(0.0, float(itemsize(x.dtype) or 0))


# Optimizer ops over lists of tensors -------------------------------------------------------------

# Fused Adam(W) per parameter element: p *= 1 - lr*wd (1); m = lerp(m, g, 1-b1) (3);
# v = b2*v + (1-b2)*g*g (4); denom = sqrt(v)/sqrt(bc2) + eps (3); p -= step*m/denom (3).
ADAM_FLOPS_PER_ELEM = 14
SGD_FLOPS_PER_ELEM = 4  # weight decay add, momentum mul-add, update mul-sub


def foreach(c: Call) -> Cost | None:
    """_foreach_<op>[_]: the elementwise cost of <op> on each tuple of list elements."""
    m = re.match(r"_foreach_(\w+?)(_?)$", _base(c.op))
    if not m:
        return None
    base, inplace = m.group(1), m.group(2) == "_"
    lists = c.lists
    if not lists:
        return None
    n = len(lists[0].shape)
    total = Cost(0.0, 0.0)
    other_tensors = [a for a in c.args if a.kind == "tensor"]
    for i in range(n):
        elems = [Arg("tensor", L.shape[i], L.dtype[i] if i < len(L.dtype) else "float32",
                     L.strides[i] if i < len(L.strides) else (), None) for L in lists if i < len(L.shape)]
        elems += other_tensors if i == 0 else [t for t in other_tensors if t.shape]  # a 0-d tensor arg is read once
        first = elems[0]
        if base in ("zero", "fill"):
            total = total + Cost(0.0, obytes(first.shape, first.dtype))
        elif base in ("copy",):
            total = total + Cost(0.0, sum(tbytes(e) for e in elems[1:]) + obytes(first.shape, first.dtype))
        elif base in ("norm", "max"):
            total = total + Cost(2.0 * _numel(first.shape), tbytes(first) + obytes((), first.dtype))
        elif base in ELEMENTWISE_FLOPS:
            sub = Call.__new__(Call)
            sub.op, sub.args, sub.outs, sub.by_name, sub.overload, sub.composite = c.op, elems, [], {}, "", False
            cost = elementwise(sub, base, inplace, ELEMENTWISE_FLOPS[base])
            if cost is None:
                return None
            total = total + cost
        else:
            return None
    return total


def fused_optimizer(c: Call) -> Cost | None:
    """_fused_adam(w)_/_fused_sgd_: read param, grad and state, write param and state."""
    base = _base(c.op)
    lists = c.lists
    if not lists:
        return None
    params, grads = lists[0], lists[1] if len(lists) > 1 else lists[0]
    if base.startswith("_fused_adam"):
        state = lists[2:4]
        amsgrad = bool(c.value("amsgrad", default=False))
        if amsgrad and len(lists) > 4:
            state = lists[2:5]
        per = ADAM_FLOPS_PER_ELEM
    else:  # sgd: momentum buffers, if any
        state = [L for L in lists[2:3] if L.shape]
        per = SGD_FLOPS_PER_ELEM
    elems = sum(_numel(s) for s in params.shape)
    b = 2 * tbytes(params) + tbytes(grads) + sum(2 * tbytes(s) for s in state)
    return Cost(float(per * elems), b)


def amp_unscale(c: Call) -> Cost | None:
    lists = c.lists
    return None if not lists else Cost(float(sum(_numel(s) for s in lists[0].shape)), 2 * tbytes(lists[0]))


def communication(c: Call) -> Cost | None:
    """c10d collectives: the bytes of the buffers they move (no FLOPs modelled)."""
    b = sum(tbytes(t) for t in c.tensors) + sum(tbytes(L) for L in c.lists)
    return Cost(0.0, float(b))


# ----------------------------------------------------------------------------------------------
# Dispatch table: op base name -> formula. Order of checks in `inclusive_cost` is the precedence.

RULES: dict[str, Callable[[Call], Cost | None]] = {}
for _n in ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_int_mm", "mv", "addmv", "dot", "vdot", "outer", "addr"):
    RULES[_n] = matmul
for _n in ("convolution", "_convolution", "cudnn_convolution", "convolution_overrideable", "_slow_conv2d_forward",
           "convolution_backward"):
    RULES[_n] = convolution
for _n in ATTENTION_OPS:
    RULES[_n] = attention
for _n in ("native_layer_norm", "native_layer_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward"):
    RULES[_n] = layer_norm
for _n in ("_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data"):
    RULES[_n] = softmax
for _n in ("sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std", "var_mean", "std_mean", "norm",
           "linalg_vector_norm", "logsumexp", "argmax", "argmin", "any", "all", "nansum", "nanmean", "aminmax",
           "count_nonzero"):
    RULES[_n] = reduction
for _n in ("cumsum", "cumprod", "logcumsumexp"):
    RULES[_n] = cumulative
for _n in ("copy_", "_to_copy", "clone", "_copy_from", "_copy_from_and_resize", "lift_fresh_copy", "_to_dense",
           "to_dense"):
    RULES[_n] = copy_like
for _n in ("zeros", "ones", "full", "rand", "randn", "randint", "randperm", "zeros_like", "ones_like", "full_like",
           "rand_like", "randn_like", "randint_like", "new_zeros", "new_ones", "new_full", "arange", "linspace",
           "logspace", "scalar_tensor", "eye"):
    RULES[_n] = factory
for _n in ("embedding", "embedding_dense_backward"):
    RULES[_n] = embedding
RULES["index_select"] = index_select
RULES["gather"] = gather
for _n in ("scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_", "index_add",
           "index_add_", "index_copy", "index_copy_", "index_fill", "index_fill_", "masked_scatter", "masked_scatter_"):
    RULES[_n] = scatter
for _n in ("index_put", "index_put_", "_index_put_impl_"):
    RULES[_n] = index_put
RULES["sort"] = sort  # msort/argsort are composites over it
RULES["topk"] = topk
RULES["histc"] = histc
RULES["_grouped_mm"] = grouped_mm
for _n in ("nonzero", "argwhere", "masked_select", "bincount"):
    RULES[_n] = data_dependent
for _n in ("nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward"):
    RULES[_n] = nll_loss
for _n in ("cat", "stack", "_cat", "hstack", "vstack", "concat", "concatenate"):
    RULES[_n] = cat
RULES["native_dropout"] = dropout
for _n in ("constant_pad_nd", "repeat", "tril", "triu", "tril_", "triu_", "flip", "roll", "reflection_pad1d",
           "reflection_pad2d", "replication_pad1d", "replication_pad2d"):
    RULES[_n] = shaped_copy
RULES["_local_scalar_dense"] = local_scalar
for _n in ("slice_backward", "select_backward", "diagonal_backward", "as_strided_backward", "unfold_backward"):
    RULES[_n] = view_backward
for _n in ("_fused_adam_", "_fused_adamw_", "_fused_adam", "_fused_adamw", "_fused_sgd_", "_fused_sgd"):
    RULES[_n] = fused_optimizer
RULES["_amp_foreach_non_finite_check_and_unscale_"] = amp_unscale
RULES["_amp_update_scale_"] = lambda c: Cost(4.0, 16.0)  # a few scalars (scale, growth tracker, found_inf)


@lru_cache(maxsize=1)
def _load_kernels() -> None:
    """Import every kprof.kernels module so that their KernelSpecs (and op costs) are registered."""
    import importlib
    import pkgutil

    import kprof.kernels

    for m in pkgutil.iter_modules(kprof.kernels.__path__):
        if not m.name.startswith("_"):
            try:
                importlib.import_module(f"kprof.kernels.{m.name}")
            except Exception:  # noqa: BLE001 - a broken kernel module leaves its ops uncosted, not the profile
                pass


def _base(op: str) -> str:
    return op.split("::", 1)[-1]


def _namespace(op: str) -> str:
    return op.split("::", 1)[0] if "::" in op else ""


def inclusive_cost(op: str, shapes, dtypes, strides, concrete, types) -> tuple[Cost | None, bool]:
    """(cost of the whole call or None if unknown, whether the op is a composite that does no
    work of its own)."""
    ns, base = _namespace(op), _base(op)
    if ns == "kprof":
        _load_kernels()
        metas = [TensorMeta(tuple(s), _DTYPE_NAMES[d]) for s, d in zip(shapes or [], dtypes or [])
                 if isinstance(d, str) and d in _DTYPE_NAMES]
        return kprof_op_cost(op, metas), False
    if ns in ("c10d", "_c10d_functional", "c10d_functional", "_dtensor"):
        return communication(Call(op, shapes, dtypes, strides, concrete, types)), False
    if ns != "aten":
        return None, False
    if base in ZERO_COST:
        return Cost(0.0, 0.0), True
    c = Call(op, shapes, dtypes, strides, concrete, types)
    if c.lists and all(not a.shape for a in c.lists):
        # The profiler records no shapes for a TensorList longer than 30 tensors (checked on
        # torch 2.13 with 40 parameters: `Input Dims` [] for each list; the H200 Llama-1B run's
        # _fused_adamw_ over 75 parameters had "[0 tensors]" six times). An op whose every list
        # is empty does nothing, so this is a truncated record: unknown, not zero work.
        # (trace.op_table fills in a fused optimizer's lists from the step's gradients.)
        return None, False
    rule = RULES.get(base)
    cost = None
    if rule is not None:
        try:
            cost = rule(c)
        except (IndexError, TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError):
            cost = None
    elif base.startswith("_foreach_"):
        try:
            cost = foreach(c)
        except (IndexError, TypeError, ValueError, KeyError):
            cost = None
    elif base in WRITE_ONLY:
        cost = write_only(c)
    else:
        stem = base[:-1] if base.endswith("_") and not base.startswith("_") else base
        if stem in ELEMENTWISE_FLOPS:
            per = _gelu_flops(c, stem) if stem in ("gelu", "gelu_backward") else ELEMENTWISE_FLOPS[stem]
            cost = elementwise(c, stem, base.endswith("_") and not base.startswith("_"), per)
    if cost is None and c.composite:
        return Cost(0.0, 0.0), True
    return cost, False


def estimate_bytes(op: str, shapes, dtypes, strides, concrete, types) -> float | None:
    """The generic fallback for an op with no formula: its recorded inputs read once plus an
    output the size of its largest input. An estimate, shown as such: it never counts as costed
    (the output's real size, and any work, are unknown). None if no input was recorded."""
    if _namespace(op) != "aten":
        return None
    c = Call(op, shapes, dtypes, strides, concrete, types)
    sizes = [tbytes(a) for a in c.args if a.kind in ("tensor", "list")]
    if not any(sizes):
        return None
    return float(sum(sizes) + max(sizes))


# ----------------------------------------------------------------------------------------------
# The table


def _key(op, shapes, dtypes, strides, concrete, types) -> str:
    return json.dumps([op, shapes, dtypes, strides, concrete, types], default=str)


def annotate(ops: pd.DataFrame) -> pd.DataFrame:
    """Add `flops`, `bytes` (exclusive of child rows, see the module docstring), `cost_known`
    (a formula for the op costed it), `estimated bytes` (the generic fallback, estimate_bytes,
    on rows without a formula; NaN elsewhere) and `tensor_core` (a matmul-class op)."""
    ops = ops.copy()
    n = len(ops)
    if n == 0:
        for c, dt in (("flops", float), ("bytes", float), ("cost_known", bool), ("estimated bytes", float),
                      ("tensor_core", bool)):
            ops[c] = pd.Series(dtype=dt)
        return ops
    cache: dict[str, tuple[Cost | None, bool]] = {}
    inc_f = np.zeros(n)
    inc_b = np.zeros(n)
    known = np.zeros(n, bool)
    composite = np.zeros(n, bool)
    cols = [ops[c].tolist() for c in ("op", "input_shapes", "input_dtypes", "input_strides", "concrete_inputs", "input_types")]
    for i, row in enumerate(zip(*cols)):
        k = _key(*row)
        if k not in cache:
            cache[k] = inclusive_cost(*row)
        cost, comp = cache[k]
        if cost is not None:
            inc_f[i], inc_b[i], known[i] = cost.flops, cost.bytes, True
        composite[i] = comp
    # A composite that launched device work itself has a backend kernel we have no formula for.
    n_kernels = pd.to_numeric(ops["n_kernels"], errors="coerce").fillna(0).to_numpy()
    launched_unknown = composite & (inc_f == 0) & (inc_b == 0) & (n_kernels > 0) & ~np.isin(
        ops["op"].map(_base).to_numpy(), list(ZERO_COST))
    known &= ~launched_unknown
    # Exclusive cost: subtract what the child rows cost.
    op_id = pd.to_numeric(ops["op_id"], errors="coerce").fillna(-1).to_numpy().astype(np.int64)
    parent = pd.to_numeric(ops["parent_id"], errors="coerce").fillna(-1).to_numpy().astype(np.int64)
    child = pd.DataFrame({"parent": parent, "f": np.where(known, inc_f, 0.0), "b": np.where(known, inc_b, 0.0)})
    child = child[child["parent"] >= 0].groupby("parent")[["f", "b"]].sum()
    sub_f = pd.Series(op_id).map(child["f"]).fillna(0.0).to_numpy().copy()
    sub_b = pd.Series(op_id).map(child["b"]).fillna(0.0).to_numpy().copy()
    sub_f[op_id < 0] = 0.0
    sub_b[op_id < 0] = 0.0
    ops["flops"] = np.where(known, np.maximum(inc_f - sub_f, 0.0), np.nan)
    ops["bytes"] = np.where(known, np.maximum(inc_b - sub_b, 0.0), np.nan)
    ops["cost_known"] = known
    # Rows with no formula get the generic estimate, kept apart from `bytes` (see estimate_bytes).
    est = np.full(n, np.nan)
    for i in np.flatnonzero(~known):
        row = [col[i] for col in cols]
        k = "est" + _key(*row)
        if k not in cache:
            cache[k] = (estimate_bytes(*row), False)
        v = cache[k][0]
        est[i] = np.nan if v is None else v
    ops["estimated bytes"] = est
    ops["tensor_core"] = ops["op"].map(lambda o: _namespace(o) == "aten" and _base(o) in TENSOR_CORE_OPS).astype(bool)
    return ops
