"""Unfused optimizer (for-loop or foreach Adam/AdamW/SGD) -> `fused=True`.

A for-loop optimizer launches several elementwise ops per parameter per step (AdamW's
`_single_tensor_adamw`: mul_, lerp_, mul_, addcmul_, sqrt, div, add_, addcdiv_); foreach groups
them into multi-tensor launches but still makes one pass over memory per op; the fused one makes
a single pass: it reads each parameter, gradient and state once and writes them once. On an
H200, AdamW over 537M fp32 parameters: for-loop 10.8 ms, foreach 11.7 ms, fused 4.3 ms per step
(measured 2026-11-29, issue 6). The bytes model below gives 7 x 4 B x 537M / 4161 GB/s = 3.6 ms
for the fused step at the H200's calibrated copy bandwidth, 84% of which the fused kernel reaches.

Evidence: ops.parquet rows in phase "optim" (inside Optimizer.step). Foreach: `_foreach_*` ops
over parameter-sized tensors. For-loop: at least MIN_LOOP_OPS parameter-sized elementwise ops per
step. A `_fused_*` op alone (with its 0-dim step counter updates) is a fused optimizer: not flagged.

Saving: the optimizer ops' measured time per step minus the fused step's memory time
(ACCESSES[class] x parameter elements x element size / the run's bandwidth). On a GPU the
measured time is kernel time only; a for-loop optimizer also leaves launch gaps, so the saving
is a lower bound there.
"""

from __future__ import annotations

import ast
import inspect
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd

from kprof.rules import edits
from kprof.rules.diagnoses.base import Diagnosis, Finding, is_gpu_run, n_steps, parse_script
from kprof.rules.edits import no_diff

ID = "unfused_optimizer"
# The classes kprof apply switches to their fused step (rules/optimizer.py ALGORITHMS), by name:
# the diagnosis reads a saved run, not the live optimizer.
INSTALLABLE = ("Adam", "AdamW", "SGD")

# Elementwise ops the torch.optim for-loop implementations call per parameter (op names without
# `aten::` and leading underscores; torch/optim/{adam,adamw,sgd,adagrad,rmsprop}.py).
ELEMENTWISE = frozenset({"add", "add_", "mul", "mul_", "div", "div_", "sub", "sub_", "lerp_", "addcmul_", "addcdiv_",
                         "sqrt", "sqrt_", "maximum", "maximum_", "neg", "neg_", "exp", "exp_"})
# A for-loop Adam(W) runs 7-8 of them per parameter, SGD with momentum 3 (mul_, add_, add_):
# three per step is the smallest for-loop optimizer over a single parameter.
MIN_LOOP_OPS = 3
# Memory accesses per parameter element of a fused step: Adam/AdamW read param, grad, exp_avg,
# exp_avg_sq and write param, exp_avg, exp_avg_sq; SGD (momentum), Adagrad, RMSprop read param,
# grad, one state and write param and state. Unknown classes are costed like Adam.
ACCESSES = {"Adam": 7, "AdamW": 7, "SGD": 5, "Adagrad": 5, "RMSprop": 5}
_ITEMSIZE = {"float": 4, "float32": 4, "c10::BFloat16": 2, "bfloat16": 2, "c10::Half": 2, "half": 2, "float16": 2,
             "double": 8, "float64": 8}


def _numels(shapes) -> list[int]:
    """Elements of each tensor in one argument's shape: [16, 8] -> [128]; a tensor list
    [[16, 8], [16]] -> [128, 16]; a non-tensor ([]) or a 0-dim tensor -> [1]."""
    if shapes is None:
        return [1]
    items = list(shapes)
    if items and all(hasattr(x, "__len__") for x in items):
        return [int(np.prod([int(d) for d in x])) if len(x) else 1 for x in items]
    return [int(np.prod([int(d) for d in items])) if items else 1]


def elements(input_shapes) -> int:
    """The op's parameter-sized work: the largest argument's total elements (a foreach op's
    list counts all its tensors; `mul(scalar, g, g)` counts g)."""
    args = list(input_shapes) if input_shapes is not None else []
    return max((sum(_numels(a)) for a in args), default=0) if args else 0


def _max_tensor(input_shapes) -> int:
    args = list(input_shapes) if input_shapes is not None else []
    return max((max(_numels(a)) for a in args), default=0)


def _first_dtype(dtypes) -> str:
    for d in list(dtypes) if dtypes is not None else []:
        if isinstance(d, str):
            if d in _ITEMSIZE:
                return d
        elif d is not None and hasattr(d, "__len__") and len(d):
            return str(list(d)[0])
    return "float"


def optimizer_ops(ops: pd.DataFrame) -> pd.DataFrame:
    """The optimizer's rows with `kind` (fused | foreach | loop | other) and `elements`."""
    if ops is None or not len(ops) or "phase" not in ops:
        return pd.DataFrame(columns=["kind", "elements", "base"])
    o = ops[ops["phase"] == "optim"].copy()
    from kprof.analyze.modules import op_base

    o["base"] = op_base(o["op"]) if len(o) else pd.Series(dtype=str)
    o["elements"] = [elements(s) for s in o["input_shapes"]] if "input_shapes" in o else 0
    param_sized = np.array([_max_tensor(s) > 1 for s in o["input_shapes"]], dtype=bool) if "input_shapes" in o \
        else np.zeros(len(o), dtype=bool)
    kind = np.where(o["base"].str.startswith("fused_"), "fused",
                    np.where(o["base"].str.startswith("foreach_") & param_sized, "foreach",
                             np.where(o["base"].isin(ELEMENTWISE) & param_sized, "loop", "other")))
    o["kind"] = kind
    if {"op_id", "parent_id"} <= set(o.columns):
        # A CPU foreach op runs per-tensor ops under it (its slow path): they belong to the foreach op.
        fe_ids = set(pd.to_numeric(o.loc[o["kind"] == "foreach", "op_id"], errors="coerce").dropna())
        under = pd.to_numeric(o["parent_id"], errors="coerce").isin(fe_ids).to_numpy()
        o.loc[under & (o["kind"] == "loop").to_numpy(), "kind"] = "foreach-child"
    return o


def optimizer_class(summary: dict) -> str | None:
    """'optimizer.step (AdamW)' (the runner's step definition) -> 'AdamW'."""
    m = re.search(r"optimizer\.step \((\w+)\)", str(summary.get("step_definition") or ""))
    return m.group(1) if m and m.group(1) != "not" else None


def accepts_fused(cls_name: str | None) -> bool:
    """Probe, don't version-check: does torch.optim.<cls> take `fused`?"""
    import torch

    cls = getattr(torch.optim, cls_name or "", None)
    return cls is not None and "fused" in inspect.signature(cls).parameters


def construction_line(script: str | None, cls_name: str | None) -> tuple[str, str] | None:
    """(file:line, code) of the first call of `cls_name` in the script (ast; nothing is run)."""
    parsed = parse_script(script) if cls_name else None
    if parsed is None:
        return None
    text, tree = parsed
    calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call)
             and getattr(c.func, "attr", getattr(c.func, "id", None)) == cls_name]
    if not calls:
        return None
    line = min(c.lineno for c in calls)
    return f"{script}:{line}", text.splitlines()[line - 1].strip()


def find(ops: pd.DataFrame, summary: dict) -> list[Finding]:
    o = optimizer_ops(ops)
    if not len(o):
        return []
    n = n_steps(ops, summary)
    counts = o["kind"].value_counts()
    if counts.get("foreach", 0):
        kind = "foreach"
    elif counts.get("loop", 0) / n >= MIN_LOOP_OPS:
        kind = "for-loop"
    else:
        return []  # fused (or no parameter-sized optimizer work)
    t = pd.to_numeric(o["device_time (us)"], errors="coerce").fillna(0)
    measured = float(t.sum()) / n / 1e3  # ms/step, the whole optimizer step

    # Parameter elements: every op of the step touches each parameter at least once, some twice
    # (AdamW's for-loop: 7 op names at N elements per step, mul_ at 2N), so the smallest per-name
    # total is the parameter count.
    work = o[o["kind"] == ("foreach" if kind == "foreach" else "loop")]
    n_elem = float(work.groupby("base")["elements"].sum().min()) / n
    itemsize = _ITEMSIZE.get(_first_dtype(work["input_dtypes"].iloc[0]) if "input_dtypes" in work else "float", 4)
    cls_name = optimizer_class(summary)
    accesses = ACCESSES.get(cls_name or "", ACCESSES["Adam"])
    ceil = summary.get("ceilings") or {}
    bw = float(ceil.get("mem_bw_gbs") or math.nan)
    fused_ms = max(accesses * n_elem * itemsize / (bw * 1e9) * 1e3, float(ceil.get("latency_us") or 0) / 1e3) \
        if math.isfinite(bw) else math.nan
    saving = max(measured - fused_ms, 0.0) if math.isfinite(fused_ms) else math.nan

    fused_ok = accepts_fused(cls_name)
    name = cls_name or "the optimizer"
    site = construction_line(summary.get("script"), cls_name)
    if fused_ok:
        how = f"torch.optim.{cls_name}(..., fused=True)"
        change = f"fused {name}: one pass over params, grads and state per step"
    else:
        how = (f"{name} has no fused=True in this torch; use torch.optim.AdamW(..., fused=True) if it fits, "
               "or compile the step: torch.compile(opt.step)")
        change = "a fused optimizer step"
    if site:
        how = f"{Path(site[0].rsplit(':', 1)[0]).name}:{site[0].rsplit(':', 1)[1]}: `{site[1]}` -> {how}"
    # kprof apply switches a live torch.optim Adam/AdamW/SGD to its fused step (rules/optimizer.py).
    applyable = cls_name in INSTALLABLE
    if applyable:
        how = f"kprof apply --patch {ID} (this run); to keep it: " + how
    if not fused_ok:
        diff = no_diff(f"{name} takes no fused=True in this torch: no one-keyword change")
    elif site is None:
        diff = no_diff(f"no {name}(...) call found in the script {summary.get('script')}: the optimizer is built "
                       "elsewhere (a library or another file)")
    else:
        path, line = site[0].rsplit(":", 1)
        diff = edits.call_keywords(path, int(line), (cls_name,), {"fused": "True"}, drop=("foreach",))
    per_step_ops = int(round(len(o) / n))
    evidence = (f"{name} ({kind}): {per_step_ops} ops/step in optimizer.step, {measured:.3f} ms/step, over "
                f"~{n_elem / 1e6:.3g}M parameter elements\nfused estimate: {accesses} accesses x {itemsize} B "
                f"per element at {bw:g} GB/s = {fused_ms:.3f} ms")
    note = "measured optimizer time - fused step's bytes / the run's bandwidth"
    if is_gpu_run(summary):
        note += " (kernel time only: the launch gaps a for-loop leaves are not counted, so a lower bound)"
    return [Finding(
        where=f"optimizer {name} ({kind})",
        evidence=evidence,
        change=change,
        how=how,
        ms_per_step=measured,
        saving_ms=saving,
        saving_note=note,
        source=site[0] if site else "",
        paths=["<optimizer>"],
        cls="memory-bound",
        confidence=("high" if fused_ok and cls_name in ACCESSES else "medium") if ceil.get("kind") != "default" else "low",
        details=[{"optimizer": cls_name, "implementation": kind, "parameter elements": n_elem,
                  "accepts fused": fused_ok, "fused estimate ms": fused_ms}],
        diff=diff,
        applyable=applyable,
    )]


DIAGNOSIS = Diagnosis(id=ID, title="unfused optimizer step", find=find)
