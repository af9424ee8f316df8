"""The child process of `kprof apply --compare`: runs the script as one variant (eager, kprof,
compile, kprof+compile) and writes its result for the parent (kprof.patching.compare)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from kprof import store
from kprof.errors import KprofError



_SLUG = {"eager": "eager", "kprof": "kprof", "compile": "compile", "kprof+compile": "kprof_compile"}


class _VariantRoot:
    """The variant's changes to one root module (see the module docstring), installed as the
    instance's `forward` at the root's first call, which itself runs as written.

    Second call: kprof variants patch the root now (`kprof.patch`) and run this call eagerly, so
    every patch, the root's own included, verifies itself on it; the kprof variant then steps
    aside (the model runs patched, as `kprof.patch` leaves it). Compile variants compile the
    current forward at their first call after that. The step where the variant's code first ran
    in full is `active_step`: everything before it ran as in the eager variant."""

    def __init__(self, model, *, patch_fn=None, compile_mode: str | None = None, step_now=None):
        self.model, self.patch_fn, self.mode = model, patch_fn, compile_mode
        self.step_now = step_now or (lambda: None)
        self.report = None
        self.compiled = None
        self.calls = 0
        self.busy = False
        self.aside = False
        self.active_step: int | None = None

        def entry(*args, **kwargs):
            return self._call(args, kwargs)

        self.entry = entry
        self.inner = self._current()
        model.forward = entry

    def _current(self):
        cur = self.model.__dict__.get("forward")
        return cur if cur is not None and cur is not self.entry else type(self.model).forward.__get__(self.model)

    def resync(self, *_: Any) -> None:
        """A patch of the root's own forward replaced the instance `forward` (installed, verified
        or reverted): wrap the new one."""
        if not self.aside and self.model.__dict__.get("forward") is not self.entry:
            self.inner = self._current()
            self.compiled = None
            self.model.forward = self.entry

    def _unwrap(self) -> None:
        """Put the wrapped forward back where it was (the class's, or an instance attribute)."""
        if self.model.__dict__.get("forward") is self.entry:
            if getattr(self.inner, "__self__", None) is self.model and getattr(self.inner, "__func__", None) is type(self.model).forward:
                del self.model.__dict__["forward"]
            else:
                self.model.forward = self.inner

    def _step_aside(self) -> None:
        self.aside = True
        self._unwrap()  # the model runs as kprof.patch left it

    def _call(self, args, kwargs):
        if self.busy:  # re-entered (a patch's verification, a gate's own call): as it is now
            return self.inner(*args, **kwargs)
        self.calls += 1
        if self.calls == 1 and self.patch_fn is not None:
            self._unwrap()  # the rules match the model as written, not this wrapper
            self.report = self.patch_fn(self.model, self.resync)
            self.resync()
            self.busy = True
            try:
                return self.inner(*args, **kwargs)  # eager: the patches verify on these inputs
            finally:
                self.busy = False
                if self.mode is None:
                    self.active_step = self.step_now()
                    self._step_aside()
        if self.mode is None:
            return self.inner(*args, **kwargs)
        if self.compiled is None:
            import torch

            self.compiled = torch.compile(self.inner, mode=self.mode)
            if self.active_step is None:
                self.active_step = self.step_now()
        return self.compiled(*args, **kwargs)


def _reason(key) -> str:
    """A graph-break reason from Dynamo's counters, in one line: its title and explanation."""
    lines = [ln.strip() for ln in str(key).strip().splitlines() if ln.strip()]
    expl = next((ln[len("Explanation:"):].strip() for ln in lines if ln.startswith("Explanation:")), "")
    out = lines[0] if lines else "?"
    return f"{out}: {expl}" if expl else out


def _dynamo_stats() -> dict:
    if "torch._dynamo" not in sys.modules:
        return {"graphs": 0, "graph_breaks": 0, "break_reasons": []}
    try:
        from torch._dynamo.utils import counters

        breaks = counters["graph_break"]
        reasons = sorted(breaks.items(), key=lambda kv: -kv[1])
        return {"graphs": int(counters["stats"]["unique_graphs"]), "graph_breaks": int(sum(breaks.values())),
                "break_reasons": [f"{n} x {_reason(k)}" for k, n in reasons[:5]]}
    except Exception as e:  # Dynamo's internals moved
        return {"graphs": None, "graph_breaks": None, "break_reasons": [f"counters unavailable: {e!r}"]}


class _StepClock:
    """The index (into the run's losses) of the step a forward call belongs to, from the runner's
    progress events: after boundary e, step e+1 in optimizer mode (boundary 0 ends step 0), step e
    in forward mode (boundary e is the call that starts step e); None before forward steps were
    decided (those calls are no step)."""

    def __init__(self):
        self.mode, self.e = "pending", -1
        self.timing_start: float | None = None

    def __call__(self, event: str, **info) -> None:
        if event == "mode":
            self.mode = "optimizer" if str(info.get("step_definition", "")).startswith("optimizer") else "forward"
            self.e = -1
        elif event == "step":
            self.e = int(info.get("step", self.e))
            # The last "timing starts" boundary (a switch of step definition restarts the schedule).
            if info.get("phase") == "timing" and info.get("index") == 0:
                self.timing_start = time.perf_counter()

    def now(self) -> int | None:
        if self.mode == "forward":
            return self.e if self.e >= 0 else None
        return self.e + 1


def _run_child(spec: dict, out: dict) -> None:
    from kprof.analyze.profile import profile_script
    from kprof.patching.install import patch as kpatch

    v = spec["variant"]
    use_kprof, use_compile = "kprof" in v, "compile" in v
    roots: list[_VariantRoot] = []
    no_params: set[str] = set()
    clock = _StepClock()
    t: dict[str, float] = {}

    def patch_fn(model, on_verified):
        return kpatch(model, rules=spec["patch_ids"], strict=spec["strict"], rules_dir=spec["rules_dir"],
                      on_verified=on_verified)

    def on_root(model) -> None:
        t.setdefault("first_call", time.perf_counter())
        if v == "eager":
            return
        if use_compile and not any(True for _ in model.parameters()):
            no_params.add(type(model).__name__)
            if not use_kprof:
                return
        roots.append(_VariantRoot(model, patch_fn=patch_fn if use_kprof else None,
                                  compile_mode=spec["compile_mode"] if use_compile and type(model).__name__ not in no_params
                                  else None, step_now=clock.now))

    root = Path(spec["out_root"])
    try:
        # Compile variants run without kprof's sync detector (a torch function mode that Dynamo
        # would trace into): torch.compile sees the script as the user's own compile does.
        run = profile_script(spec["script"], spec["argv"], warmup=spec["warmup"], steps=spec["steps"],
                             out_root=root, progress=clock, on_root_module=on_root, detect_syncs=not use_compile)
    finally:
        reports = [r.report for r in roots if r.report is not None]
        recs = [rec for rep in reports for rec in rep.records]
        out["patches"] = [{"rule": r.rule, "path": r.path, "status": r.status,
                           "verification": r.verification.summary() if r.verification else None,
                           "dtype": str(r.verification.dtype).replace("torch.", "") if r.verification else None,
                           "note": r.note} for r in recs]
        notes = out.setdefault("notes", [])
        if v == "eager":
            out["active_step"] = 0
        elif roots:
            steps_ = [r.active_step for r in roots]
            out["active_step"] = None if any(s is None for s in steps_) else max(steps_)
        if use_kprof:
            matched = {r.rule for r in recs}
            notes += [f"{i}: planned but not matched on the live model; left unpatched"
                      for i in spec["patch_ids"] if i not in matched]
            notes += sorted({f"{rid}: {why}" for rep in reports for rid, why in rep.skipped})
            by_note: dict[str, list[str]] = {}
            for r in recs:
                if r.note and r.rule not in by_note.setdefault(r.note, []):
                    by_note[r.note].append(r.rule)
            notes += [f"{', '.join(rules)}: {note}" for note, rules in by_note.items()]
            pending = sorted({r.path or "<model>" for r in recs if r.status == "pending"})
            if pending:
                notes.append(f"{len(pending)} patched module(s) never called (unverified): {', '.join(pending[:5])}")
            if not reports:
                notes.append("nothing was patched: no root module was called a second time (the first call "
                             "runs as written)")
        if use_compile:
            compiled = [r for r in roots if r.mode is not None]
            out["compile"] = {"mode": spec["compile_mode"], **_dynamo_stats(),
                              "roots": sorted({type(r.model).__name__ for r in compiled if r.compiled is not None})}
            if no_params:
                notes.append(f"not compiled (no parameters): {', '.join(sorted(no_params))}")
            if not out["compile"]["roots"]:
                notes.append("nothing was compiled: no root module with parameters was called twice")
        elif _dynamo_stats()["graphs"]:
            notes.append("the script runs torch.compile itself: this variant is compiled too")
        if "first_call" in t and clock.timing_start is not None:
            out["warmup_s"] = clock.timing_start - t["first_call"]
    # Name the run after its variant, so `kprof runs` tells them apart.
    final = store.rename_free(Path(run.path), root, f"{run.name}-{_SLUG[v]}")
    out["run"] = str(final)


def child_main(spec_path: str) -> int:
    """Entry point of a variant's subprocess: run it, write the result JSON, exit 0 (failures are
    results; the parent reads them)."""
    with open(spec_path) as f:
        spec = json.load(f)
    out: dict[str, Any] = {"variant": spec["variant"], "run": None, "error": None}
    try:
        _run_child(spec, out)
    except KprofError as e:
        out["error"] = (e.detail.rstrip() + "\n" if e.detail else "") + str(e)  # the traceback, then the line
    except BaseException as e:  # noqa: BLE001 - anything: the row reports it
        out["error"] = "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip()
        if isinstance(e, KeyboardInterrupt):
            out["error"] = "interrupted"
    finally:
        tmp = spec["result"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, default=str)
        os.replace(tmp, spec["result"])
    return 0
