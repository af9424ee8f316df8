"""Memory diagnoses: what makes the step's peak, and the change that lowers it (issue 28).

Each reads the run's memory breakdown (summary.json "memory", kprof/analyze/memory.py) and, for
time costs, the op table. A finding's saving is memory, not time: `details[0]` holds
`saving_bytes` (GiB in the words) and `time_cost_ms` (per step; NaN when it can't be told), and
`saving ms/step` is minus the time cost, so the plan's time column stays honest.

* activation_checkpointing: the repeated layers whose saved activations cost most per
  millisecond of their forward (what checkpointing recomputes in the backward). Saving: their
  saved activations, an upper bound (each checkpointed layer keeps its input). Cost: their
  forward time, measured in the recorded steps.
* large_vocab_logits: a cross-entropy over >= LARGE_VOCAB classes; the logits, their fp32
  log-probabilities and their gradient are (N, V) each. Saving: 2 x N x V x 4 B (the fused
  linear + cross-entropy computes them in chunks); cost: none measured (the fused kernel is
  usually faster, `kprof suggest` shows the patch).
* fp32_state: fp32 parameters with fp32 AdamW state, trained under bf16 autocast or not: bf16
  state (or a bf16 model) halves the state. Saving: half the fp32 optimizer state (and half the
  parameters and gradients when the model itself is fp32 under autocast).
* grads_kept_alive: gradients live at the forward's start (`zero_grad(set_to_none=False)`, found
  in the script too): freeing them before the forward lowers a peak in the forward or at its end.
* fragmentation: reserved minus allocated at the peak over FRAGMENTATION_SHARE of the reserved
  memory: `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`.
"""

from __future__ import annotations

import ast
import math

import pandas as pd

from kprof.rules.diagnoses.base import Diagnosis, Finding, n_steps, parse_script

GiB = float(1 << 30)
# Activations saved for backward below this share of the peak are not worth a recompute.
MIN_ACTIVATION_SHARE = 0.10
LAYERS_SHOWN = 3
# Vocabulary size from which a cross-entropy's (N, V) tensors dominate: GPT-2's 50257 and
# Llama 3's 128256 are over it, a 1000-class image head is not.
LARGE_VOCAB = 32_000
# Fragmentation worth a config change: a tenth of the reserved memory idle at the peak (the
# allocator's rounding alone keeps a few percent).
FRAGMENTATION_SHARE = 0.10
MIN_SAVING_BYTES = 1 << 20  # below 1 MiB nothing is worth reporting


def _mem(summary: dict) -> dict:
    m = summary.get("memory") or {}
    return m if "categories" in m else {}


def _gib(b: float) -> str:
    return f"{b / GiB:.2f} GiB" if b >= GiB / 100 else f"{b / (1 << 20):.1f} MiB"


def _finding(where, evidence, change, how, saving, cost_ms, note, paths=(), extra=None, source="",
             applyable=False) -> Finding:
    d = {"saving_bytes": int(saving), "time_cost_ms": cost_ms} | (extra or {})
    return Finding(where=where, evidence=evidence, change=change, how=how,
                   saving_ms=-cost_ms if cost_ms is not None and math.isfinite(cost_ms) else math.nan,
                   saving_note=note, source=source, paths=list(paths), cls="memory", details=[d],
                   applyable=applyable)


def layer_costs(mem: dict, ops: pd.DataFrame, steps: int) -> pd.DataFrame:
    """Per repeated layer: saved activation bytes, forward ms per step, bytes per forward ms."""
    saved = pd.DataFrame(mem.get("activations_saved") or [], columns=["module", "layer", "bytes", "blocks"])
    g = saved[saved["layer"].str.contains(r"\.\d+$|^\d+$", regex=True)].groupby("layer")["bytes"].sum()
    rows = []
    for layer, b in g.items():
        fwd_ms = math.nan
        if ops is not None and len(ops) and {"module", "phase", "device time (us)"} <= set(ops.columns):
            sel = (ops["phase"] == "fwd") & ((ops["module"] == layer) | ops["module"].str.startswith(layer + "."))
            fwd_ms = float(ops.loc[sel, "device time (us)"].sum()) / 1e3 / steps
        rows.append({"layer": layer, "bytes": int(b), "forward ms": fwd_ms,
                     "bytes per ms": b / fwd_ms if fwd_ms and math.isfinite(fwd_ms) else math.inf})
    df = pd.DataFrame(rows, columns=["layer", "bytes", "forward ms", "bytes per ms"])
    return df.sort_values(["bytes per ms", "bytes", "layer"], ascending=[False, False, True]).reset_index(drop=True)


def find_checkpointing(ops: pd.DataFrame, summary: dict) -> list[Finding]:
    mem = _mem(summary)
    if not mem or mem.get("peak_phase") not in ("forward", "backward"):
        return []
    act = mem["categories"].get("activations", 0)
    if act < MIN_ACTIVATION_SHARE * mem["peak_bytes"] or act < MIN_SAVING_BYTES:
        return []
    layers = layer_costs(mem, ops, n_steps(ops, summary))
    if not len(layers):
        return []
    saving = int(layers["bytes"].sum())
    cost = float(layers["forward ms"].sum()) if layers["forward ms"].notna().all() else math.nan
    top = layers.head(LAYERS_SHOWN)
    ranked = ", ".join(f"{r['layer']} {_gib(r['bytes'])}"
                       + (f" / {r['forward ms']:.2f} ms" if math.isfinite(r["forward ms"]) else "")
                       for r in top.to_dict(orient="records"))
    return [_finding(
        where=f"{len(layers)} layers ({layers['layer'].iloc[0]}, ...)",
        evidence=(f"activations {_gib(act)} of the {_gib(mem['peak_bytes'])} peak ({mem['peak_moment']}); "
                  f"most saved per forward ms: {ranked}"),
        change="activation checkpointing on these layers, most bytes per recompute ms first",
        how=("kprof apply --patch activation_checkpointing --prefer memory (these layers), or "
             "torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) in the model's forward"),
        saving=saving, cost_ms=cost, paths=layers["layer"].tolist(), applyable=True,
        note=(f"saves up to {_gib(saving)} at the peak (the layers' saved activations; each keeps its "
              f"input); costs their forward again in the backward, "
              + (f"{cost:.2f} ms/step" if math.isfinite(cost) else "time unknown")),
        extra={"layers": layers.to_dict(orient="records")})]


def find_logits(ops: pd.DataFrame, summary: dict) -> list[Finding]:
    mem = _mem(summary)
    if not mem or ops is None or not len(ops) or "input_shapes" not in ops:
        return []
    ce = ops[ops["op"].astype(str).str.contains("log_softmax|cross_entropy", regex=True) & (ops["phase"] != "bwd")]
    best = None
    for shapes in ce["input_shapes"]:
        s = shapes[0] if shapes and isinstance(shapes[0], list) else None
        if s and len(s) >= 2 and s[-1] >= LARGE_VOCAB:
            n = math.prod(s[:-1])
            if best is None or n * s[-1] > best[0] * best[1]:
                best = (n, s[-1])
    if best is None:
        return []
    n, v = best
    saving = 2 * n * v * 4
    if saving < MIN_SAVING_BYTES:
        return []
    return [_finding(
        where=f"cross-entropy over {v:,} classes", paths=[],
        evidence=f"({n:,}, {v:,}) logits: {_gib(n * v * 4)} a copy in fp32; peak {_gib(mem['peak_bytes'])} "
                 f"({mem['peak_moment']})",
        change="fused linear + cross-entropy (logits in chunks, never whole)",
        how="kprof apply --patch linear_cross_entropy",
        saving=saving, cost_ms=0.0,
        note=f"saves about {_gib(saving)} (fp32 log-probs and their gradient, 2 x N x V x 4 B); "
             "no time cost expected: the fused kernel reads the logits once")]


def find_fp32_state(ops: pd.DataFrame, summary: dict) -> list[Finding]:
    mem = _mem(summary)
    t = mem.get("tensors") or {}
    state = (t.get("optimizer_state") or {}).get("by_dtype") or {}
    fp32 = state.get("float32", 0)
    if fp32 < MIN_SAVING_BYTES:
        return []
    params = (t.get("parameters") or {}).get("by_dtype") or {}
    autocast = ops is not None and len(ops) and "dtype" in ops and (
        ops.loc[ops["phase"] == "fwd", "dtype"].astype(str).str.contains("bf16|bfloat16").any())
    # Under autocast the fp32 parameters and their fp32 gradients are master copies: bf16 halves both.
    grads = ((t.get("gradients") or {}).get("by_dtype") or {}).get("float32", 0)
    saving = fp32 / 2 + ((params.get("float32", 0) + grads) / 2 if autocast else 0)
    return [_finding(
        where="optimizer state" + (" and fp32 master weights under bf16 autocast" if autocast else ""),
        evidence=f"fp32 optimizer state {_gib(fp32)}, fp32 parameters {_gib(params.get('float32', 0))}",
        change="bf16 optimizer state (or a bf16 model with fp32 state only where needed)",
        how="model.to(torch.bfloat16) before building the optimizer, or a bf16-state optimizer",
        saving=saving, cost_ms=math.nan,
        note=f"saves about {_gib(saving)} (half of each fp32 tensor); time: the optimizer moves fewer bytes, "
             "accuracy must be checked")]


def _set_to_none_false(script: str | None) -> tuple[str, int] | None:
    parsed = parse_script(script)
    if parsed is None:
        return None
    text, tree = parsed
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "zero_grad":
            for kw in node.keywords:
                if kw.arg == "set_to_none" and isinstance(kw.value, ast.Constant) and kw.value.value is False:
                    return text.splitlines()[node.lineno - 1].strip(), node.lineno
    return None


def find_grads_alive(ops: pd.DataFrame, summary: dict) -> list[Finding]:
    mem = _mem(summary)
    kept = ((mem.get("tensors") or {}).get("gradients_at_forward_start") or {}).get("bytes", 0)
    line = _set_to_none_false(summary.get("script"))
    if kept < MIN_SAVING_BYTES and line is None:
        return []
    # Kept grads lower the peak only where it falls before the backward writes them again.
    saving = kept if mem.get("peak_phase") == "forward" or mem.get("peak_moment", "").startswith("backward") else 0
    src = f"{summary.get('script')}:{line[1]}" if line else ""
    return [_finding(
        where=src or "gradients at the forward's start", source=src,
        evidence=(f"{_gib(kept)} of gradients live at the forward's start" if kept else "no grads measured")
                 + (f"; {line[0]}" if line else ""),
        change="free the gradients before the forward", how="optimizer.zero_grad(set_to_none=True)",
        saving=saving, cost_ms=0.0,
        note=f"saves up to {_gib(saving)} at a peak in the forward or backward; no time cost (no memset)")]


def find_fragmentation(ops: pd.DataFrame, summary: dict) -> list[Finding]:
    mem = _mem(summary)
    frag, res = mem.get("fragmentation_bytes"), mem.get("reserved_bytes")
    if not frag or not res or frag < FRAGMENTATION_SHARE * res or frag < MIN_SAVING_BYTES:
        return []
    return [_finding(
        where="CUDA caching allocator",
        evidence=f"reserved {_gib(res)}, allocated {_gib(mem['peak_bytes'])} at the peak: {_gib(frag)} cached but unused",
        change="expandable segments (one growing segment instead of many fixed ones)",
        how="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python train.py",
        saving=frag, cost_ms=0.0,
        note=f"saves up to {_gib(frag)} of reserved memory; no measurable time cost")]


CHECKPOINTING = Diagnosis("activation_checkpointing", "saved activations make the peak", find_checkpointing)
LOGITS = Diagnosis("large_vocab_logits", "large-vocabulary logits in memory", find_logits)
FP32_STATE = Diagnosis("fp32_state", "fp32 optimizer state / master weights", find_fp32_state)
GRADS_ALIVE = Diagnosis("grads_kept_alive", "gradients kept alive through the forward", find_grads_alive)
FRAGMENTATION = Diagnosis("fragmentation", "allocator fragmentation at the peak", find_fragmentation)
DIAGNOSES = [CHECKPOINTING, LOGITS, FP32_STATE, GRADS_ALIVE, FRAGMENTATION]
