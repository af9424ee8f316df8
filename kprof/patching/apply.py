"""`kprof apply SCRIPT --patch all|ID,ID`: re-run a profiled script with the planned patches and
compare. Library side; kprof/cli/patch_cmds.py renders.

1. The plan comes from the given (default: the latest plain, i.e. unpatched and uncompiled) run of
   the same script (`plan.json`, written by `kprof suggest`; computed now if missing).
2. The script runs under the profiler again, unmodified: the runner calls `on_root_module` at
   each root module's first call, before its forward, and `kprof.patch` installs the chosen rules
   there. Each patch verifies itself on its first real call (kprof/patching/verify.py); failures are
   reverted and reported (`strict` makes them an error).
3. The same number of warmup and recorded steps is profiled and saved as a new run; the result
   holds both runs side by side: step time, tokens/s, peak memory, per suggestion the measured vs
   predicted saving, and the first losses of both runs.

`kprof apply SCRIPT --compare` (eager vs patches vs torch.compile vs both) lives in kprof/patching/compare.py.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import pandas as pd

from kprof import store
from kprof.analyze.profile import load_run, profile_script
from kprof.errors import KprofError
from kprof.patching.install import check_rules
from kprof.patching.install import patch as kpatch
from kprof.plan.suggest import parse_ids, plan_for


@dataclass
class ApplyResult:
    before: object  # kprof.store.Run
    after: object
    patch_ids: list[str]
    reports: list  # one PatchReport per root module patched
    steps: pd.DataFrame  # metric | before | after | change
    suggestions: pd.DataFrame  # id | where | predicted saving | measured saving | patched | verified | failed
    losses: pd.DataFrame  # step | before | after | rel diff
    losses_agree: bool | None  # first loss within the verification tolerance; None if not comparable
    loss_tolerance: float | None
    write_lines: str
    notes: list[str] = field(default_factory=list)


def _subtree_us(ops: pd.DataFrame, paths: Sequence[str], n_steps: int) -> float:
    """Device time per step of everything under `paths` (fwd + bwd); the root path "" counts its
    own ops and its leaf children (the lm head), not the whole model."""
    mod = ops["module"]
    mask = pd.Series(False, index=ops.index)
    for p in paths:
        if p == "":
            mask |= (mod == "") | (~mod.str.contains(r"\.", regex=True) & (ops["module_class"] == "Linear"))
        else:
            mask |= (mod == p) | mod.str.startswith(p + ".")
    sel = ops[mask & ops["phase"].isin(["fwd", "bwd"])]
    return float(pd.to_numeric(sel["device_time (us)"], errors="coerce").fillna(0).sum()) / max(n_steps, 1)


def _median(summary: dict, key: str) -> float:
    return float((summary.get(key) or {}).get("median") or math.nan)


def _pct(a: float, b: float) -> float:
    return (b - a) / a * 100 if a and a == a and b == b else math.nan


def compare(before, after, plan: dict, ids: Sequence[str], reports: Sequence) -> tuple[pd.DataFrame, pd.DataFrame]:
    sb, sa = before.summary, after.summary
    rows = []
    for label, key in (("step time (ms, median)", "profiled_step_time_ms"),
                       ("step time unprofiled (ms, median)", "step_time_ms")):
        b, a = _median(sb, key), _median(sa, key)
        rows.append({"metric": label, "before": b, "after": a, "change %": _pct(b, a)})
    for label, key, scale in (("tokens/s", "tokens_per_s", 1.0), ("peak memory (GiB)", "peak_memory_bytes", 2.0**-30)):
        b, a = sb.get(key), sa.get(key)
        if key == "tokens_per_s" and a is None and sb.get("tokens_per_step") and _median(sa, "step_time_ms") > 0:
            # The runner counts tokens from the logits it sees; a fused-loss model returns none.
            # Same script and arguments, so the batch is the before run's.
            a = sb["tokens_per_step"] / (_median(sa, "step_time_ms") / 1e3)
        b = float(b) * scale if b is not None else math.nan
        a = float(a) * scale if a is not None else math.nan
        rows.append({"metric": label, "before": b, "after": a, "change %": _pct(b, a)})
    steps = pd.DataFrame(rows)

    nb = int(sb.get("steps_recorded") or 1)
    na = int(sa.get("steps_recorded") or 1)
    recs = [r for rep in reports for r in rep.records]
    srows = []
    for s in plan.get("suggestions") or []:
        if s["id"] not in ids:
            continue
        mine = [r for r in recs if r.rule == s["id"]]
        paths = s.get("paths") or []
        measured = (_subtree_us(before.ops, paths, nb) - _subtree_us(after.ops, paths, na)) / 1e3
        srows.append({
            "id": s["id"], "where": s.get("where"),
            "predicted saving ms/step": s.get("saving ms/step"),
            "measured saving ms/step": measured,
            "patched": len(mine),
            "verified": sum(r.status == "verified" for r in mine),
            "failed": sum(r.status == "reverted" for r in mine),
            "planned modules": len(paths),
        })
    return steps, pd.DataFrame(srows, columns=["id", "where", "predicted saving ms/step", "measured saving ms/step",
                                               "patched", "verified", "failed", "planned modules"])


def compare_losses(before, after, reports, n: int = 5) -> tuple[pd.DataFrame, bool | None, float | None]:
    """First losses side by side. The first loss is computed before any optimizer step, so it sees
    the same weights (for a seeded script) and must agree within the verification tolerance of the
    patched code's dtype; later ones drift apart as the updates differ by rounding and are shown
    with their relative difference only."""
    from kprof.kernels.common import TOLERANCE

    lb, la = before.summary.get("losses") or [], after.summary.get("losses") or []
    k = min(n, len(lb), len(la))
    df = pd.DataFrame({"step": range(k), "before": lb[:k], "after": la[:k]})
    df["rel diff"] = (df["after"] - df["before"]).abs() / df["before"].abs().clip(lower=1e-12)
    if not k:
        return df, None, None
    dts = [r.verification.dtype for rep in reports for r in rep.records if r.verification is not None]
    from kprof.patching.verify import COARSENESS

    dtype = max(dts, key=COARSENESS.__getitem__) if dts else None
    if dtype is None:
        return df, None, None
    tol = TOLERANCE[dtype]
    b, a = float(lb[0]), float(la[0])
    return df, abs(a - b) <= tol.atol + tol.rtol * abs(b), tol.rtol


def write_lines(ids: Sequence[str], strict: bool) -> str:
    today = _dt.date.today().isoformat()
    opts = ", strict=True" if strict else ""
    return (
        f"# Keep kprof's patches (verified by `kprof apply` on {today}). Add after the model is built\n"
        f"# and moved to its device, before the optimizer's first step; `model` is your nn.Module.\n"
        f"import kprof\n"
        f"kprof_report = kprof.patch(model, rules={list(ids)!r}{opts})  # kprof_report.unpatch() undoes it\n"
    )


def apply(
    script: str,
    argv: Sequence[str] = (),
    *,
    patch: str = "all",
    run: str | None = None,
    strict: bool = False,
    rules_dir: str | None = None,
    out_root=None,
    progress: Callable | None = None,
) -> ApplyResult:

    if not Path(script).is_file():
        raise KprofError(f"no such script: {script}")
    root = out_root or store.DEFAULT_ROOT
    before = load_run(run, root) if run is not None else store.latest_plain_run(root)
    store.check_same_script(before, script)
    plan = plan_for(before, rules_dir)
    ids = parse_ids(patch, plan)
    check_rules(ids, rules_dir)  # a plan made with --rules DIR needs the same DIR: fail before running the script

    reports = []

    def on_root(model) -> None:
        reports.append(kpatch(model, rules=ids, strict=strict, rules_dir=rules_dir))

    def strict_failure() -> KprofError | None:
        failed = [r for rep in reports for r in rep.records if r.status == "reverted"]
        if not (strict and failed):
            return None
        return KprofError("--strict: " + "; ".join(f"{r.rule} at {r.path or '<model>'} failed verification: "
                                                   f"{r.verification.summary()}" for r in failed)
                          + "; run without --strict to keep the original code for these and go on")

    try:
        after = profile_script(script, list(argv), warmup=int(before.summary.get("warmup") or 3),
                               steps=int(before.summary.get("steps") or 5), out_root=root,
                               progress=progress, on_root_module=on_root)
    except KprofError:
        err = strict_failure()  # the gate raised inside the script: say so without its traceback
        if err is not None:
            raise err from None
        raise
    finally:
        for rep in reports:  # RoPE patches a shared module namespace: leave the process as we found it
            rep.unpatch()
    if not reports:
        raise KprofError(f"{script} never called an nn.Module, so there was nothing to patch")
    notes = []
    recs = [r for rep in reports for r in rep.records]
    matched = {r.rule for r in recs}
    for i in ids:
        if i not in matched:
            notes.append(f"{i}: planned from the profile but not confirmed on the live model (structure or probe "
                         "did not match); left unpatched")
    pending = [r for r in recs if r.status == "pending"]
    if pending:
        notes.append(f"{len(pending)} patch(es) never ran during the profiled steps (still unverified): "
                     + ", ".join(sorted({r.path for r in pending})[:5]))
    for rep in reports:
        for rid, why in rep.skipped:
            if rid in ids:
                notes.append(f"{rid}: {why}")
    by_note: dict[tuple[str, str], int] = {}
    for r in recs:
        if r.note:
            by_note[(r.rule, r.note)] = by_note.get((r.rule, r.note), 0) + 1
    notes += [f"{rule} ({n} module{'s' if n > 1 else ''}): {note}" for (rule, note), n in by_note.items()]
    err = strict_failure()
    if err is not None:
        raise err

    steps, sugg = compare(before, after, plan, ids, reports)
    losses, agree, tol = compare_losses(before, after, reports)
    kept = sorted({r.rule for r in recs if r.status == "verified"}, key=ids.index)
    result = ApplyResult(before, after, ids, reports, steps, sugg, losses, agree, tol,
                         write_lines(kept or ids, strict), notes)
    _save(result)
    return result


def _save(res: ApplyResult) -> None:

    def recs(df):
        return [{k: store.jsonable(v) for k, v in r.items()} for r in df.to_dict("records")]

    doc = {"before": res.before.name, "patch": res.patch_ids, "steps": recs(res.steps),
           "suggestions": recs(res.suggestions), "losses": recs(res.losses), "losses_agree": res.losses_agree,
           "patches": [{"rule": r.rule, "path": r.path, "status": r.status, "source": r.source,
                        "verification": r.verification.summary() if r.verification else None}
                       for rep in res.reports for r in rep.records],
           "notes": res.notes}
    (Path(res.after.path) / store.APPLY).write_text(json.dumps(doc, indent=1, allow_nan=False, default=str))
