"""`kprof apply SCRIPT --patch all|ID,ID`: keep only the planned patches that make the step
faster end to end, and say what wins instead. Library side; kprof/cli/patch_cmds.py renders.

1. The plan comes from the given (default: the latest plain, i.e. unpatched and uncompiled) run of
   the same script (`plan.json`, written by `kprof suggest`; computed now if missing).
2. Ablation (kprof/patching/ablation.py): the script runs once, unmodified and unprofiled, with
   every planned patch installed at its root module's first call; each verifies itself on its
   first real call (kprof/patching/verify.py; failures are reverted and reported, `strict` makes
   them an error). From the first timed step on, the runner's `on_step` hook switches the patch
   groups between steps (all on, all off, each left out, in randomized blocks) and the paired
   sign test keeps the groups that are significantly faster. `steps` bounds the ablation's timed
   steps. A script that compiles its model is ablated under its own compile: the patches are
   torch.library ops that Inductor launches itself, each configuration compiles once (Dynamo
   guards on the patched forwards) and is re-used from Dynamo's cache, so kprof+compile is timed
   against compile alone. Dynamo's recompile limits are raised by the configuration count for the
   run and restored after; two warm blocks instead of one keep every configuration's compile out
   of the counted steps (kprof/patching/ablation.py), and a counted step that compiled anyway is
   not counted. The kept patches are "active under compile", the others "stepped aside under
   compile" (compile's own fusion was not slower), each with its measured figure. A frame that
   hits the recompile limit anyway ran uncompiled: the ablation is declined with that reason.
3. The kept set alone is then profiled like the plan's run and saved as a new run: its
   unprofiled step median is `after_ms` and its first losses are checked against the plan's run.

`kprof apply SCRIPT --compare` (eager vs patches vs torch.compile vs both) lives in kprof/patching/compare.py.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import pandas as pd
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from kprof import store
from kprof.analyze.profile import load_run, profile_script
from kprof.errors import INTERRUPTED, PATCH_FAILED, SCRIPT_FAILED, KprofError
from kprof.patching import ablation as ab
from kprof.patching.install import OPTIMIZER_ID, check_rules, patch_optimizer
from kprof.patching.install import patch as kpatch
from kprof.plan.suggest import apply_entries, parse_ids, plan_for
from kprof.rules.cuda_graphs import dynamo_graphs

PREFER = ("time", "memory")
ABLATION_WARMUP = 3  # untimed steps before the ablation's first: see apply()


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
    ablation: "ab.Ablation | None" = None
    declined: str | None = None  # why no ablation ran (e.g. Dynamo hit its recompile limit in a compiled script)
    # The script compiles its model: the compile's cost to the ablation (_compile_cost) and the
    # patches active under compile / stepped aside for it (_under_compile); None otherwise.
    compiled: dict | None = None
    ablation_reports: list = field(default_factory=list)  # the ablation run's PatchReports
    kept: list[str] = field(default_factory=list)  # rule ids installed in the after run
    not_installed: list[dict] = field(default_factory=list)  # {"id", "why"}
    recommendation: str = ""
    prefer: str = "time"
    batch_headroom: float | None = None  # x larger batch in the same memory (prefer memory)
    watch: dict | None = None  # the loss watch over every step (loss_watch), None if it did not run
    peak_memory: dict | None = None  # {"before", "after": bytes, "kind": what was measured}
    largest_batch: dict | None = None  # prefer memory: {"before", "after", ...} or {"skipped": why}

    @property
    def before_ms(self) -> float:
        return _median(self.before.summary, "step_time_ms")

    @property
    def after_ms(self) -> float:
        return _median(self.after.summary, "step_time_ms")

    def to_dict(self) -> dict:
        """`kprof apply --json` and apply.json."""
        a = self.ablation
        recs = [r for rep in self.ablation_reports for r in rep.records]

        def rec(r):
            return {"rule": r.rule, "path": r.path, "status": r.status, "source": r.source,
                    "verification": r.verification.summary() if r.verification else None}

        doc = {
            "script": self.after.summary.get("script"), "before_run": self.before.name, "after_run": self.after.name,
            "before_ms": self.before_ms, "after_ms": self.after_ms, "prefer": self.prefer, "patch": self.patch_ids,
            "kept": self.kept,
            "patches": [{k: r[k] for k in ("id", "where", "verified", "kept", "predicted_saving_ms",
                                            "measured_saving_ms", "measured_interval_ms", "n", "spread_ms",
                                            "memory_saving_bytes", "group", "verdict", "reason")}
                        for r in self.suggestions.to_dict("records")],
            "not_installed": self.not_installed,
            "recommendation": self.recommendation,
            "batch_headroom": self.batch_headroom,
            "peak_memory": self.peak_memory, "largest_batch": self.largest_batch,
            "ablation": None if a is None else {
                "test": "sign test on paired per-block differences (all on but the group - all on), 95% interval "
                        "of the median from order statistics",
                "steps": a.steps, "blocks": a.blocks, "warm_blocks": a.warm_blocks, "uncounted_steps": a.skipped,
                "groups": [list(g) for g in a.groups],
                "config_ms": a.config_ms, "peak_bytes": a.peak_bytes, "config_times_ms": a.times_by_config,
                "total": None if a.total is None else {
                    "saving_ms": a.total.saving_ms, "interval_ms": [a.total.lo_ms, a.total.hi_ms], "n": a.total.n,
                    "verdict": a.total.verdict}},
            "ablation_declined": self.declined,
            "compiled": self.compiled,
            "steps": _recs(self.steps), "losses": _recs(self.losses), "losses_agree": self.losses_agree,
            "loss_tolerance": self.loss_tolerance, "loss_watch": self.watch,
            "records": {"ablation": [rec(r) for r in recs],
                        "after": [rec(r) for rep in self.reports for r in rep.records]},
            "notes": self.notes,
        }
        return store.jsonable(doc)


def _recs(df: pd.DataFrame) -> list[dict]:
    return [{k: store.jsonable(v) for k, v in r.items()} for r in df.to_dict("records")]


def _median(summary: dict, key: str) -> float:
    return float((summary.get(key) or {}).get("median") or math.nan)


def _pct(a: float, b: float) -> float:
    return (b - a) / a * 100 if a and a == a and b == b else math.nan


def compare(before, after) -> pd.DataFrame:
    """Step time, tokens/s and peak memory of the two runs side by side."""
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

    return steps


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


def _last_line(text: str | None) -> str:
    lines = [ln.strip() for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "no error message"


K_DIVERGENCE = 10.0  # a patched loss further from the plan's than 10x the unpatched runs' spread diverged


def loss_floor(loss: float, loss_dtype: str | None = None) -> float:
    """How closely one loss value is known: the fp32 row of the tolerance table at |loss| (the
    floor where two unpatched runs agree bit for bit), plus one spacing of the dtype the losses
    were returned in (a bf16 loss near 12 is only known to 0.06). Not the patched kernels' own
    tolerance: with bf16's, the limit near a loss of 3 was 0.58 and a planted drifting RMSNorm
    (10% off by its 100th call) moved the 1B Llama's loss by 0.107 unnoticed (H200)."""
    eps = 0.0
    if loss_dtype:
        dt = getattr(torch, str(loss_dtype).removeprefix("torch."), None)
        eps = torch.finfo(dt).eps if isinstance(dt, torch.dtype) and dt.is_floating_point else 0.0
    return 1e-5 + 2e-5 * abs(loss) + eps * abs(loss)


def loss_watch(before: Sequence[float], control: Sequence[float], after: Sequence[float],
               loss_dtype: str | None = None) -> dict:
    """Every step's loss of the patched run (`after`) against the plan's unpatched run
    (`before`), under the same seed and data. `control` is a second unpatched run: the
    spread |before - control| up to each step is what two runs of the same code differ by.
    Step i diverged when |after - before| > K_DIVERGENCE x max(that spread, `loss_floor`)."""
    n = min(len(before), len(control), len(after))
    spread = worst = 0.0
    checked = 0
    for i in range(n):
        b, c, a = float(before[i]), float(control[i]), float(after[i])
        if not all(math.isfinite(x) for x in (b, c)):
            continue
        spread = max(spread, abs(b - c))
        limit = K_DIVERGENCE * max(spread, loss_floor(b, loss_dtype))
        d = abs(a - b) if math.isfinite(a) else math.inf
        checked += 1
        if d > limit:
            return {"diverged": True, "step": i, "delta": d, "limit": limit, "spread": spread, "steps": n,
                    "k": K_DIVERGENCE, "before": b, "after": a}
        worst = max(worst, d)
    return {"diverged": False, "steps": checked, "max_delta": worst, "spread": spread, "k": K_DIVERGENCE}


def checkpoint_paths(plan: dict) -> list[str]:
    """The layers the activation_checkpointing diagnosis ranked (its paths), or none."""
    from kprof.rules.checkpointing import ID

    return next((list(d.get("paths") or []) for d in plan.get("diagnoses") or [] if d.get("id") == ID), [])


def live_rules(ids: Sequence[str], plan: dict) -> list:
    """What kprof.patch installs for the plan's ids: activation checkpointing on the layers the
    memory diagnosis chose (else on every repeated block), the other rules by id."""
    from kprof.rules.checkpointing import ID, checkpoint_rule

    paths = checkpoint_paths(plan)
    return [checkpoint_rule(paths) if i == ID and paths else i for i in ids if i != OPTIMIZER_ID]


# What the after run does for a compiled script (_recompile_whole), for the user's own loop.
COMPILED_LINES = (
    "# Your script compiles its model: call kprof.patch before torch.compile. Each patch verifies\n"
    "# eagerly at its first call, a graph break that can leave the model compiled in pieces; once\n"
    "# all are verified (after the 2nd step), recompile it whole, as kprof apply timed it:\n"
    "#     if step == 1: torch._dynamo.reset_code_caches()  # at the end of the training loop's body\n"
)


def write_lines(ids: Sequence[str], strict: bool, checkpoint: Sequence[str] = ()) -> str:
    from kprof.rules.checkpointing import ID

    today = _dt.date.today().isoformat()
    opts = ", strict=True" if strict else ""
    rules = [i for i in ids if i != OPTIMIZER_ID]
    head = ""
    if ID in rules and checkpoint:  # the diagnosis's layers, named: the plain id means every block
        head = "from kprof.rules.checkpointing import checkpoint_rule\n"
        text = ", ".join(repr(r) if r != ID else f"checkpoint_rule({list(checkpoint)!r})" for r in rules)
        rules_txt = f"[{text}]"
    else:
        rules_txt = repr(rules)
    opt = ", optimizer=optimizer" if OPTIMIZER_ID in ids else ""
    lines = (
        f"# Keep kprof's patches (verified by `kprof apply` on {today}). Add after the model is built\n"
        f"# and moved to its device, before the optimizer's first step; `model` is your nn.Module.\n"
    )
    if opt:
        lines += ("# `optimizer` is your torch.optim object (switched to its fused step); or build it with\n"
                  "# fused=True: the unfused_optimizer diff in the plan's run folder (diffs/) does that.\n")
    return lines + (f"import kprof\n{head}"
                    f"kprof_report = kprof.patch(model, rules={rules_txt}{opt}{opts})  # kprof_report.unpatch() undoes it\n")


def _script_graphs() -> int:
    """Dynamo graphs compiled in this process, less those the cuda_graphs patch compiled: what
    the script's own torch.compile did."""
    from kprof.rules.cuda_graphs import graphs_compiled

    return dynamo_graphs() - graphs_compiled()


def _compile_activity() -> int:
    """A count that moves whenever torch.compile compiles anything in this process: Dynamo's
    frames, AOTAutograd, Inductor's forward and the backward it compiles at the first backward
    (one timing record each in torch._dynamo.utils.compilation_time_metrics); Dynamo's graph
    count where that table moved."""
    if "torch._dynamo" not in sys.modules:
        return 0
    try:
        from torch._dynamo.utils import compilation_time_metrics

        return sum(len(v) for v in compilation_time_metrics.values())
    except Exception:  # internals moved  # noqa: BLE001
        return dynamo_graphs()


_LIMIT_HIT = re.compile(r"recompile.?limit|cache.?size.?limit", re.IGNORECASE)


def _limit_hits() -> int:
    """How often Dynamo hit a recompile limit in this process; each time, the frame ran
    uncompiled. Counted under its "unimplemented" stats by the limit's name ("Dynamo recompile
    limit exceeded ... recompile_limit" on torch 2.13, "cache_size_limit reached" before)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return sum(n for k, n in counters["unimplemented"].items() if _LIMIT_HIT.search(k))


def _recompile_whole() -> None:
    """Drop Dynamo's compiled code so the script's frames compile again, now that the patches are
    verified. A patch's first-call gate runs eagerly (torch.compiler.disable), a graph break; one
    inside a loop (`for layer in self.layers`) made Dynamo skip the whole frame for good, leaving
    per-layer graphs where compile alone has one (checked on torch 2.13): kprof + compile would
    be timed against a compile the script never had."""
    import torch._dynamo

    torch._dynamo.reset_code_caches()


def _recompile_limits() -> dict[str, int]:
    """Dynamo's per-frame and accumulated recompile limits, by their config names on this torch
    (recompile_limit, else its older name cache_size_limit)."""
    from torch._dynamo import config

    names = [("recompile_limit", "cache_size_limit"), ("accumulated_recompile_limit", "accumulated_cache_size_limit")]
    out = {}
    for new, old in names:
        name = new if hasattr(config, new) else old
        if hasattr(config, name):
            out[name] = int(getattr(config, name))
    return out


def _set_recompile_limits(limits: dict[str, int]) -> None:
    from torch._dynamo import config

    for name, v in limits.items():
        setattr(config, name, v)


class _Ablation:
    """The ablation run's hooks: install every planned patch at each root's first call, then at
    each timed step switch to that step's configuration (kprof.capture.runner.RunConfig.on_step)."""

    def __init__(self, ids: Sequence[str], *, strict: bool, rules_dir: str | None, budget: int | None,
                 seed: int, rules: Sequence | None = None, find_batch: bool = False):
        self.ids, self.strict, self.rules_dir, self.budget, self.seed = list(ids), strict, rules_dir, budget, seed
        # OPTIMIZER_ID is on_optimizer's; a rule may come as a Rule object (checkpointing's layers)
        self.rule_ids = list(rules) if rules is not None else [i for i in self.ids if i != OPTIMIZER_ID]
        self.find_batch = find_batch  # --prefer memory: the largest batch, patches off and on (CUDA)
        self.batch: dict | None = None
        self.last_call: tuple | None = None  # the root's latest (module, args, kwargs)
        self.hooks: list = []
        self.roots = 0
        self.reports: list = []
        self.groups: list[tuple[str, ...]] = []
        self.plan: list[ab.Config] = []
        self.declined: str | None = None
        self.blocks = 0
        self.peaks: list[float | None] = []
        self.static: list[float] = []
        self.dynamo0 = _script_graphs()
        self.hits_init = _limit_hits()
        self.cuda = False  # decided at the first timed step: per-step peak memory only on CUDA
        # Whether the script compiles its model is known only at the first timed step, after the
        # runner's step count is set: room for the compiled case's extra warm block.
        self.max_steps = (budget if budget is not None
                          else ab.steps_needed(len(self.ids), warm=ab.WARM_BLOCKS_COMPILED))
        self.compiled = False  # the script's own torch.compile ran before the timed steps
        self.warm = ab.WARM_BLOCKS
        self.limits: dict[str, int] = {}  # Dynamo's recompile limits before the ablation raised them
        self.raised: dict[str, int] = {}
        self.graphs0 = 0  # Dynamo's graph count at the first timed step
        self.graphs = 0  # graphs compiled during the timed steps
        self.hits0 = 0
        self.activity: list[int] = []  # _compile_activity() at each timed step's start, and after the last

    def on_root(self, model) -> None:
        self.roots += 1
        self.reports.append(kpatch(model, rules=self.rule_ids, strict=self.strict, rules_dir=self.rules_dir))
        if self.find_batch:
            def keep(mod, args, kwargs):  # a reference only: the script's own input tensors
                self.last_call = (mod, args, kwargs)

            self.hooks.append(model.register_forward_pre_hook(keep, with_kwargs=True))

    def on_optimizer(self, opt) -> None:
        """At an optimizer's first step: its fused step, proven on one step's copies."""
        self.reports.append(patch_optimizer(opt, strict=self.strict, rule=OPTIMIZER_ID))

    def _records(self):
        return [r for rep in self.reports for r in rep.records]

    def _start(self) -> bool:
        """At the first timed step: groups, schedule; True stops the run (nothing to ablate)."""
        import torch

        # A compile that hit the recompile limit before the timed steps compiled nothing, yet the
        # script compiles its model.
        self.compiled = _script_graphs() > self.dynamo0 or _limit_hits() > self.hits_init
        from kprof.rules import MEMORY_RULES, STEP_RULES, all_rules

        linked = [ids for rep in self.reports for ids in rep.toggle_sets()]
        switchable = {r for ids in linked for r in ids}
        # Only what a switch moves is timed (an optimizer patch, say, is not a unit: not switched).
        live = [r for r in self._records() if r.status in ("verified", "installed") and r.rule in switchable]
        # A rule may declare the rules whose output it consumes (see kprof/patching/ablation.py).
        pool = all_rules(self.rules_dir) + MEMORY_RULES + STEP_RULES
        consumes = {r.id: tuple(getattr(r, "consumes", ()) or ()) for r in pool}
        wrapping = [r.id for r in pool if r.wraps]
        self.groups = ab.groups_of([(r.rule, r.path, r.module) for r in live], consumes, linked, wrapping)
        if not self.groups:
            return True
        names = [ab.group_name(g) for g in self.groups]
        self.warm = ab.WARM_BLOCKS_COMPILED if self.compiled else ab.WARM_BLOCKS
        self.blocks = (ab.DEFAULT_BLOCKS if self.budget is None
                       else ab.blocks_within(self.budget, len(self.groups), self.warm))
        self.plan = ab.schedule(names, self.blocks, seed=self.seed, warm=self.warm)
        if self.compiled:
            _recompile_whole()
            # Every configuration adds one cache entry to each compiled frame it changes: raised
            # by the configuration count, no frame reaches the limit on the ablation's account.
            self.limits = _recompile_limits()
            self.raised = {k: v + len(ab.configs(names)) for k, v in self.limits.items()}
            _set_recompile_limits(self.raised)
            self.hits0 = _limit_hits()
            self.graphs0 = dynamo_graphs()
        self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        return False

    def restore(self) -> None:
        """Dynamo's recompile limits as they were before the ablation."""
        _set_recompile_limits(self.limits)

    def _limit_hit(self) -> bool:
        """Dynamo hit its recompile limit since the first timed step: a frame ran uncompiled, so
        the steps were not timed as compiled. Declined, with the reason."""
        if not self.compiled or _limit_hits() == self.hits0:
            return False
        limit = ", ".join(f"{k} {v}" for k, v in self.raised.items())
        self.declined = (f"Dynamo hit its recompile limit during the ablation ({limit}, raised by the "
                         f"{len(ab.configs([ab.group_name(g) for g in self.groups]))} configurations for it), so a "
                         "compiled frame ran uncompiled and the timings are not compile's; the script recompiles "
                         "at other steps too (changing shapes or guarded values: TORCH_LOGS=recompiles names them)")
        return True

    def on_step(self, i: int) -> bool:
        import torch

        if i == 0 and self._start():
            return True
        self.activity.append(_compile_activity())
        self.graphs = dynamo_graphs() - self.graphs0 if self.compiled else 0
        if self._limit_hit():
            self.enable_all()
            return True
        if self.cuda:
            if i >= 1:
                self.peaks.append(float(torch.cuda.max_memory_allocated()))
            if i < len(self.plan):
                # Between steps only weights, gradients and optimizer state are live: the static part.
                self.static.append(float(torch.cuda.memory_allocated()))
                torch.cuda.reset_peak_memory_stats()
        if i >= len(self.plan):
            if self.find_batch and self.cuda and self.last_call is not None:
                self.batch = self._largest_batch()
            self.enable_all()
            return True
        conf = self.plan[i]
        on = {r for g in self.groups if ab.group_name(g) not in conf.off for r in g}
        for rep in self.reports:
            rep.enable_only(on)
        return False

    def _largest_batch(self) -> dict:
        """Tried between the last steps, every patch off then on (kprof/patching/batch.py); the
        run stops right after, so the trials' side effects never reach a timed step."""
        from kprof.patching import batch

        mod, args, kwargs = self.last_call
        for h in self.hooks:  # the trials' own inputs are not kept alive through the next trial
            h.remove()
        self.hooks.clear()
        self.find_batch, self.last_call = False, None
        n = batch.batch_of(args, kwargs)
        if n is None:
            return {"skipped": "the model's input has no batch dimension to grow"}
        out = {"script_batch": n, "limit": n * batch.MAX_FACTOR}
        fits = batch.trial(mod, args, kwargs)
        for label, on in (("before", []), ("after", self.ids)):
            for rep in self.reports:
                rep.enable_only(on)
            with contextlib.ExitStack() as st:
                for rep in self.reports:
                    st.enter_context(rep.quiet())
                out[label] = batch.search(fits, n, n * batch.MAX_FACTOR)
        return out

    def enable_all(self) -> None:
        for rep in self.reports:
            rep.enable_only(self.ids)

    def compiled_steps(self) -> list[int]:
        """The timed steps during which torch.compile compiled something."""
        a = self.activity
        return [i for i in range(len(a) - 1) if a[i + 1] != a[i]]


def _compile_cost(abl: _Ablation, a: "ab.Ablation", times: Sequence[float]) -> dict:
    """What a compiled script's ablation spent on compiling: its warm blocks (every
    configuration's compile, then its second run), their time, and the part of it above those
    configurations' counted medians (the compile itself)."""
    n = min(len(times), abl.warm * len(ab.configs(abl.groups)))
    warm_ms = float(sum(times[:n]))
    run_ms = sum(a.config_ms.get(c.name, math.nan) for c in abl.plan[:n])
    return {
        "warm_blocks": abl.warm, "warm_steps": n,
        "extra_warm_steps": (abl.warm - ab.WARM_BLOCKS) * len(ab.configs(abl.groups)),
        "warm_s": warm_ms / 1e3, "compile_s": max(0.0, warm_ms - run_ms) / 1e3 if run_ms == run_ms else None,
        "graphs": abl.graphs, "configurations": len(ab.configs(abl.groups)),
        "compiled_steps": abl.compiled_steps(), "uncounted_steps": list(a.skipped),
        "recompile_limit": {k: {"was": v, "during": abl.raised[k]} for k, v in abl.limits.items()},
    }


def _compile_note(c: dict) -> str:
    spent = f", about {c['compile_s']:.3g} s of it compiling" if c["compile_s"] is not None else ""
    limits = "; ".join(f"{k} {v['was']} -> {v['during']}" for k, v in c["recompile_limit"].items())
    return (f"the script compiles its model: {c['graphs']} Dynamo graph(s) compiled for its {c['configurations']} "
            f"configurations during the timed steps, before the counted ones: {c['warm_blocks']} warm blocks "
            f"({c['warm_steps']} steps, {c['warm_s']:.3g} s{spent}; {c['extra_warm_steps']} steps more than an "
            f"uncompiled script's ablation, within --steps); Dynamo's recompile limits raised for the ablation and "
            f"restored after ({limits})")


def _under_compile(frame: pd.DataFrame) -> dict:
    """The patches active under the script's compile (kept) and those that stepped aside for
    compile's own code, each with its measured figure."""
    keys = ("id", "verdict", "measured_saving_ms", "measured_interval_ms", "n", "reason")
    rows = frame.to_dict("records")
    return {"active": [r["id"] for r in rows if r["kept"]],
            "stepped_aside": [{k: r[k] for k in keys} for r in rows if not r["kept"]]}


def _compile_figure(script: str, root) -> tuple[float, str] | None:
    """torch.compile's measured speed-up over eager for this script, from the latest
    `kprof apply --compare` in the store: (speed-up, run name) or None."""
    want = str(Path(script).resolve())
    for path in reversed(store.list_runs(root)):
        f = Path(path) / store.COMPARE
        if not f.is_file():
            continue
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if str(Path(doc.get("script") or "").resolve()) != want:
            continue
        for row in doc.get("variants") or []:
            if row.get("variant") == "compile" and row.get("status") == "ok" and row.get("speedup"):
                return float(row["speedup"]), Path(row.get("run") or path).name
    return None


def code_change(diagnoses: Sequence[dict], prefer: str = "time") -> dict | None:
    """The diagnosis to name as the code change that wins instead: the largest time saving; under
    --prefer memory, else the first memory fix. Not the plan's first entry: on the ~150M Llama
    that was activation checkpointing, which costs step time, named to a user who asked for speed."""
    def saving(d: dict) -> float:
        v = d.get("saving ms/step")
        return float(v) if isinstance(v, (int, float)) and v == v else 0.0

    timed = [d for d in diagnoses if saving(d) > 0]
    if timed:
        return max(timed, key=saving)
    return next((d for d in diagnoses if d.get("class") == "memory"), None) if prefer == "memory" else None


def recommend(res: ApplyResult, plan: dict, script: str, root) -> str:
    """What to do, and what wins when kprof's patches don't."""
    hb = plan.get("host_bound")
    if res.compiled is not None:
        # The ablation itself was kprof + compile against compile: no separate figure to point to.
        aside = [r["id"] for r in res.compiled["stepped_aside"]]
        compile_txt = ("timed under the script's own torch.compile: " +
                       (f"{', '.join(aside)} stepped aside (compile's own code was not slower)" if aside
                        else "every patch beat compile's own code"))
    else:
        comp = _compile_figure(script, root)
        compile_txt = (f"torch.compile measured {comp[0]:.2f}x eager (run {comp[1]})" if comp else
                       f"measure torch.compile against these patches with `kprof apply {script} --compare`")
    diag = code_change(plan.get("diagnoses") or [], res.prefer)
    code = f"; code change: {diag['id']}: {diag.get('change') or diag.get('how')}" if diag else ""
    if res.declined:
        return (f"the patches were not timed ({res.declined}); run `kprof apply {script} --compare` to time eager, "
                "kprof, torch.compile and kprof+compile each in its own process")
    a = res.ablation
    if hb:
        head = (f"the step is host-bound (GPU busy {hb.get('busy %', 0):.0f}%): GPU time saved does not shorten it; "
                'CUDA graphs or torch.compile(mode="reduce-overhead") cut the launch overhead; ')
    else:
        head = ""
    if res.kept:
        b, af = res.before_ms, res.after_ms
        got = f"; step {b:.3g} -> {af:.3g} ms run alone" if b == b and af == af else ""
        losers = " (--keep-losers: not all of them won)" if a is None or set(res.kept) - set(a.kept_rules) else ""
        return (head + f"keep {', '.join(res.kept)}{losers}{got}: `kprof apply {script} --write FILE`; "
                f"{compile_txt}")
    return (head + f"no patch made the step significantly faster here, so none is kept: leave the model as it is; "
            f"{compile_txt}{code}")


def planned(plan: dict, ids: Sequence[str]) -> list[dict]:
    """The plan's entries for `ids`: kernel suggestions, then the diagnoses apply installs."""
    return [s for s in apply_entries(plan) if s["id"] in ids]


def why_not_installed(entry: dict, reports: Sequence) -> str:
    """Why a planned patch has no record on the live model: the live check's own reason (a traced
    candidate's declined note names the structural difference; a skipped rule says why), else
    what was checked where, then the exact source change when the plan has one."""
    from kprof.rules import STEP_RULES

    i = entry["id"]
    declined = [r for rep in reports for r in rep.declined
                if r.rule == i or i in (r.params or {}).get("candidate_for", [])]
    skipped = [why for rep in reports for rid, why in rep.skipped if rid == i]
    if declined:
        why = "; ".join(dict.fromkeys(f"declined at {r.path or '<model>'}: {r.note}" for r in declined))
    elif skipped:
        why = skipped[0]
    elif i == OPTIMIZER_ID:
        why = "no torch.optim optimizer took a step before the timed steps, so none was switched"
    elif i in {r.id for r in STEP_RULES}:
        why = (f"{i} takes the model's root forward, which was replaced first (by a rule earlier in precedence, the "
               f"fused linear + cross-entropy, or by the script's own instance-level forward): `--patch {i}` alone "
               "installs it where the script doesn't")
    else:
        paths = entry.get("paths") or []
        where = ", ".join(paths[:3]) + (f" (+{len(paths) - 3} more)" if len(paths) > 3 else "") if paths else "<model>"
        cls = entry.get("module_class") or "?"
        why = (f"the profile matched {i} on op names at {where} ({cls}), but on the live model no module there passed "
               f"its structural check and probe (rules/engine.py find_matches): its children or parameters are not "
               f"the pattern's, or its output differs from the kernel's on a small input")
    d = entry.get("diff") or {}
    if d.get("unified_diff"):
        why += f"; the exact source change instead: {d.get('command') or d.get('patch_file') or d.get('file')}"
    return why


def _not_installed(ids: Sequence[str], reports: Sequence, plan: dict | None = None) -> list[dict]:
    recs = [r for rep in reports for r in rep.records]
    out = []
    matched = {r.rule for r in recs}
    entries = {s["id"]: s for s in planned(plan or {}, ids)}
    for i in ids:
        if i not in matched:
            out.append({"id": i, "why": why_not_installed(entries.get(i, {"id": i}), reports)})
    by_rule: dict[str, list] = {}
    for r in recs:
        by_rule.setdefault(r.rule, []).append(r)
    for rule, rs in by_rule.items():
        bad = [r for r in rs if r.status == "reverted"]
        if bad and len(bad) == len(rs):
            out.append({"id": rule, "why": f"failed verification: {bad[0].verification.summary()}"})
        elif all(r.status == "pending" for r in rs):
            out.append({"id": rule, "why": "never called before the timed steps, so never verified or timed"})
    return out


def suggestions_frame(plan: dict, ids: Sequence[str], reports: Sequence, abl: "ab.Ablation | None",
                      kept: Sequence[str], declined: str | None) -> pd.DataFrame:
    """One row per planned rule: predicted vs measured saving, the ablation's verdict and why."""
    recs = [r for rep in reports for r in rep.records]
    rows = []
    for s in planned(plan, ids):
        mine = [r for r in recs if r.rule == s["id"]]
        d = abl.decision(s["id"]) if abl is not None else None
        ok = sum(r.status in ("verified", "installed") for r in mine)
        if d is not None:
            reason, verdict = d.reason, d.verdict
            if len(d.group) > 1:
                reason = f"measured with {'+'.join(g for g in d.group if g != s['id'])} (nested): {reason}"
        elif declined:
            verdict, reason = "not measured", declined
        elif not mine:
            verdict, reason = "not installed", why_not_installed(s, reports)
        elif not ok:
            verdict, reason = "not installed", ("failed verification" if any(r.status == "reverted" for r in mine)
                                               else "never called before the timed steps")
        elif abl is None:
            verdict, reason = "not measured", "no ablation ran"
        else:
            verdict, reason = "not measured", ("verified only after the ablation's first timed step, so not timed "
                                               "and not kept")
        is_kept = s["id"] in kept
        if is_kept and verdict != "kept":
            reason = f"kept by --keep-losers; {reason}"
        rows.append({
            "id": s["id"], "where": s.get("where"), "verified": bool(mine) and ok == len(mine),
            "modules": len(mine), "verified modules": ok, "kept": is_kept,
            "predicted_saving_ms": s.get("saving ms/step"),
            "measured_saving_ms": d.saving_ms if d is not None else None,
            "measured_interval_ms": [d.lo_ms, d.hi_ms] if d is not None else None,
            "n": d.n if d is not None else 0, "spread_ms": d.spread_ms if d is not None else None,
            "memory_saving_bytes": d.memory_saving_bytes if d is not None else None,
            "group": list(d.group) if d is not None else [s["id"]], "verdict": verdict, "reason": reason,
        })
    return pd.DataFrame(rows, columns=["id", "where", "verified", "modules", "verified modules", "kept",
                                       "predicted_saving_ms", "measured_saving_ms", "measured_interval_ms", "n",
                                       "spread_ms", "memory_saving_bytes", "group", "verdict", "reason"])


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
    steps: int | None = None,
    prefer: str = "time",
    keep_losers: bool = False,
    seed: int = 0,
) -> ApplyResult:
    """The ablation, then the kept set's profiled run (see the module docstring). `steps`: the
    most timed steps the ablation may take (default: ablation.DEFAULT_BLOCKS blocks + a warm
    one); `prefer`: "time" or "memory"; `keep_losers`: install every verified patch in the after
    run (and --write) whatever the ablation says."""
    from kprof.capture.runner import RunConfig, run_script

    if not Path(script).is_file():
        raise KprofError(f"no such script: {script}")
    if prefer not in PREFER:
        raise KprofError(f"--prefer must be one of {', '.join(PREFER)} (got {prefer!r})", exit_code=2)
    least = ab.steps_needed(1, ab.MIN_BLOCKS)
    if steps is not None and (not isinstance(steps, int) or steps < least):
        raise KprofError(f"--steps bounds the ablation's timed steps and must be at least {least} (got {steps!r}): "
                         f"{ab.MIN_BLOCKS} counted blocks + {ab.WARM_BLOCKS} warm block of 2 configurations, the "
                         f"fewest a 95% sign test can decide with; each more patch group adds "
                         f"{ab.MIN_BLOCKS + ab.WARM_BLOCKS} steps", exit_code=2)
    root = out_root or store.DEFAULT_ROOT
    before = load_run(run, root) if run is not None else store.latest_plain_run(root)
    store.ensure_root(root)  # an unwritable store fails now, not after the ablation run
    store.check_same_script(before, script)
    plan = plan_for(before, rules_dir)
    ids = parse_ids(patch, plan, memory=prefer == "memory")
    check_rules(ids, rules_dir)  # a plan made with --rules DIR needs the same DIR: fail before running the script
    warmup = int(before.summary.get("warmup") or 3)

    def strict_failure(reports) -> KprofError | None:
        failed = [r for rep in reports for r in rep.records if r.status == "reverted"]
        if not (strict and failed):
            return None
        return KprofError("--strict: " + "; ".join(f"{r.rule} at {r.path or '<model>'} failed verification"
                                                   f"{' (' + r.note + ')' if r.note else ''}: "
                                                   f"{r.verification.summary()}" for r in failed)
                          + "; run without --strict to keep the original code for these and go on",
                          exit_code=PATCH_FAILED)

    # 1. The ablation: one unprofiled run, the patch groups switched between timed steps.
    abl = _Ablation(ids, strict=strict, rules_dir=rules_dir, budget=steps, seed=seed, rules=live_rules(ids, plan),
                    find_batch=prefer == "memory")
    # The root's first call already runs its original forward (the patch goes in from inside that
    # call), so the root's patch verifies at the 2nd call: ABLATION_WARMUP steps have every patch
    # verified, and the kernels compiled, before the first timed step.
    ab_warmup = max(warmup, ABLATION_WARMUP)
    try:
        raw = run_script(script, list(argv), RunConfig(
            warmup=ab_warmup, steps=abl.max_steps, on_root_module=abl.on_root, on_step=abl.on_step,
            on_optimizer=abl.on_optimizer if OPTIMIZER_ID in ids else None), progress=progress)
    finally:
        abl.restore()
        for rep in abl.reports:  # RoPE patches a shared module namespace: leave the process as we found it
            rep.unpatch()
        for h in abl.hooks:
            h.remove()
        abl.last_call = None
    err = strict_failure(abl.reports)
    if err is not None:
        raise err
    if raw.status == "error":
        # Whether or not steps were timed, a script that fails is not a result to act on.
        raise KprofError(f"{Path(script).name} failed (exit code {raw.exit_code}) during kprof apply's ablation run "
                         f"(patches switched on and off; not saved): {_last_line(raw.error)}; fix the script (its "
                         f"traceback is above) and run kprof apply again; the planned run {before.name} is unchanged",
                         exit_code=SCRIPT_FAILED, detail=raw.error)
    if raw.status == "interrupted":
        raise KprofError(f"interrupted during kprof apply's ablation run; nothing was saved and the planned run "
                         f"{before.name} is unchanged", exit_code=INTERRUPTED)
    if not abl.roots:
        raise KprofError(f"{script} never called an nn.Module, so there was nothing to patch")
    notes: list[str] = []
    result_ablation = None
    compiled = None
    if abl.plan and abl.declined is None:
        times = list(raw.step_times_ms)
        result_ablation = ab.decide(abl.groups, abl.plan, times, abl.peaks if abl.cuda else None, prefer=prefer,
                                    warm=abl.warm, skip=abl.compiled_steps())
        k = len(ab.configs(abl.groups))
        notes.append(f"ablation: {result_ablation.steps} timed steps ({abl.warm} warm + {abl.blocks} blocks of "
                     f"{k} configurations, {len(abl.groups)} group(s)) after {ab_warmup} warm-up; --steps bounds it")
        if len(times) < len(abl.plan):
            notes.append(f"the script ended after {len(times)} of the ablation's {len(abl.plan)} timed steps: "
                         f"{result_ablation.blocks} complete blocks were judged; run it longer or lower --steps")
        if abl.blocks < ab.MIN_BLOCKS:
            notes.append(f"--steps {steps} fits {abl.blocks} blocks of {k} configurations; deciding needs "
                         f"{ab.MIN_BLOCKS} ({ab.steps_needed(len(abl.groups), ab.MIN_BLOCKS, abl.warm)} steps)")
        if result_ablation.skipped:
            notes.append(f"{len(result_ablation.skipped)} counted step(s) compiled something and were not counted "
                         f"(compile time is not step time): steps {', '.join(map(str, result_ablation.skipped[:10]))}")
        if abl.compiled:
            compiled = _compile_cost(abl, result_ablation, times)
            notes.append(_compile_note(compiled))
    elif abl.declined is None and not any(r.status in ("verified", "installed")
                                          for rep in abl.reports for r in rep.records):
        notes.append("no patch was verified before the timed steps, so none was timed")
    elif abl.declined is None:
        notes.append(f"the script ended before the ablation's first timed step ({ab_warmup} warm-up steps)")

    verified = [i for i in ids if any(r.rule == i and r.status in ("verified", "installed")
                                      for rep in abl.reports for r in rep.records)]
    kept = list(verified) if keep_losers else [i for i in ids if result_ablation is not None
                                                and i in result_ablation.kept_rules]

    # 2. The kept set alone, profiled like the plan's run: after_ms and the loss watch.
    reports = []

    kept_rules = live_rules(kept, plan)

    def on_root(model) -> None:
        reports.append(kpatch(model, rules=kept_rules, strict=strict, rules_dir=rules_dir))

    def on_optimizer(opt) -> None:
        reports.append(patch_optimizer(opt, strict=strict, rule=OPTIMIZER_ID))

    recompiled = [not (abl.compiled and kept_rules)]

    def once_verified(opt, args, kwargs) -> None:
        """A compiled script's optimizer step, until every kept patch is verified: see _recompile_whole."""
        if not recompiled[0] and reports and not any(r.status == "pending" for rep in reports for r in rep.records):
            recompiled[0] = True
            _recompile_whole()

    # removed after the run: torch iterates the global hooks while it calls this one
    recompile = [] if recompiled[0] else [register_optimizer_step_post_hook(once_verified)]
    # The root's patch verifies in the 2nd step, the recompile lands in the 3rd: none in a timed step.
    after_warmup = warmup if recompiled[0] else max(warmup, ABLATION_WARMUP)
    try:
        # Marked as apply's even if it ends partial: later commands must not plan from a patched run.
        after = profile_script(script, list(argv), warmup=after_warmup, steps=int(before.summary.get("steps") or 5),
                               out_root=root, progress=progress, on_root_module=on_root if kept_rules else None,
                               on_optimizer=on_optimizer if OPTIMIZER_ID in kept else None,
                               summary_extra={"apply_of": {"run": before.name, "patches": list(kept)}})
    except KprofError:
        err = strict_failure(reports)  # the gate raised inside the script: say so without its traceback
        if err is not None:
            raise err from None
        raise
    finally:
        for h in recompile:
            h.remove()
        for rep in reports:
            rep.unpatch()
    err = strict_failure(reports)
    if err is not None:
        raise err
    status, n = after.summary.get("status"), after.summary.get("steps_recorded") or 0
    if status in ("error", "interrupted"):
        what = (f"{Path(script).name} failed (exit code {after.summary.get('exit_code')})" if status == "error"
                else "interrupted")
        raise KprofError(f"{what} during kprof apply's after run, after {n} recorded step{'s' if n != 1 else ''}; "
                         f"the partial run {after.name} is kept, marked {status} and as apply's (later commands do "
                         f"not plan from it); nothing was written" + ("; fix the script and run kprof apply again"
                                                                      if status == "error" else ""),
                         exit_code=SCRIPT_FAILED if status == "error" else INTERRUPTED,
                         detail=after.summary.get("error") if status == "error" else None)
    recs = [r for rep in reports for r in rep.records]
    pending = [r for r in recs if r.status == "pending"]
    if pending:
        notes.append(f"{len(pending)} kept patch(es) never ran during the after run's steps (still unverified): "
                     + ", ".join(sorted({r.path for r in pending})[:5]))
    by_note: dict[tuple[str, str], int] = {}
    for r in [r for rep in abl.reports for r in rep.records]:
        if r.note:
            by_note[(r.rule, r.note)] = by_note.get((r.rule, r.note), 0) + 1
    notes += [f"{rule} ({n} module{'s' if n > 1 else ''}): {note}" for (rule, note), n in by_note.items()]

    losses, agree, tol = compare_losses(before, after, reports)
    watch = None
    if kept and before.summary.get("losses") and after.summary.get("losses"):
        # A second unpatched run, like the plan's: how far two runs of the unpatched script drift.
        with tempfile.TemporaryDirectory(prefix="kprof-control-") as td:
            control = run_script(script, list(argv), RunConfig(warmup=warmup, steps=int(before.summary.get("steps") or 5),
                                                               record_shapes=False, trace_dir=td), progress=progress)
        if control.status in ("error", "interrupted") or not control.losses:
            notes.append("the unpatched control run for the loss watch did not finish, so the losses were "
                         "compared with the dtype's tolerance only")
        dts = [d for d in (before.summary.get("loss_dtype"), after.summary.get("loss_dtype")) if d]
        loss_dt = max(dts, key=lambda d: loss_floor(1.0, d)) if dts else None
        ctl = control.losses if control.losses else before.summary["losses"]
        watch = loss_watch(before.summary["losses"], ctl, after.summary["losses"], loss_dt)
    res = ApplyResult(before, after, ids, reports, compare(before, after),
                      suggestions_frame(plan, ids, abl.reports, result_ablation, kept, abl.declined),
                      losses, agree, tol,
                      write_lines(kept, strict, checkpoint_paths(plan)) + (COMPILED_LINES if compiled else "")
                      if kept else "", notes,
                      ablation=result_ablation, declined=abl.declined, ablation_reports=abl.reports, kept=kept,
                      not_installed=_not_installed(ids, abl.reports, plan), prefer=prefer, watch=watch)
    if compiled is not None:
        res.compiled = compiled | _under_compile(res.suggestions)
    if watch is not None and watch["diverged"]:
        res.write_lines = ""  # nothing that diverged is offered for keeping
    b, a = res.before_ms, res.after_ms
    p90 = ((before.summary.get("step_time_ms") or {}).get("p90"))
    if kept and p90 is not None and a == a and a > p90:
        res.notes.append(f"the kept set's run ({a:.3g} ms) is slower than the plan's run's p90 ({p90:.3g} ms; median "
                         f"{b:.3g}): separate processes disagree with the in-process ablation; check with --compare")
    if prefer == "memory" and result_ablation is not None and abl.static:
        import statistics

        pb, pa = before.summary.get("peak_memory_bytes"), after.summary.get("peak_memory_bytes")
        if pb and pa and "max_memory_allocated" in str(after.summary.get("peak_memory_kind")):
            res.batch_headroom = ab.batch_headroom(float(pb), float(pa), statistics.median(abl.static))
    res.peak_memory = {"before": before.summary.get("peak_memory_bytes"),
                       "after": after.summary.get("peak_memory_bytes"),
                       "kind": after.summary.get("peak_memory_kind") or ""}
    if "max_memory_allocated" not in res.peak_memory["kind"]:
        res.notes.append("peak memory before/after is the process's peak RSS on this CPU (weights, Python and "
                         "the whole run included), not device memory; a memory patch's saving is measured on "
                         "the GPU" + ("; --prefer memory keeps a group for its memory only there (per-step "
                                      "peaks), so here the time verdict stands" if prefer == "memory" else ""))
    if prefer == "memory":
        from kprof.patching.batch import CPU_SKIPPED

        on_cuda = abl.cuda or "max_memory_allocated" in res.peak_memory["kind"]
        res.largest_batch = abl.batch if abl.batch is not None else {"skipped": CPU_SKIPPED if not on_cuda else (
            "largest batch: not tried, no patch group was ablated (nothing to compare)")}
        lb = res.largest_batch
        if "skipped" in lb:
            res.notes.append(lb["skipped"])
        else:
            res.notes.append(f"largest batch, tried until out of memory (up to {lb['limit']}): {lb['before']} with "
                             f"every patch off, {lb['after']} with every one on (the script runs {lb['script_batch']})")
    res.recommendation = recommend(res, plan, script, root)
    if watch is not None and watch["diverged"]:
        res.recommendation = (f"leave the model as it is: with {', '.join(kept)} the loss diverged from the unpatched "
                              f"run's at step {watch['step']} (a kernel wrong after its verified calls)")
    _save(res)
    return res


def _save(res: ApplyResult) -> None:
    (Path(res.after.path) / store.APPLY).write_text(json.dumps(res.to_dict(), indent=1, allow_nan=False, default=str))
