"""`kprof suggest`: from a saved profile to a ranked plan of fixes. Pure functions over the run's
DataFrames; rendering lives in kprof/cli/patch_cmds.py.

No model is needed: each rule's `ProfilePattern` is matched against the op table (which ops ran
in each module, forward phase), the matched modules' evidence ops give the measured time, and the
replacement's roofline time at the same shapes gives the prediction:

    saving = measured time of the evidence ops (fwd + bwd, per step)
             - roofline time of the kernel at those shapes (KernelSpec.cost -> FLOPs and bytes,
               at the run's ceilings: max(FLOPs / peak, bytes / bandwidth), at least one launch
               latency per pass)

`kprof apply` then confirms each planned match on the live model (structure + probe) before it
patches anything, so a profile-side false positive costs a line in the report, never a wrong
result.

A host-bound step (the GPU busy less than HOST_BOUND_BUSY_PCT of it) keeps the GPU-time savings
but marks every row "low" with a caveat, and the plan carries `plan.attrs["host_bound"]`: there,
GPU time saved does not shorten the step, and each patched module adds host time.

The plan is saved as `plan.json` in the run directory.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from kprof import store
from kprof.analyze.modules import group_paths, host_bound, module_table, roofline_us, script_sources
from kprof.analyze.modules import step_ms as unprofiled_step_ms
from kprof.errors import KprofError
from kprof.rules.engine import evidence_ops, match_pattern

PLAN = store.PLAN


def _dtype_class(dtype, tf32: bool) -> str:
    import torch

    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "tf32" if tf32 else "fp32")


def predict_us(rule, problem: dict | None, summary: dict) -> float | None:
    """Roofline time of the replacement (fwd + bwd) for one matched module, or None if unknown."""
    from kprof.rules.engine import kernel_spec

    if problem is None:
        return None
    cost_fn = rule.cost
    if cost_fn is None:
        spec = kernel_spec(rule.kernels[0]) if rule.kernels else None
        if spec is None:
            return None
        cost_fn = spec.cost
    try:
        costs = cost_fn(**problem)
    except TypeError:
        return None  # the kernel's problem keys changed: say "unknown", don't guess
    cls = _dtype_class(problem.get("dtype"), bool(summary.get("tf32_assumed"))) if rule.tensor_core else "fp32"
    return sum(roofline_us(c, summary.get("ceilings") or {}, cls) for c in costs.values())


def _source(summary: dict, paths: Sequence[str], classes: Sequence[str], hint: str | None = None) -> str:
    """file:line of the matched module's code: from the run (summary['module_sources'], keyed by
    module path or class name) if the profiler recorded it, else for classes defined in the
    script, from the script's source."""
    src = dict(script_sources(summary.get("script"), hint))
    src.update(summary.get("module_sources") or {})
    for p, c in zip(paths, classes):
        s = src.get(p) or src.get(c)
        if s:
            return str(s)
    return ""


def rule_diff(rule, source: str) -> dict:
    """The exact source change of a kernel suggestion (kprof.rules.edits), or why there is none.
    SDPA is PyTorch's own: the hand-written chain can be replaced in the file, which is also the
    way out when `kprof apply` declines the live match. A kprof kernel has no source form."""
    from kprof.rules import edits

    if rule.id.startswith("attention"):
        path, _, line = (source or "").rpartition(":")
        if path and line.isdigit():
            return edits.sdpa(path, int(line))
        return edits.no_diff("the attention's source line is not known (its module is not defined in the "
                             "profiled script)")
    if rule.applyable:
        return edits.no_diff(f"a kprof kernel, installed at run time by `kprof apply --patch {rule.id}`; the "
                             "script needs no edit (`--write` gives the kprof.patch line that keeps it)")
    return edits.no_diff(f"no source form: {rule.code_change or 'the kernel is not in this install'}")


def suggest(run, rules: Sequence[Any] | None = None) -> pd.DataFrame:
    """Ranked suggestions for a saved run (kprof.store.Run). One row per rule that matched.
    plan.attrs["host_bound"]: host_bound(run.summary) (None when the step isn't host-bound)."""
    from kprof.rules import RULES

    rules = list(RULES if rules is None else rules)
    ops, summary = run.ops, run.summary
    if ops is None or not len(ops):
        raise KprofError(f"run {run.name} has no ops; profile again (kprof profile SCRIPT)")
    n_steps = max(int(summary.get("steps_recorded") or ops["step"].nunique() or 1), 1)
    step_ms = unprofiled_step_ms(summary)  # the unprofiled step: one basis with profile's figures
    table = module_table(ops, summary.get("module_classes"))
    hb = host_bound(summary)
    rows = []
    # Patterns are exclusive by construction (an RMSNorm has no layer_norm op, a gated MLP has the
    # multiply a Linear -> GELU lacks) and evidence selectors don't overlap (attention's matmuls
    # and softmax vs RoPE's mul/neg/cat in the same module), so no op is counted twice.
    for rule in rules:
        paths = match_pattern(rule.profile, table)
        if not paths:
            continue
        measured = predicted = 0.0
        known = True
        evs = []
        for p in paths:
            ev = evidence_ops(rule.profile, ops, table, p)
            evs.append(ev)
            measured += float(pd.to_numeric(ev["device_time (us)"], errors="coerce").fillna(0).sum()) / n_steps
            fwd_ev = ev[ev["step"] == ev["step"].min()] if len(ev) else ev
            pr = predict_us(rule, rule.problem(fwd_ev) if rule.problem else None, summary)
            if pr is None:
                known = False
            else:
                predicted += pr
        ev = pd.concat(evs) if evs else ops.iloc[:0]
        t = pd.to_numeric(ev["device_time (us)"], errors="coerce").fillna(0)
        att = pd.to_numeric(ev.get("attainable (us)"), errors="coerce") if "attainable (us)" in ev else None
        cls = (ev.assign(_t=t).groupby("class")["_t"].sum().idxmax() if len(ev) and "class" in ev else "")
        pct_roof = float(att.fillna(0).sum() / t.sum() * 100) if att is not None and t.sum() > 0 else math.nan
        saving = capped_saving_us(measured - predicted, step_ms) if known else math.nan
        classes = [table.at[p, "module_class"] for p in paths]
        source = _source(summary, paths, classes, "softmax" if rule.id.startswith("attention") else None)
        rows.append({
            "id": rule.id,
            "title": rule.title,
            "where": ", ".join(f"{g} x {n}" if n > 1 else g or "<model>" for g, n in group_paths(paths)),
            "paths": paths,
            "module_class": ", ".join(sorted(set(classes))),
            "source": source,
            "ms/step": measured / 1e3,
            "% of step": measured / 1e3 / step_ms * 100 if step_ms == step_ms and step_ms else math.nan,
            "class": cls,
            "% of roofline": pct_roof,
            "change": rule.change,
            "predicted ms/step": predicted / 1e3 if known else math.nan,
            "saving ms/step": saving / 1e3 if known else math.nan,
            "saving %": saving / 1e3 / step_ms * 100 if known and step_ms == step_ms and step_ms else math.nan,
            "confidence": confidence(rule.confidence, saving / 1e3 if known else None, hb is not None),
            "caveat": hb["caveat"] if hb else "",
            "applyable": rule.applyable,
            "how": "kprof apply --patch " + rule.id if rule.applyable else (
                rule.code_change or f"needs kernel(s) {', '.join(rule.missing_kernels())}"),
            "diff": rule_diff(rule, source),
        })
    cols = ["id", "title", "where", "paths", "module_class", "source", "ms/step", "% of step", "class",
            "% of roofline", "change", "predicted ms/step", "saving ms/step", "saving %", "confidence",
            "caveat", "applyable", "how", "diff"]
    plan = pd.DataFrame(rows, columns=cols)
    if len(plan):
        plan = _by_saving(plan)
    plan = plan.reset_index(drop=True)
    plan.attrs["host_bound"] = hb
    return plan


def capped_saving_us(saving_us: float, step_ms: float) -> float:
    """A saving between 0 and the whole unprofiled step: op times come from the profiled steps,
    which run slower (on a loaded machine, more than the whole unprofiled step)."""
    saving_us = max(saving_us, 0.0)
    return min(saving_us, step_ms * 1e3) if step_ms == step_ms and step_ms > 0 else saving_us


NO_SAVING_MS = 0.005  # below this an estimate prints as 0.00 ms/step: nothing to be sure of


def confidence(rule_confidence: str, saving_ms: float | None, host_bound: bool) -> str:
    """A rule's confidence in its match, or "low" where acting on it would not pay: an unknown
    saving, a saving that rounds to 0.00 ms/step, or a host-bound step (the GPU-time saving
    stands, but the step won't get shorter by it)."""
    if saving_ms is None or not saving_ms == saving_ms or saving_ms < NO_SAVING_MS or host_bound:
        return "low"
    return rule_confidence


def _by_saving(df: pd.DataFrame) -> pd.DataFrame:
    """Known savings first, largest first; then unknown savings by measured time; ties by id,
    so the order does not depend on the order the rules and diagnoses were tried in."""
    return df.assign(_k=df["saving ms/step"].isna(), _id=df["id"].astype(str)).sort_values(
        ["_k", "saving ms/step", "ms/step", "_id"], ascending=[True, False, False, True],
        kind="stable").drop(columns=["_k", "_id"])


def ranked(plan: pd.DataFrame, diagnoses: pd.DataFrame | None = None) -> pd.DataFrame:
    """Kernel suggestions and diagnoses (kprof.rules.diagnoses) in one list by estimated saving,
    unknown savings last, with `rank` (1 = the largest saving) and `kind` ("kernel" or
    "diagnosis"). A diagnosis that saves more than a kernel ranks above it: the user's time is
    best spent in this order, whichever tool does the change."""
    return _ranked_rows(plan, diagnoses).drop(columns="_row")


def _ranked_rows(plan: pd.DataFrame, diagnoses: pd.DataFrame | None) -> pd.DataFrame:
    # `ranked`, plus `_row`: each row's position in its own frame.
    parts = [df.assign(kind=kind, _row=range(len(df))) for df, kind in ((plan, "kernel"), (diagnoses, "diagnosis"))
             if df is not None and len(df)]
    if not parts:
        return pd.DataFrame(columns=["rank", "kind", *plan.columns, "_row"])
    both = _by_saving(pd.concat(parts, ignore_index=True)).reset_index(drop=True)
    both.insert(0, "rank", range(1, len(both) + 1))
    return both


def plan_records(plan: pd.DataFrame) -> list[dict]:
    return [{k: store.jsonable(v) for k, v in r.items()} for r in plan.to_dict("records")]


def plan_doc(run, plan: pd.DataFrame, diagnoses: pd.DataFrame | None = None) -> dict:
    """plan.json's content: the kernel suggestions (what `kprof apply` patches) and, apart, the
    diagnoses (changes the user makes in the script), each record with its `rank` in the one
    ranking of both (`ranked`). "host_bound": the plan's attrs["host_bound"] (null when the step
    isn't host-bound)."""
    both = _ranked_rows(plan, diagnoses)

    def part(df: pd.DataFrame, kind: str) -> list[dict]:
        # Each list keeps its own order (suggestions by saving, diagnoses in DIAGNOSES order).
        mine = both[both["kind"] == kind].sort_values("_row")
        return plan_records(df.assign(rank=mine["rank"].to_numpy())) if len(df) else []

    doc = {"run": run.name, "script": run.summary.get("script"), "argv": run.summary.get("argv"),
           "host_bound": store.jsonable(plan.attrs.get("host_bound")), "suggestions": part(plan, "kernel")}
    if diagnoses is not None:
        doc["diagnoses"] = part(diagnoses, "diagnosis")
    return doc


DIFFS = "diffs"


def save_diffs(run, *frames: pd.DataFrame | None) -> None:
    """Each row's unified diff as `diffs/<id>.patch` in the run's folder (`<id>-2.patch`, ... when
    an id has several rows), its path set as the row's diff["patch_file"] and the command that
    applies it as diff["command"] (the records are updated in place, so plan.json and --json name
    them). GNU patch ignores an absolute name under -p0, so a file outside the working directory
    is patched by base name in its folder (-d)."""
    folder = Path(run.path) / DIFFS
    seen: dict[str, int] = {}
    for df in frames:
        if df is None or "diff" not in df:
            continue
        for rid, d in zip(df["id"], df["diff"]):
            if not isinstance(d, dict) or not d.get("unified_diff"):
                continue
            seen[rid] = seen.get(rid, 0) + 1
            name = f"{rid}.patch" if seen[rid] == 1 else f"{rid}-{seen[rid]}.patch"
            folder.mkdir(exist_ok=True)
            (folder / name).write_text(d["unified_diff"])
            d["patch_file"] = str(folder / name)
            f = Path(d["file"])
            d["command"] = (f"patch -d {f.parent} < {d['patch_file']}" if f.is_absolute()
                            else f"patch -p0 < {d['patch_file']}")


def save_plan(run, plan: pd.DataFrame, diagnoses: pd.DataFrame | None = None) -> Path:
    """plan.json (`plan_doc`) in the run's folder, and the diffs beside it (`save_diffs`)."""
    save_diffs(run, plan, diagnoses)
    doc = plan_doc(run, plan, diagnoses)
    path = Path(run.path) / PLAN
    # A temporary name of its own: two `kprof suggest` at once must not rename each other's file.
    fd, tmp = tempfile.mkstemp(prefix=".plan.", suffix=".tmp", dir=run.path)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(doc, indent=1, allow_nan=False))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_plan(run) -> dict:
    path = Path(run.path) / PLAN
    if not path.exists():
        raise KprofError(f"run {run.name} has no plan yet; run `kprof suggest {run.name}` first")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise KprofError(f"{path} is unreadable ({e}); run `kprof suggest {run.name}` again") from e


def apply_entries(plan: dict) -> list[dict]:
    """The plan's entries `kprof apply` can install: kernel suggestions, then the diagnoses it
    installs. A memory rule's diagnosis counts whatever the plan says: one saved before the rule
    shipped marks it not applyable. A step rule's (cuda_graphs) is listed even when the run blocks
    it, not applyable, so `--patch cuda_graphs` says why."""
    from kprof.rules import MEMORY_RULES, STEP_RULES

    memory, step = {r.id for r in MEMORY_RULES}, {r.id for r in STEP_RULES}
    diags = [d if d.get("applyable") or d.get("id") not in memory else d | {"applyable": True}
             for d in plan.get("diagnoses") or [] if d.get("applyable") or d.get("id") in memory | step]
    return (plan.get("suggestions") or []) + diags


def parse_ids(spec: str, plan: dict, memory: bool = False) -> list[str]:
    """'all' -> every apply-able suggestion of the plan (kernel suggestions, then the diagnoses
    apply installs, e.g. unfused_optimizer; the memory rules, which cost time, only with
    `memory`: `--prefer memory`); 'a,b' -> those, checked against the plan."""
    from kprof.rules import MEMORY_RULES, STEP_RULES

    sugg = apply_entries(plan)
    if not sugg:
        raise KprofError(f"run {plan.get('run')} has no suggestions: nothing to apply "
                         "(kprof suggest found no pattern kprof can fix in this profile)")
    slower = {r.id for r in MEMORY_RULES}
    applyable = [s["id"] for s in sugg if s.get("applyable") and (memory or s["id"] not in slower)]
    if spec.strip() == "all":
        if not applyable:
            raise KprofError("none of the suggestions can be applied automatically; "
                             + "; ".join(f"{s['id']}: {s.get('how')}" for s in sugg))
        return applyable
    ids = [i.strip() for i in spec.split(",") if i.strip()]
    if not ids:
        raise KprofError("--patch needs 'all' or a comma-separated list of suggestion ids")
    known = {s["id"]: s for s in sugg}
    unknown = [i for i in ids if i not in known]
    if unknown:
        step = [i for i in unknown if i in {r.id for r in STEP_RULES}]
        why = (f" ({', '.join(step)} is planned beside a launch_bound finding, a GPU run whose step idles between "
               "short kernels, and this run has none)" if step else "")
        raise KprofError(f"--patch: {', '.join(unknown)} not in the plan of run {plan.get('run')}{why}; "
                         f"its suggestions are: {', '.join(known)}")
    manual = [i for i in ids if not known[i].get("applyable")]
    if manual:
        raise KprofError("--patch: " + "; ".join(f"{i} can't be applied automatically: {known[i].get('how')}"
                                                  for i in manual))
    return ids


def plan_for(before, rules_dir: str | None = None) -> dict:
    """The run's plan.json, computed and saved now (as `kprof suggest` would) if missing."""
    from kprof.rules import all_rules
    from kprof.rules.diagnoses import diagnose

    try:
        return load_plan(before)
    except KprofError:
        save_plan(before, suggest(before, all_rules(rules_dir)), diagnose(before))
        return load_plan(before)
