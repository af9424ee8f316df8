"""Kernel problems (the kwargs of `KernelSpec.cost`) read from a matched module's evidence ops.

ops.parquet stores each op's `input_shapes` (a list of shapes, one per argument; [] for
non-tensors) and `input_dtypes`. A module's first forward op sees the module's input, which is
what the kernels' problems are sized by.
"""

from __future__ import annotations

import math

import torch

_DTYPES = {"float": torch.float32, "float32": torch.float32, "c10::BFloat16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "c10::Half": torch.float16, "half": torch.float16,
           "float16": torch.float16, "torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16,
           "torch.float16": torch.float16}


def to_dtype(name) -> torch.dtype:
    """Trace dtype names ("c10::BFloat16", "float") to torch dtypes; unknown -> fp32."""
    return _DTYPES.get(str(name), torch.float32)


def _first_forward(ops):
    fwd = ops[ops["phase"] == "fwd"] if "phase" in ops else ops
    return fwd.iloc[0] if len(fwd) else None


def first_shape(ops) -> tuple[tuple[int, ...], torch.dtype] | None:
    row = _first_forward(ops)
    if row is None:
        return None
    shapes = list(row.get("input_shapes") if row.get("input_shapes") is not None else [])
    dtypes = list(row.get("input_dtypes") if row.get("input_dtypes") is not None else [])
    for i, s in enumerate(shapes):
        if s is not None and len(s) >= 1:
            return tuple(int(d) for d in s), to_dtype(dtypes[i] if i < len(dtypes) else "float")
    return None


def rows_cols_from_first_input(ops) -> dict | None:
    """(…, n_cols) input -> n_rows x n_cols: row-wise kernels (norms, softmax, GLU halves)."""
    got = first_shape(ops)
    if got is None:
        return None
    shape, dtype = got
    return {"n_rows": math.prod(shape[:-1]), "n_cols": shape[-1], "dtype": dtype}
