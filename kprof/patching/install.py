"""`kprof.patch(model)`: put kprof's fused kernels into a live model, proven on first use.

    import kprof
    report = kprof.patch(model)                       # what `kprof apply` kept for this script
    report = kprof.patch(model, rules="all")          # every built-in rule that matches
    report = kprof.patch(model, rules=["rms_norm", "gated_mlp"], strict=True)
    print(report)                                     # what matched where, and verification results
    report.unpatch()                                  # back to the original forwards

How a patch is installed: an instance-level `forward` on the matched module (or, for RoPE, the
function name in the model class's Python module), built from the module's own children and
Parameters. No module is swapped and no Parameter is created, so `model.parameters()`, optimizer
state and `state_dict()` keys are exactly as before; `unpatch()` deletes the instance attributes.

With `verify=True` (the default) each patch is proven at its first real call: the original and
the patched code run on copies of that call's arguments, forward and backward, and are compared
(kprof/patching/verify.py; in bf16/fp16 both against the original code run in fp32). A patch that fails is reverted on the spot and reported with its measured
error; with `strict=True` the failure raises KprofError instead. Until its first call a patch is
"pending".
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn

from kprof.errors import PATCH_FAILED, KprofError
from kprof.patching.verify import Check, Verification, verify_call

_MISSING = object()
# The plan's id for switching a live optimizer to its fused step (the unfused_optimizer diagnosis);
# `kprof.patch(model, optimizer=...)` records it as "fused_optimizer".
OPTIMIZER_ID = "unfused_optimizer"


@dataclass
class PatchRecord:
    """One matched pattern and what happened to it."""

    rule: str
    path: str
    source: str
    params: dict
    # pending | verified | installed (verify=False) | reverted | removed | declined (a traced
    # candidate whose graph held no pattern: `note` names the structural difference)
    status: str = "pending"
    verification: Verification | None = None
    note: str = ""
    module: bool = True  # a module's forward (False: a function in a Python module, e.g. RoPE's)

    @property
    def ok(self) -> bool:
        return self.status in ("pending", "verified", "installed")


class _Unit:
    """The overrides of one match, their original values, and the first-call gate."""

    def __init__(self, match, record: PatchRecord, *, verify: bool, strict: bool, on_verified=None,
                 add_record=None, decline_record=None):
        self.match, self.record, self.strict, self.on_verified = match, record, strict, on_verified
        self.add_record, self.decline_record = add_record, decline_record
        rule, tgt = match.rule, match.target
        self.siblings: list[PatchRecord] = []  # records of the other rules sharing a traced rewrite
        if match.deferred:
            # Traced rules: what to rewrite is found on the first call's graph (kprof/rules/fx_inline.py).
            self.overrides = []
            self.params = [(n, p) for n, p in tgt.named_parameters() if p.requires_grad]
            self.state = list(tgt.parameters()) + [b for b in tgt.buffers() if b.is_floating_point()]
        elif match.is_module:
            mods = dict(tgt.named_modules())
            self.overrides = [(mods[rel], "forward", fn) for rel, fn in rule.replace(tgt, match.params).items()]
            self.params = [(n, p) for n, p in tgt.named_parameters() if p.requires_grad]
            # What the fp32 truth run of a half-precision unit upcasts (kprof/patching/verify.py).
            self.state = list(tgt.parameters()) + [b for b in tgt.buffers() if b.is_floating_point()]
        else:
            self.overrides = [(tgt, match.attr, rule.replace_fn(getattr(tgt, match.attr), match.params))]
            self.params = []
            self.state = []
        self.entry = (tgt, match.attr)
        self.saved = [(o, a, o.__dict__.get(a, _MISSING)) for o, a, _ in self.overrides]
        if not any((o, a) == self.entry for o, a, _ in self.overrides):
            self.saved.append((tgt, match.attr, tgt.__dict__.get(match.attr, _MISSING)))
        self.busy = False
        self.enabled = True  # see set_enabled
        # After the first call verifies, calls at input shapes not seen yet are verified again
        # (up to MAX_RECHECKS a unit): a kernel can be right at one shape and wrong at another.
        self.watched: Callable | None = None
        self.seen: set = set()
        self.rechecks = 0
        if verify or match.deferred:  # a traced rewrite is never installed unverified
            # Verification runs eagerly even when the first call happens inside a torch.compile'd
            # model (Dynamo would otherwise trace autograd.grad and the RNG forks); once installed,
            # the patched forwards are plain functions over custom ops that Dynamo traces.
            setattr(tgt, match.attr, torch.compiler.disable(self._gate))
            record.status = "pending"
        else:
            self._install()
            record.status = "installed"

    # -- state
    def _install(self, skip_entry: bool = False) -> None:
        for o, a, fn in self.overrides:
            if not (skip_entry and (o, a) == self.entry):
                setattr(o, a, fn)
        if self.watched is not None and not skip_entry:
            setattr(*self.entry, self.watched)

    def _arm_watch(self, args, kwargs) -> None:
        """Put the shape watch on the entry: the patched code runs, and a call at a new input
        shape is verified first (not under torch.compile: there verification ran before
        compiling, and the compiled graph holds the patched code alone)."""
        self.seen = {_signature(args, kwargs)}
        inner = next((fn for o, a, fn in self.overrides if (o, a) == self.entry), None)
        inner = inner or self._original_entry()  # children overrides only: installed around it

        @functools.wraps(inner)  # what the patched forward carries (a traced rewrite's graph_module)
        def watched(*a, **kw):
            if self.busy or self.watched is None or torch.compiler.is_compiling():
                return inner(*a, **kw)
            sig = _signature(a, kw)
            if sig in self.seen:
                return inner(*a, **kw)
            self.seen.add(sig)
            self.rechecks += 1
            if self.rechecks >= MAX_RECHECKS:  # enough shapes seen: the patched code alone from now
                self.watched = None
                setattr(*self.entry, inner)
            return self._recheck(sig, a, kw)

        self.watched = watched

    def _recheck(self, sig, args, kwargs):
        self.busy = True
        self._restore()
        try:
            v = verify_call(self._original_entry(), self._patched_entry(), args, kwargs,
                            [p for _, p in self.params], select=self.match.rule.outputs,
                            param_names=[n for n, _ in self.params], state=self.state)
            self._rule_check(v, args, kwargs)
        except BaseException:
            self._install()
            raise
        finally:
            self.busy = False
        if v.ok:
            self._install()
        else:
            self.watched = None
            shapes = ", ".join(str(list(x[0])) for x in sig if isinstance(x, tuple) and len(x) == 2
                               and isinstance(x[1], torch.dtype))
            self._fail(v, f"verified at its first call, wrong at a new input shape ({shapes or '?'})")
        tgt, attr = self.entry
        return getattr(tgt, attr)(*args, **kwargs)

    def _rule_check(self, v: Verification, args, kwargs) -> None:
        """The rule's own check beside outputs and grads (Rule.check), added to `v`. Runs while
        `busy`, so the module's calls inside it take the original code."""
        check = self.match.rule.check
        if check is None or not v.ok or not self.match.is_module:
            return
        got = check(self.match.target, self.match.params, args, kwargs)
        if got is None:
            return
        ok, what = got
        v.checks.append(Check(f"{self.record.rule}: {what}", "exact", 0.0 if ok else 1.0, 0.0, ok))
        v.ok = v.ok and ok

    def _fail(self, v: Verification, note: str = "") -> None:
        """Reverted (the original code restored by the caller) and reported; fatal under strict."""
        self.record.status, self.record.verification = "reverted", v
        if note:
            self.record.note = note
        for sib in self.siblings:
            sib.status, sib.verification = "reverted", v
        msg = (f"kprof patch {self.record.rule} at {self.record.path or '<model>'} failed verification"
               f"{' (' + note + ')' if note else ''}: {v.summary()}")
        if self.strict:
            raise KprofError(msg + "; drop --strict to keep the original code for this module and go on",
                             exit_code=PATCH_FAILED)
        warnings.warn(msg + "; reverted to the original code", stacklevel=3)

    def _restore(self) -> None:
        for o, a, old in reversed(self.saved):
            if old is _MISSING:
                o.__dict__.pop(a, None)
            else:
                setattr(o, a, old)

    def _original_entry(self) -> Callable:
        tgt, attr = self.entry
        old = next(old for o, a, old in self.saved if (o, a) == self.entry)
        if old is not _MISSING:
            return old
        return type(tgt).forward.__get__(tgt)  # the class's forward, bound

    def _patched_entry(self) -> Callable:
        entry_fn = next((fn for o, a, fn in self.overrides if (o, a) == self.entry), None)
        original = self._original_entry()

        def call(*args, **kwargs):
            # Children overrides (e.g. Linear -> bias_gelu, act -> identity) live only during the call.
            self._install(skip_entry=True)
            try:
                return (entry_fn or original)(*args, **kwargs)
            finally:
                for o, a, old in self.saved:
                    if (o, a) != self.entry:
                        if old is _MISSING:
                            o.__dict__.pop(a, None)
                        else:
                            setattr(o, a, old)

        return call

    def _gate(self, *args, **kwargs):
        if self.busy:  # re-entered from inside our own verification
            return self._original_entry()(*args, **kwargs)
        self.busy = True
        if self.match.deferred and not self.overrides:
            try:
                declined = self._resolve(args, kwargs)
            finally:
                self.busy = False
            if declined is not None:
                self._restore()
                self.record.status, self.record.note = "declined", declined
                if self.decline_record is not None:
                    self.decline_record(self.record)
                if self.on_verified is not None:
                    self.on_verified(self.record)
                return self._original_entry()(*args, **kwargs)
            self.busy = True
        try:
            v = verify_call(self._original_entry(), self._patched_entry(), args, kwargs,
                            [p for _, p in self.params], select=self.match.rule.outputs,
                            param_names=[n for n, _ in self.params], state=self.state)
            self._rule_check(v, args, kwargs)
        finally:
            self.busy = False
        self.record.verification = v
        if v.ok:
            self._restore()
            self._arm_watch(args, kwargs)
            self._install()
            self.record.status = "verified"
            for sib in self.siblings:
                sib.status, sib.verification = self.record.status, v
        else:
            self._restore()
            self._fail(v)
        if self.on_verified is not None:
            self.on_verified(self.record)
        tgt, attr = self.entry
        return getattr(tgt, attr)(*args, **kwargs)

    def set_enabled(self, on: bool) -> None:
        """Switch an installed patch off (the original code runs) or back on, without
        unpatching: a few setattr calls (kprof apply's ablation does this between steps). Only
        for verified or installed patches; a pending one keeps its first-call gate."""
        if on == self.enabled or self.record.status not in ("verified", "installed"):
            return
        if on:
            self._install()
        else:
            self._restore()
        self.enabled = on

    def _resolve(self, args, kwargs) -> str | None:
        """Trace the target on this call and build its rewrite; the reason when nothing fits."""
        from kprof.rules.fx_inline import Declined, resolve

        tgt = self.match.target
        try:
            fwd, sites, declined = resolve(tgt, self.match.params, args, kwargs)
        except Declined as e:
            return str(e)
        self.overrides = [(tgt, "forward", fwd)]
        ids = list(dict.fromkeys(s.rule for s in sites))
        for i, rid in enumerate(ids):
            rec = self.record if i == 0 else PatchRecord(rid, self.record.path, self.record.source, {})
            rec.rule = rid
            rec.params = {"sites": [s.what for s in sites if s.rule == rid]}
            if i:
                self.siblings.append(rec)
                if self.add_record is not None:
                    self.add_record(rec)
        if declined:
            self.record.note = "; ".join(declined)
        return None

    def remove(self) -> None:
        self._restore()
        if self.record.status in ("pending", "installed"):
            self.record.status = "removed"  # verified / reverted stay: they are results


MAX_RECHECKS = 4  # new input shapes verified per patched unit after its first call


def _signature(args, kwargs) -> tuple:
    """The shapes and dtypes of a call's tensor arguments (one level into tuples and lists)."""
    def one(a):
        if isinstance(a, torch.Tensor):
            return (tuple(a.shape), a.dtype)
        if isinstance(a, (tuple, list)):
            return tuple(one(x) for x in a)
        return None

    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))


@dataclass
class PatchReport:
    """What `kprof.patch` matched and did. `unpatch()` restores every original forward."""

    records: list[PatchRecord] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (rule id, why it could not apply)
    # Traced candidates whose first call's graph held no pattern (moved out of `records`); each
    # note names the structural difference or why the forward could not be traced.
    declined: list[PatchRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # how the rules were chosen
    _units: list[_Unit] = field(default_factory=list, repr=False)
    _optimizers: list = field(default_factory=list, repr=False)  # kprof.rules.optimizer.OptimizerPatch
    active: bool = True  # False after unpatch()

    def enable_only(self, rules: Iterable[str]) -> None:
        """Leave on the installed patches of `rules` and switch the others off (the original
        code runs), without unpatching; `enable_only(all ids)` switches them all back on."""
        keep = set(rules)
        for u in self._units:
            u.set_enabled(u.record.rule in keep)
        for o in self._optimizers:
            o.set_enabled(o.rule in keep)

    @contextlib.contextmanager
    def quiet(self):
        """No verification while held: calls at new shapes run the installed code without a
        re-check (the batch search's trials, whose large shapes would each be verified, at twice
        the memory, and spend the units' re-checks)."""
        was = [u.busy for u in self._units]
        for u in self._units:
            u.busy = True
        try:
            yield
        finally:
            for u, b in zip(self._units, was):
                u.busy = b

    def toggle_sets(self) -> list[tuple[str, ...]]:
        """The rule ids that `enable_only` switches together, one tuple per installed unit whose
        patch can be switched (verified or installed): a traced rewrite carries several rules."""
        return [tuple(dict.fromkeys([u.record.rule] + [s.rule for s in u.siblings])) for u in self._units
                if u.record.status in ("verified", "installed")] + [(o.rule,) for o in self._optimizers if o.mode]

    def decline(self, rec: PatchRecord) -> None:
        if rec in self.records:
            self.records.remove(rec)
        self.declined.append(rec)

    def unpatch(self) -> None:
        for o in self._optimizers:
            o.unpatch()
        self._optimizers.clear()
        for u in reversed(self._units):
            u.remove()
        self._units.clear()
        self.active = False

    @property
    def failed(self) -> list[PatchRecord]:
        return [r for r in self.records if r.status == "reverted"]

    @property
    def pending(self) -> list[PatchRecord]:
        return [r for r in self.records if r.status == "pending"]

    def by_rule(self) -> dict[str, list[PatchRecord]]:
        out: dict[str, list[PatchRecord]] = {}
        for r in self.records:
            out.setdefault(r.rule, []).append(r)
        return out

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame([
            {"rule": r.rule, "path": r.path, "status": r.status, "source": r.source,
             "verification": r.verification.summary() if r.verification else "", "note": r.note}
            for r in self.records
        ], columns=["rule", "path", "status", "source", "verification", "note"])

    def __str__(self) -> str:
        lines = [f"kprof.patch: {len(self.records)} patch(es)"] + [f"  {n}" for n in self.notes]
        for r in self.records:
            v = f"  [{r.verification.summary()}]" if r.verification else ""
            lines.append(f"  {r.rule:22s} {r.path or '<model>':40s} {r.status}{v}{'  ' + r.note if r.note else ''}")
        for rid, why in self.skipped:
            lines.append(f"  {rid:22s} skipped: {why}")
        for r in self.declined:
            lines.append(f"  {r.path or '<model>'}: declined: {r.note}")
        return "\n".join(lines)


def resolve_rules(rules: str | Sequence[Any] | None = None, rules_dir: str | None = None):
    """`None`/"all" -> every speed rule (user rules first; memory rules only by id); ids and/or Rule objects -> those, in
    precedence order (Rule objects given directly go first)."""
    from kprof.rules import MEMORY_RULES, STEP_RULES, all_rules
    from kprof.rules.engine import Rule, select

    pool = all_rules(rules_dir)
    if rules is None or rules == "all":
        return pool
    pool = pool + MEMORY_RULES + STEP_RULES  # named by id only (kprof/rules/__init__.py)
    if isinstance(rules, str):
        rules = [r.strip() for r in rules.split(",") if r.strip()]
    given = [r for r in rules if isinstance(r, Rule)]
    ids = [r for r in rules if isinstance(r, str)]
    bad = [r for r in rules if not isinstance(r, (Rule, str))]
    if bad:
        raise KprofError(f"rules must be rule ids or kprof.rules.Rule objects, got {bad!r}")
    return given + (select(pool, ids) if ids else [])


def _default_rules() -> tuple[list[str] | str, str]:
    """What `kprof.patch(model)` installs without `rules`: the kept set of the newest apply of
    the running script (sys.argv[0]) in the default run store, else every rule."""
    import sys

    from kprof import store

    script = sys.argv[0] if sys.argv and sys.argv[0] else ""
    found = store.latest_kept(script) if script and os.path.isfile(script) else None
    if found is None:
        return "all", ("every rule: no `kprof apply` of this script in .kprof/runs (run it to keep only the "
                       "patches that make the step faster)")
    run, kept = found
    return kept, (f"the rules kprof apply kept ({run}): {', '.join(kept) or 'none'}; rules='all' installs every rule")


def patch(
    model: nn.Module,
    rules: str | Sequence[Any] | None = None,
    *,
    verify: bool = True,
    strict: bool = False,
    rules_dir: str | None = None,
    on_verified: Callable[[PatchRecord], None] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> PatchReport:
    """Match `rules` on `model` and install the patches (see the module docstring).

    `rules=None` (the default): the rules that the newest `kprof apply` of the running script
    kept (apply.json under .kprof/runs), so a script never installs what its ablation found
    slower; every rule when the script was never applied. `rules="all"`: every rule.

    `optimizer`: a torch.optim.Adam/AdamW/SGD stepping per parameter or per list is switched to
    its fused step (foreach where fused can't run) in place, state and hyperparameters kept,
    after one step on copies proved the same (kprof/rules/optimizer.py); recorded as rule
    "fused_optimizer" at path "<optimizer>"."""
    from kprof.kernels.common import interpreter_enabled
    from kprof.rules.engine import find_matches, kernel_spec

    if not isinstance(model, nn.Module):
        raise KprofError(f"kprof.patch needs an nn.Module, got {type(model).__name__}")
    notes = []
    if rules is None:
        rules, note = _default_rules()
        notes.append(note)
    chosen = resolve_rules(rules, rules_dir)
    report = PatchReport(notes=notes)
    for r in chosen:
        if not r.applyable and (r.missing_kernels() or rules not in (None, "all")):
            why = (f"kernel(s) {', '.join(r.missing_kernels())} not in this kprof install" if r.missing_kernels()
                   else f"apply can't do this one; code change: {r.code_change}")
            report.skipped.append((r.id, why))
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    for m in find_matches(model, chosen):
        params = {"candidate_for": [r.id for r in m.params["traced"]]} if m.deferred else dict(m.params)
        rec = PatchRecord(m.rule.id, m.path, m.source, params, module=m.is_module)
        if m.deferred and "untraceable" in m.params:  # said per module; nothing installed
            rec.status, rec.note = "declined", m.params["untraceable"]
            report.declined.append(rec)
            continue
        if "declined" in m.params:  # recognised, but the rule can't patch it exactly (rules/moe_fused.py)
            rec.status, rec.note = "declined", m.params["declined"]
            report.declined.append(rec)
            continue
        if on_cpu and not interpreter_enabled() and m.rule.kernels:
            cuda_only = [k for k in m.rule.kernels if (s := kernel_spec(k)) is not None and s.cuda_only]
            rec.note = ("CPU without the Triton interpreter: the kernel runs its PyTorch reference"
                        + (f" ({', '.join(cuda_only)} is CUDA-only)" if cuda_only else ""))
        report._units.append(_Unit(m, rec, verify=verify, strict=strict, on_verified=on_verified,
                                   add_record=report.records.append, decline_record=report.decline))
        report.records.append(rec)
    if optimizer is not None:
        _patch_optimizer(report, optimizer, strict)
    return report


def patch_optimizer(opt, *, strict: bool = False, rule: str = OPTIMIZER_ID) -> PatchReport:
    """A report holding only the switch of `opt` to its fused (else foreach) step, proven on one
    step (kprof/rules/optimizer.py); recorded as `rule` at "<optimizer>"."""
    report = PatchReport()
    _patch_optimizer(report, opt, strict, rule)
    return report


def _patch_optimizer(report: PatchReport, opt, strict: bool, rule: str = "fused_optimizer") -> None:
    from kprof.rules import optimizer as optim_rule

    rec = PatchRecord(rule, "<optimizer>", type(opt).__module__ + "." + type(opt).__name__, {}, module=False)
    try:
        done = optim_rule.install(opt, rule)
    except KprofError as e:
        if strict:
            raise
        rec.status, rec.note = "reverted", str(e)
        report.records.append(rec)
        return
    rec.params = {"mode": done.mode}
    if not done.mode:
        rec.status, rec.note = "declined", done.reason
        report.declined.append(rec)
        return
    rec.status, rec.note = "verified", f"{done.mode}: {done.reason}; one step on copies agrees"
    report.records.append(rec)
    report._optimizers.append(done)


def ids_of(records: Iterable[PatchRecord]) -> list[str]:
    return sorted({r.rule for r in records})


def check_rules(ids: Sequence[str], rules_dir: str | None) -> None:
    """The plan's rule ids exist here (a plan made with --rules DIR needs the same DIR)."""
    try:
        resolve_rules([i for i in ids if i != OPTIMIZER_ID], rules_dir)
    except KprofError as e:
        raise KprofError(f"{e}; if the plan was made with --rules DIR, pass the same --rules DIR to apply") from None
