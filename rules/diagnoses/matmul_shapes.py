"""Matmul shapes that waste tensor cores -> pad the odd dimension (e.g. a vocab of 50257 -> 50304).

Tensor cores work on tiles; cuBLAS runs them best when M, N and K are multiples of 16 bytes
(8 bf16/fp16 elements, 4 tf32, 16 fp8) and, on A100 and later, of 128 bytes (64 bf16/fp16)
(NVIDIA, "Matrix Multiplication Background User's Guide", sec. 2.2 "Tensor Core Requirements").
A misaligned dimension forces narrower loads or a slower kernel, and the gradient matmuls carry
the same odd dimension (an lm-head's vocab is N forward, K in dX and M in dW). nanoGPT pads
GPT-2's vocab of 50257 to 50304 (= 64 x 786) for this reason.

Evidence: ops.parquet rows of the kernel-level matmuls (aten::mm/addmm/bmm/baddbmm: the rows
that carry the FLOPs and the time; aten::linear and aten::matmul are composites around them with
no work of their own) in the forward and backward, with dims M x K @ K x N from their recorded
shapes. A row is flagged when a dimension is not a multiple of 16 bytes ("misaligned"), or, for a
dimension >= LARGE_DIM, not a multiple of 128 bytes ("not 128-byte aligned", lower severity).
Dtypes: bf16/fp16/fp8 rows on a GPU, fp32 rows only where they run as TF32 (kernel name or the
run's tf32 flag): plain fp32 doesn't use tensor cores (fp32_matmul.py covers that). A CPU run has
no tensor cores: its matmuls are checked as a bf16/fp16 GPU run of the same script would be, and
the finding carries no saving (NaN: nothing to measure on a CPU).

What matters: rows whose roofline time at the run's peak is below one launch latency are
latency-bound at any shape and skipped; a group (one odd value) is reported only if its matmuls
take >= MIN_SHARE_PCT of the step.

Saving, per odd row, measured in this run: its time minus its FLOPs (scaled by the padding, e.g.
x 50304/50257) at the achieved TFLOP/s of the well-shaped matmuls (all dims multiples of 128
bytes, same dtype) of similar size in the same run: FLOPs within REF_BAND of the odd row's.
Smaller ones are a conservative reference (a matmul's achieved rate grows with its size until it
fills the GPU). With no such matmul in the run, the dtype's peak from the run's ceilings is used
instead, and the saving is an upper bound (no matmul reaches the peak). On a GPU with a measured
reference, a group whose saving is under MIN_SAVING_PCT of the step is not reported: the profile
shows the odd shape costs nothing worth a change.
"""

from __future__ import annotations

import ast
import math
from collections import defaultdict

import numpy as np
import pandas as pd

from kprof.rules import edits
from kprof.rules.diagnoses.base import Diagnosis, Finding, is_gpu_run, n_steps, parse_script, site, step_ms
from kprof.rules.edits import no_diff
from kprof.rules.diagnoses.manual_attention import arg_shapes, base_name, mm_dims
from kprof.rules.diagnoses.moe import static_dims

MIN_ALIGN_BYTES = 16  # tensor-core minimum (8 bf16/fp16 elements), NVIDIA's guide above
IDEAL_ALIGN_BYTES = 128  # A100 and later (64 bf16/fp16 elements)
# Only dims at least this large are held to the 128-byte rule: padding to a multiple of 64 adds
# at most 63 / dim of extra work, <= 6% from 1024 on; below that the padding can cost more than
# the alignment recovers.
LARGE_DIM = 1024
# Well-shaped matmuls within this FLOPs ratio of the odd one are its reference: down to 1/32
# (GPT-2 small's MLP matmuls are 1/16 of its lm-head's), up to 4x.
REF_BAND = (1 / 32, 4.0)
# Same thresholds as fp32_matmul.py: under 1% of the step is within a step's run-to-run spread
# (~1-3% on the H200 runs in benchmarks/results).
MIN_SHARE_PCT = 1.0
MIN_SAVING_PCT = 1.0
_ELT = {"bf16": 2, "fp16": 2, "tf32": 4, "fp8e4m3": 1, "fp8e5m2": 1, "fp8e4m3fnuz": 1, "fp8e5m2fnuz": 1}
_PEAK_KEY = {"bf16": "bf16", "fp16": "fp16", "tf32": "tf32", "fp8e4m3": "fp8", "fp8e5m2": "fp8",
             "fp8e4m3fnuz": "fp8", "fp8e5m2fnuz": "fp8"}
FLOAT_CLASSES = ("fp32", "bf16", "fp16", "fp64")


def padded(v: int, need: int, ideal: int) -> int:
    """The dimension to pad to: the next multiple of `ideal` for a large dim, of `need` for a
    small one (see LARGE_DIM)."""
    step = ideal if v >= LARGE_DIM else need
    return -(-v // step) * step


def odd_dims(dims: tuple[int, int, int], need: int, ideal: int) -> dict[int, str]:
    """{dim value: "misaligned" | "not 128-byte aligned"} for the dims of (M, K, N) that break the rule."""
    out: dict[int, str] = {}
    for v in dims:
        if v % need:
            out[v] = "misaligned"
        elif v >= LARGE_DIM and v % ideal and out.get(v) != "misaligned":
            out[v] = "not 128-byte aligned"
    return out


def matmul_rows(ops: pd.DataFrame, summary: dict) -> pd.DataFrame:
    """The kernel-level matmul rows with M, K, N, the class they run at on tensor cores
    (`tc`: bf16/fp16/tf32/fp8; empty if they don't) and their alignment in elements."""
    need_cols = {"op", "input_shapes", "flops", "device_time (us)"}
    if ops is None or not len(ops) or not need_cols <= set(ops.columns):
        return pd.DataFrame()
    base = ops["op"].map(base_name)
    sel = base.isin(["mm", "addmm", "bmm", "baddbmm"]).to_numpy().copy()
    if "phase" in ops:
        sel &= ops["phase"].isin(["fwd", "bwd"]).to_numpy()
    m = ops[sel].copy()
    if not len(m):
        return m
    for col, default in (("module", ""), ("phase", "fwd"), ("module_class", "")):
        if col not in m:
            m[col] = default
    dims = [mm_dims(o, arg_shapes(s)) for o, s in zip(m["op"], m["input_shapes"])]
    keep = np.array([d is not None for d in dims])
    m = m[keep]
    dims = [d for d in dims if d is not None]
    m["b"], m["M"], m["K"], m["N"] = ([d[i] for d in dims] for i in range(4)) if dims else ([], [], [], [])
    m["flops"] = pd.to_numeric(m["flops"], errors="coerce").fillna(0)
    m["t"] = pd.to_numeric(m["device_time (us)"], errors="coerce").fillna(0)
    m = m[(m["flops"] > 0) & (m["t"] > 0)]
    cls = m["dtype class"].astype(str) if "dtype class" in m else pd.Series("fp32", index=m.index)
    gpu = is_gpu_run(summary)
    if gpu:
        tf32 = bool(summary.get("tf32_assumed"))
        if "kernel" in m:
            tf32_k = m["kernel"].astype(str).str.contains("tf32", case=False, na=False)
        else:
            tf32_k = pd.Series(False, index=m.index)
        tc = np.where(cls.isin(list(_ELT)), cls, np.where((cls == "fp32") & (tf32_k | tf32), "tf32", ""))
    else:
        # CPU: no tensor cores; check float matmuls as a bf16/fp16 GPU run of the script would run them.
        tc = np.where(cls.isin(FLOAT_CLASSES), "bf16", np.where(cls.isin(list(_ELT)), cls, ""))
    m["tc"] = tc
    m["recorded"] = cls
    m = m[m["tc"] != ""]
    if not len(m):
        return m
    elt = m["tc"].map(_ELT).astype(int)
    m["need"] = (MIN_ALIGN_BYTES // elt).astype(int)
    m["ideal"] = (IDEAL_ALIGN_BYTES // elt).astype(int)
    return m


def _peak(summary: dict, tc: str) -> float:
    peaks = (summary.get("ceilings") or {}).get("peak_tflops") or {}
    v = peaks.get(_PEAK_KEY.get(tc, tc)) or (peaks.get("bf16") if tc == "fp16" else None)
    return float(v) if v else math.nan


def literal_line(script: str | None, value: int) -> str:
    """file:line of the first integer literal `value` in the script (ast; nothing is run): where
    a vocab or width is usually set."""
    parsed = parse_script(script)
    if parsed is None:
        return ""
    tree = parsed[1]
    lines = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Constant) and type(n.value) is int and n.value == value]
    return f"{script}:{min(lines)}" if lines else ""


def _change(v: int, p: int, need: int, ideal: int, rows: pd.DataFrame) -> tuple[str, str]:
    """(change, how) for one odd value, from the role it plays in a forward Linear if it does."""
    fwd_lin = rows[(rows["phase"] == "fwd") & (rows["module_class"] == "Linear")]
    mods = sorted(set(rows["module"]))
    name = mods[0] if len(mods) == 1 else "the layer"
    for r in fwd_lin.itertuples():
        if r.N == v:
            return (f"pad out_features {v} -> {p} (a multiple of {ideal})",
                    f"{name} = nn.Linear({r.K}, {p}); if it is the vocabulary, vocab_size = {p} (nanoGPT pads GPT-2's 50257 "
                    f"to 50304): the {p - v} extra logits are never targets, so cross-entropy drives them down; slice "
                    f"logits[..., :{v}] before sampling; a tied embedding gets {p} rows too")
        if r.K == v:
            return (f"pad in_features {v} -> {p} (a multiple of {ideal})",
                    f"make the width feeding {name} {p} (the hidden/intermediate size that produces it), or zero-pad "
                    f"the input: F.pad(x, (0, {p - v})) with nn.Linear({p}, {r.N})")
        if r.M == v:
            return (f"make the tokens per matmul (batch x sequence = {v}) a multiple of {need} ({ideal} ideally)",
                    f"pad or choose batch and sequence length so batch x seq is {p} (e.g. pad sequences to a "
                    f"multiple of {need})")
    return (f"pad the dimension {v} -> {p} (a multiple of {ideal if p % ideal == 0 else need})",
            f"pad the tensor dimension of size {v} to {p} (zeros; slice the result back), or pick a size that is a "
            f"multiple of {need}, e.g. a head dim or sequence length")


def find(ops: pd.DataFrame, summary: dict) -> list[Finding]:
    m = matmul_rows(ops, summary)
    if not len(m):
        return []
    ceil = summary.get("ceilings") or {}
    lat = float(ceil.get("latency_us") or 0.0)
    peaks = np.array([_peak(summary, c) for c in m["tc"]])
    with np.errstate(invalid="ignore"):
        at_peak = m["flops"].to_numpy() / (peaks * 1e12) * 1e6
    # Latency-bound at any shape: the odd dim can't be what costs (a NaN peak keeps the row).
    m = m[~(at_peak < lat)]
    if not len(m):
        return []
    odd = [odd_dims((r.M, r.K, r.N), r.need, r.ideal) for r in m.itertuples()]
    # Tokens per expert in an MoE block are set by the router, not by a line to pad: only the
    # experts' weight dims are advised on there (issue 21: "pad 99 -> 104" on a token count).
    static = static_dims(ops, summary)
    for i, mod in enumerate(m["module"].astype(str)):
        for root, dims in static.items():
            if mod == root or mod.startswith(root + "."):
                odd[i] = {v: how for v, how in odd[i].items() if v in dims}
    well = np.array([r.M % r.ideal == 0 and r.K % r.ideal == 0 and r.N % r.ideal == 0 for r in m.itertuples()])
    gpu = is_gpu_run(summary)
    n = n_steps(ops, summary)
    st = step_ms(summary)
    flops, t = m["flops"].to_numpy(), m["t"].to_numpy()
    tcs = m["tc"].to_numpy()

    groups: dict[int, list[int]] = defaultdict(list)
    pads: list[float] = []
    for i, (od, need, ideal) in enumerate(zip(odd, m["need"], m["ideal"])):
        # The padded matmul does more work: x 50304/50257 for the vocab, for every odd dim.
        pads.append(math.prod(padded(v, need, ideal) / v for v in od))
        if od:
            # One group per row: its worst odd value (misaligned before 128-byte), the largest.
            key = max(od, key=lambda v: (od[v] == "misaligned", v))
            groups[key].append(i)

    findings = []
    for v, idx in groups.items():
        g = m.iloc[idx]
        ms = float(g["t"].sum()) / n / 1e3
        if math.isfinite(st) and st > 0 and ms / st * 100 < MIN_SHARE_PCT:
            continue
        r0 = g.iloc[0]
        need, ideal, tc = int(r0["need"]), int(r0["ideal"]), str(r0["tc"])
        severity = "misaligned" if v % need else "not 128-byte aligned"
        p = padded(v, need, ideal)
        achieved = float(g["flops"].sum() / (g["t"].sum() * 1e-6) / 1e12)
        saving, refs, upper = math.nan, [], False
        if gpu:
            saving = 0.0
            for i in idx:
                lo, hi = flops[i] * REF_BAND[0], flops[i] * REF_BAND[1]
                ref = well & (tcs == tcs[i]) & (flops >= lo) & (flops <= hi)
                if ref.any():
                    rate = flops[ref].sum() / (t[ref].sum() * 1e-6)  # FLOP/s
                    refs.append((int(ref.sum()), rate))
                    new = flops[i] * pads[i] / rate * 1e6
                else:
                    upper = True
                    new = max(flops[i] * pads[i] / (_peak(summary, tcs[i]) * 1e12) * 1e6, lat)
                saving += max(t[i] - new, 0.0) if math.isfinite(new) else math.nan
            saving = saving / n / 1e3
            if not upper and math.isfinite(saving) and math.isfinite(st) and st > 0 and saving / st * 100 < MIN_SAVING_PCT:
                continue  # measured: the odd shape runs about as fast as the well-shaped ones
        shapes = []
        for r in g.drop_duplicates(["op", "M", "K", "N"]).itertuples():
            batch = f"{r.b} x " if r.b > 1 else ""
            shapes.append(f"{r.phase} {batch}[{r.M}, {r.K}] x [{r.K}, {r.N}]")
        paths = list(g.groupby("module")["t"].sum().sort_values(ascending=False).index)
        from kprof.analyze.modules import group_paths

        grouped = group_paths(paths) if len(paths) > 1 else [(paths[0], 1)] if paths else []
        where = ", ".join(f"{pg} x {k}" if k > 1 else pg or "<model>" for pg, k in grouped)
        rec = "/".join(sorted(set(g["recorded"].astype(str))))
        kind = tc if gpu else f"{rec} (checked as {tc})"
        evidence = (f"{len(g) / n:g} {kind} matmuls/step with a dimension of {v} ({v} mod {need} = {v % need}"
                    + (f", mod {ideal} = {v % ideal}" if v % need == 0 else "") + f"): {'; '.join(shapes[:3])}"
                    + (f" (+{len(shapes) - 3} more)" if len(shapes) > 3 else "")
                    + f"\n{ms:.2f} ms/step at {achieved:.1f} TFLOP/s")
        if not gpu:
            evidence += " (CPU)"
            note = ("CPU run: no tensor cores, so the odd shape costs nothing measurable here; checked as a bf16/fp16 "
                    "GPU run would be: profile on the GPU to measure it")
        elif refs and not upper:
            nref = max(k for k, _ in refs)
            rate = sum(r for _, r in refs) / len(refs) / 1e12
            evidence += (f"; well-shaped {tc} matmuls of similar size in this run (dims multiples of {ideal}, "
                         f"{REF_BAND[0]:.3g}-{REF_BAND[1]:g}x its FLOPs, up to {nref} ops) reach {rate:.1f} TFLOP/s")
            note = (f"measured: odd-shaped time - its FLOPs x {p}/{v} at the achieved TFLOP/s of well-shaped "
                    f"matmuls of similar size in this run")
        else:
            evidence += f"; no well-shaped {tc} matmul of similar size in this run: compared with the {tc} peak"
            note = (f"upper bound: odd-shaped time - its FLOPs x {p}/{v} at the {tc} peak of the run's ceilings "
                    "(no matmul reaches the peak)")
        change, how = _change(v, p, need, ideal, g)
        src = literal_line(summary.get("script"), v)
        at = site(src)
        if not change.startswith("pad out_features"):
            # Padding an input width or the tokens per matmul changes the data or the layer feeding it.
            diff = no_diff(f"the dimension {v} is not a Linear's out_features set by a literal (it is an input "
                           "width or batch x sequence): padding it changes other code, no exact change")
        elif at is None:
            diff = no_diff(f"no literal {v} in the script {summary.get('script')}: the size comes from a config "
                           "or another file")
        else:
            diff = edits.literal(at[0], at[1], v, p)
        if severity == "misaligned":
            conf = "high" if gpu and refs and not upper else "medium"
        else:
            conf = "medium" if gpu and refs and not upper else "low"
        details = []
        for (mod, op, ph, M, K, N), d in g.groupby(["module", "op", "phase", "M", "K", "N"], sort=False)["t"]:
            details.append({"module": mod, "op": op, "phase": ph, "M": int(M), "K": int(K), "N": int(N),
                            "per step": len(d) / n, "ms/step": float(d.sum()) / n / 1e3})
        findings.append(Finding(
            where=where,
            evidence=evidence,
            change=change,
            how=how,
            ms_per_step=ms,
            saving_ms=saving,
            saving_note=note,
            source=src,
            paths=paths,
            cls=f"{severity} matmul dim",
            confidence=conf,
            details=[{"dim": v, "padded": p, "severity": severity, "dtype": tc, "align": need, "ideal align": ideal}]
            + details,
            diff=diff,
        ))
    findings.sort(key=lambda f: -(f.saving_ms if math.isfinite(f.saving_ms) else f.ms_per_step))
    return findings


DIAGNOSIS = Diagnosis(id="matmul_shapes", title="matmul shapes that waste tensor cores", find=find)
