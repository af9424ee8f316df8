"""`kprof apply SCRIPT --compare`: is a custom kernel worth it here? Library side; kprof/cli/patch_cmds.py
renders.

The script runs, unmodified, in up to four variants, each profiled and saved as a normal run:

    eager           the script as it is
    kprof           the plan's patches (like `kprof apply --patch all`), verified on first use
    compile         each root module's forward wrapped in torch.compile, from the root's hook
    kprof+compile   both: the patches first, compiled once they have verified themselves

and one table compares them: step time (median, p10-p90), speed-up over eager, peak memory,
warm-up time (the untimed steps before timing: compilation lands there) against eager's, the
loss of each variant's first step under its own code against eager's at that step, and a
verdict: the fastest variant whose loss agrees with eager's, or the simpler one (SIMPLICITY) when
the difference is within the noise (their p10-p90 step-time ranges overlap).

Why one subprocess per variant, not one process for all:
* Peak memory per variant. On a CPU the run's peak is the process's peak RSS, which only grows
  over a process's life: in one process every variant after the first would report the largest
  so far. On a GPU `torch.cuda.reset_peak_memory_stats` (the runner calls it before the recorded
  steps) would do, but the caching allocator still holds what earlier variants left behind.
* Isolation. A variant that dies (compile error, a kernel's illegal memory access, which leaves
  the CUDA context unusable, an OOM, a segfault) costs only its own row: the others still run
  and the partial comparison is saved. kprof's RoPE patch edits a module namespace and Dynamo
  keeps process-wide caches and counters (recompile limits, graph-break counts); a fresh process
  starts each variant from the same state, as a user's own `python train.py` would.
* Comparable warm-up. In one process the later variants would find the script's imports, the
  Triton kernels and Inductor's kernels already loaded. Each subprocess pays the same start-up
  (importing torch again, a few seconds), outside the timed steps and outside the warm-up time,
  which starts at the first module call. On-disk caches (Inductor's FX graph cache, Triton's
  kernel cache) persist across processes, as they do across a user's runs.

How a variant changes the model: the runner calls `on_root_module` at each root module's first
call, after torch has looked up that call's `forward`, so the first call runs as written whatever
the hook installs. The hook puts a wrapper (`_VariantRoot`) in the root's `forward` that acts from
the second call on:
* kprof: `kprof.patch(root, rules=plan ids)` at the second call, which runs eagerly so every patch,
  the root's own forward included (fused linear + cross-entropy), verifies itself on it; then the
  wrapper steps aside and the model runs patched, as `kprof.patch` leaves it.
* compile: `torch.compile(forward, mode=--compile-mode)` at the second call. Roots without
  parameters (loss modules) are left eager.
* kprof+compile: patched and verified at the second call (eagerly: verification runs both
  versions forward and backward and reads results back, which must not be traced), compiled from
  the third. The compiled graph then holds the patched forwards, whose kernels are torch.library
  custom ops; graph breaks are counted and shown.
So every variant's first step is the script's own (same weights after it as eager's), and the
loss compared with eager's is the one of the first step run wholly with the variant's code, at
the same step of eager's run: step 1 (step 2 for kprof+compile, whose weights also carry one
patched step's rounding). The compile variants need 3 warm-up steps (as written, verification,
compilation); fewer are raised to 3 for all variants, so warm-up times compare like with like.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from kprof import store
from kprof.errors import SCRIPT_FAILED, KprofError

VARIANTS = ("eager", "kprof", "compile", "kprof+compile")
# The verdict's tie-break when the difference is within the noise: stock PyTorch before kprof's
# kernels (no extra dependency), one change before two.
SIMPLICITY = ("eager", "compile", "kprof", "kprof+compile")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
MIN_COMPILE_WARMUP = 3  # eager first call, patch verification, compilation (module docstring)
_KEEP_LOSSES = 10


@dataclass
class VariantResult:
    variant: str
    status: str  # "ok" | "failed" | "skipped"
    run: str | None = None  # run directory
    error: str | None = None  # failed / skipped: why
    step_time_ms: dict | None = None  # median, p10, p90, spread, n (unprofiled timed steps)
    speedup: float | None = None  # eager median / this median
    peak_memory_bytes: int | None = None
    peak_memory_kind: str = ""
    warmup_s: float | None = None  # first module call -> start of the timed steps
    warmup_steps: int | None = None
    losses: list = field(default_factory=list)  # the first steps' losses (index = step)
    loss_step: int | None = None  # the first step run wholly with the variant's code (eager: 0)
    first_loss: float | None = None  # the loss at loss_step
    loss_rel_diff: float | None = None  # vs eager's loss at the same step
    loss_agree: bool | None = None  # None: not comparable (no losses, or no eager)
    loss_rtol: float | None = None
    patches: list[dict] = field(default_factory=list)  # rule, path, status, verification
    compile: dict | None = None  # mode, compiled roots, graphs, graph breaks, reasons
    notes: list[str] = field(default_factory=list)
    wall_s: float | None = None
    device: dict = field(default_factory=dict, repr=False)  # the run's; CompareResult.device keeps one

    @property
    def ok(self) -> bool:
        return self.status == "ok" and _finite((self.step_time_ms or {}).get("median"))


@dataclass
class CompareResult:
    script: str
    argv: list[str]
    variants: list[VariantResult]
    compile_mode: str
    warmup: int
    steps: int
    device: dict = field(default_factory=dict)
    plan_run: str | None = None  # the run whose plan the kprof variants applied
    patch_ids: list[str] = field(default_factory=list)
    verdict: str = ""
    choice: str | None = None  # the variant the verdict recommends
    notes: list[str] = field(default_factory=list)
    saved: list[str] = field(default_factory=list)  # compare.json paths

    @property
    def cpu(self) -> bool:
        return self.device.get("type") == "cpu"

    def row(self, variant: str) -> VariantResult | None:
        return next((v for v in self.variants if v.variant == variant), None)

    @classmethod
    def from_dict(cls, doc: dict) -> "CompareResult":
        """The inverse of to_dict (compare.json), for `kprof report` on a variant's run."""
        from dataclasses import fields

        vnames = {f.name for f in fields(VariantResult)}
        variants = [VariantResult(**{k: v for k, v in row.items() if k in vnames}) for row in doc.get("variants", [])]
        cnames = {f.name for f in fields(cls)} - {"variants", "saved"}
        return cls(variants=variants, **{k: v for k, v in doc.items() if k in cnames})

    def to_dict(self) -> dict:
        from kprof.store import jsonable

        doc = {k: v for k, v in asdict(self).items() if k != "saved"}
        for row in doc["variants"]:
            row.pop("device", None)
        doc["cpu"] = self.cpu
        doc["runs"] = {v.variant: Path(v.run).name for v in self.variants if v.run}
        doc["step_time_kind"] = ("CPU wall time per step (no GPU in this run)" if self.cpu
                                 else "GPU time per step (CUDA events at step boundaries)")
        return jsonable(doc)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def parse_variants(spec: str | Sequence[str] | None) -> list[str]:
    """'eager,kprof,compile,kprof+compile' (any subset, any order) -> the variants, in the table's
    order. Unknown names are a KprofError naming the valid ones."""
    if spec is None:
        return list(VARIANTS)
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [s.strip().lower().replace(" ", "") for s in items if s.strip()]
    if not names:
        raise KprofError(f"--variants needs at least one of: {', '.join(VARIANTS)} (comma-separated)", exit_code=2)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        hint = ""
        if any(n in ("compile+kprof", "kprof_compile", "kprof-compile", "both") for n in unknown):
            hint = " (patches and torch.compile together is 'kprof+compile')"
        raise KprofError(f"unknown variant{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} in "
                         f"--variants; choose from {', '.join(VARIANTS)} (comma-separated){hint}", exit_code=2)
    return [v for v in VARIANTS if v in names]


def check_compile_mode(mode: str) -> str:
    if mode not in COMPILE_MODES:
        raise KprofError(f"unknown --compile-mode {mode!r}; torch.compile's modes are: {', '.join(COMPILE_MODES)}",
                         exit_code=2)
    return mode


# --------------------------------------------------------------------------------------------
# Which plan the kprof variants apply


def _plan_run(script: str, run: str | None, root) -> object | None:
    """The run whose plan to apply: --run, else the latest plain run of this script, else None
    (then the eager variant's own run is planned once it has run)."""

    if run is not None:
        r = store.load_run(run, root)
        store.check_same_script(r, script)
        return r
    want = Path(script).resolve()
    for p in reversed(store.list_runs(root)):
        try:
            s = store.load_summary(p)
        except KprofError:
            continue
        if s.get("script") and Path(s["script"]).resolve() == want and store.is_plain_run(p):
            return store.Run(path=p, summary=s)
    return None


def _ids_for(before, patch: str, rules_dir: str | None) -> tuple[list[str], str | None]:
    """(patch ids, None), or ([], why the kprof variants are skipped) when `patch` is the default
    'all' and the plan has nothing to apply. Explicit ids that don't fit raise."""
    from kprof.plan.suggest import parse_ids, plan_for

    plan = plan_for(before, rules_dir)
    try:
        ids = parse_ids(patch, plan)
    except KprofError as e:
        if patch.strip() != "all":
            raise
        return [], f"nothing to patch: {e} (the kprof variants would be eager)"
    # The variants patch the model at its root; the optimizer switch is plain `kprof apply`'s.
    from kprof.patching.install import OPTIMIZER_ID

    ids = [i for i in ids if i != OPTIMIZER_ID]
    if not ids:
        return [], (f"nothing to patch: {OPTIMIZER_ID} is switched on the live optimizer by plain `kprof apply`, "
                    "not in --compare's variants (the kprof variants would be eager)")
    return ids, None


# --------------------------------------------------------------------------------------------
# The comparison (parent process)


def compare(
    script: str,
    argv: Sequence[str] = (),
    *,
    variants: str | Sequence[str] | None = None,
    patch: str = "all",
    run: str | None = None,
    strict: bool = False,
    rules_dir: str | None = None,
    compile_mode: str = "default",
    warmup: int | None = None,
    steps: int | None = None,
    out_root=None,
    progress: Callable[..., None] | None = None,
    timeout_s: float | None = None,
) -> CompareResult:
    """Run `script` once per variant, each in its own subprocess and saved as a run under
    `out_root`, and compare them (see the module docstring). `progress(event, **info)` gets
    "start" (variant, index, total) and "done" (variant, index, total, result).

    A variant that fails is recorded in its row and the others go on; compare.json is rewritten
    into each variant's run directory after every variant, so an interrupted comparison keeps the
    finished rows. KprofError for bad input, a script that fails as it is (eager failed before any
    step), and a comparison where nothing ran."""
    from kprof.patching.install import check_rules

    order = parse_variants(variants)
    check_compile_mode(compile_mode)
    if not Path(script).is_file():
        raise KprofError(f"no such script: {script}", exit_code=2)
    for name, v in (("--warmup", warmup), ("--steps", steps)):
        if v is not None and (not isinstance(v, int) or v < (0 if name == "--warmup" else 1)):
            raise KprofError(f"{name} must be {'0 or more' if name == '--warmup' else 'a positive integer'} "
                             f"(got {v!r})", exit_code=2)
    root = Path(out_root or store.DEFAULT_ROOT)
    store.ensure_root(root, exit_code=2)
    notify = progress or (lambda event, **info: None)
    kprof_variants = [v for v in order if "kprof" in v]

    # The plan: decided now where it can be, so a bad --patch fails before anything runs.
    before = _plan_run(script, run, root) if kprof_variants else None
    ids: list[str] = []
    skip_kprof: str | None = None
    if kprof_variants:
        if before is not None:
            ids, skip_kprof = _ids_for(before, patch, rules_dir)
        elif "eager" not in order:
            skip_kprof = (f"no profile of {script} in {root} to plan the patches from: run `kprof profile "
                          f"{script}` first, or add eager to --variants (its run is then planned)")
        if ids:
            check_rules(ids, rules_dir)
        if skip_kprof and len(kprof_variants) == len(order):
            raise KprofError(f"--variants {','.join(order)}: {skip_kprof}")

    s = before.summary if before is not None else {}
    n_warmup = warmup if warmup is not None else int(s.get("warmup") or 3)
    n_steps = steps if steps is not None else int(s.get("steps") or 5)
    res = CompareResult(script=str(script), argv=list(argv), variants=[], compile_mode=compile_mode,
                        warmup=n_warmup, steps=n_steps, plan_run=before.name if before is not None else None,
                        patch_ids=list(ids))
    if any("compile" in v for v in order) and n_warmup < MIN_COMPILE_WARMUP:
        res.warmup = MIN_COMPILE_WARMUP
        res.notes.append(f"warm-up raised from {n_warmup} to {MIN_COMPILE_WARMUP} steps for every variant: the "
                         "compile variants compile at the 2nd or 3rd step, which must not be timed")

    try:
        for i, v in enumerate(order):
            if "kprof" in v and not ids and skip_kprof is None:
                # Planned from this comparison's eager run.
                eager = res.row("eager")
                if eager is None or eager.run is None:
                    skip_kprof = "no plan: the eager variant, whose run the patches would be planned from, failed"
                else:
                    before = store.load_run(eager.run)
                    ids, skip_kprof = _ids_for(before, patch, rules_dir)
                    res.plan_run, res.patch_ids = before.name, list(ids)
                    if ids:
                        check_rules(ids, rules_dir)
            if "kprof" in v and skip_kprof is not None:
                res.variants.append(VariantResult(v, "skipped", error=skip_kprof))
                continue
            notify("start", variant=v, index=i, total=len(order))
            spec = {"script": str(Path(script).resolve()), "argv": list(argv), "variant": v,
                    "warmup": res.warmup, "steps": res.steps, "out_root": str(root.resolve()),
                    "patch_ids": ids if "kprof" in v else [], "rules_dir": rules_dir, "strict": strict,
                    "compile_mode": compile_mode}
            row = _run_variant(spec, timeout_s if timeout_s is not None else variant_timeout(res.variants, s))
            res.variants.append(row)
            notify("done", variant=v, index=i, total=len(order), result=row)
            if v == "eager" and row.status == "failed" and row.run is None:
                # The script fails as it is: every variant would fail the same way.
                raise KprofError(f"{script} failed in the eager variant (the script as it is), so there is nothing "
                                 f"to compare; fix the script first", exit_code=SCRIPT_FAILED, detail=row.error)
            _finish(res)
            _save(res)
    except KeyboardInterrupt:
        _finish(res)
        _save(res)
        where = f"; partial comparison saved in {res.saved[0]}" if res.saved else ""
        raise KprofError(f"interrupted{where}", exit_code=130) from None

    ran = [r for r in res.variants if r.run is not None]
    if not ran:
        errs = "; ".join(f"{r.variant}: {r.error}" for r in res.variants)
        raise KprofError(f"no variant ran, nothing to compare: {errs}", exit_code=SCRIPT_FAILED)
    _finish(res)
    if res.cpu:
        res.notes.append("CPU run: step times are CPU wall times and peak memory is the process's peak RSS, not a "
                         "GPU's; profile on the GPU for the GPU answer")
        if any(r.patches for r in res.variants):
            from kprof.kernels.common import interpreter_enabled

            res.notes.append("on a CPU kprof's Triton kernels run in the Triton interpreter (TRITON_INTERPRET=1), "
                             "orders of magnitude slower than compiled kernels: the kprof rows check correctness "
                             "here, not speed" if interpreter_enabled() else
                             "on a CPU without TRITON_INTERPRET=1 the patched modules run kprof's PyTorch reference "
                             "code, not its Triton kernels: the kprof rows don't show kernel speed here")
    _save(res)
    return res


def _child_env() -> dict:
    import site

    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # The child imports the same kprof as this process, whatever the current directory: a source
    # tree on sys.path (not an installed package, which the child finds by itself) goes first.
    here = str(Path(__file__).resolve().parents[2])  # kprof/patching/compare.py -> the tree holding kprof/
    installed = {str(Path(p).resolve()) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    if here not in installed:
        env["PYTHONPATH"] = os.pathsep.join([here] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


_CHILD = "import sys; from kprof.patching.compare_child import child_main; sys.exit(child_main(sys.argv[1]))"


VARIANT_TIMEOUT_MIN_S = 900.0  # compile variants add minutes of compilation to a short run
VARIANT_TIMEOUT_FACTOR = 5.0


def variant_timeout(done: Sequence["VariantResult"], plan_summary: dict) -> float:
    """How long one variant may run before it is stopped and reported as timed out, with its last
    output: a hung variant (test_compare_llama_tiny_on_gpu hung twice on the H200 with no
    output, 2026-12-02) must not hang the comparison and lose the finished rows. Five times the
    longest run seen so far (the planned run's wall time, or a finished variant's), at least
    VARIANT_TIMEOUT_MIN_S."""
    seen = [float(plan_summary.get("wall_time_s") or 0.0)] + [float(r.wall_s or 0.0) for r in done]
    return max(VARIANT_TIMEOUT_MIN_S, VARIANT_TIMEOUT_FACTOR * max(seen))


def _run_variant(spec: dict, timeout_s: float | None) -> VariantResult:
    """One variant in a fresh Python process; its stdout/stderr (the script's prints) go to a log
    whose tail explains a failure."""
    v = spec["variant"]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kprof-compare-") as td:
        spec = dict(spec, result=os.path.join(td, "result.json"))
        spec_path = os.path.join(td, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        log_path = os.path.join(td, "output.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-c", _CHILD, spec_path], stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_child_env())
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc = None
            except BaseException:  # Ctrl-C: the child got SIGINT too; don't leave it running
                proc.kill()
                proc.wait()
                raise
        tail = _tail(log_path)
        try:
            with open(spec["result"]) as f:
                out = json.load(f)
        except (OSError, ValueError):
            out = None
    wall = time.perf_counter() - t0
    if out is None:
        why = (f"timed out after {timeout_s:g} s" if rc is None
               else f"its process died (exit code {rc}{_signal_name(rc)}) before reporting")
        return VariantResult(v, "failed", error=why + (f"; last output:\n{tail}" if tail.strip() else ""), wall_s=wall)
    row = VariantResult(v, "failed" if out.get("error") else "ok", run=out.get("run"), error=out.get("error"),
                        warmup_s=out.get("warmup_s"), patches=out.get("patches") or [],
                        compile=out.get("compile"), notes=list(out.get("notes") or []), wall_s=wall,
                        loss_step=out.get("active_step"))
    if row.run is not None:
        from kprof import store

        summ = store.load_summary(row.run)
        if summ.get("status") not in ("completed", "stopped"):
            row.status = "failed"
            row.error = row.error or (summ.get("status_note") or f"the script {summ.get('status')}") + (
                f":\n{summ['error'].rstrip()}" if summ.get("error") else "")
        st = summ.get("step_time_ms") or {}
        row.step_time_ms = {k: st.get(k) for k in ("median", "p10", "p90", "spread", "n")}
        row.peak_memory_bytes = summ.get("peak_memory_bytes")
        row.peak_memory_kind = summ.get("peak_memory_kind") or ""
        row.warmup_steps = summ.get("steps_before_timing")
        row.losses = [x if _finite(x) else None for x in (summ.get("losses") or [])[:_KEEP_LOSSES]]
        k = row.loss_step
        row.first_loss = row.losses[k] if k is not None and k < len(row.losses) else None
        row.device = summ.get("device") or {}
    elif row.error and tail and "Traceback" not in row.error:
        row.error += f"\nlast output:\n{tail}"
    return row


def _signal_name(rc: int | None) -> str:
    if rc is None or rc >= 0:
        return ""
    import signal

    try:
        return f", {signal.Signals(-rc).name}"
    except ValueError:
        return ""


def _tail(path: str, n: int = 15) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 16384))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


# --------------------------------------------------------------------------------------------
# Losses, speed-ups, verdict


@functools.lru_cache(maxsize=8)
def _compute_dtype(run_path: str):
    """The coarsest floating dtype the run's FLOP-counted ops (matmuls, attention) computed in."""
    import pandas as pd
    import torch

    from kprof.patching.verify import COARSENESS

    names = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
             "bfloat16": torch.bfloat16}
    try:
        ops = store.load_ops(run_path)
    except KprofError:
        return torch.float32
    if "input_dtypes" not in ops:
        return torch.float32
    if "flops" in ops:
        ops = ops[pd.to_numeric(ops["flops"], errors="coerce").fillna(0) > 0]
    found = set()
    for dts in ops["input_dtypes"]:
        for d in dts if isinstance(dts, list) else []:
            d = d[0] if isinstance(d, list) and d else d
            if isinstance(d, str) and d in names:
                found.add(names[d])
    return max(found, key=COARSENESS.__getitem__) if found else torch.float32


def _finish(res: CompareResult) -> None:
    """Speed-ups, loss agreement and the verdict from the rows so far."""
    import torch

    from kprof.kernels.common import TOLERANCE
    from kprof.patching.verify import COARSENESS

    eager = res.row("eager")
    res.device = next((r.device for r in res.variants if r.device), res.device)
    e_ms = (eager.step_time_ms or {}).get("median") if eager is not None and eager.ok else None
    base_dtype = _compute_dtype(eager.run) if eager is not None and eager.run else torch.float32
    names = {str(d).replace("torch.", ""): d for d in COARSENESS}
    for r in res.variants:
        m = (r.step_time_ms or {}).get("median")
        r.speedup = e_ms / m if _finite(e_ms) and _finite(m) and m > 0 else None
        r.loss_agree = r.loss_rel_diff = r.loss_rtol = None
        if r.variant == "eager":
            r.loss_agree, r.loss_rel_diff = (True, 0.0) if r.first_loss is not None else (None, None)
            continue
        k = r.loss_step
        ref = eager.losses[k] if eager is not None and k is not None and k < len(eager.losses) else None
        if ref is None or r.first_loss is None:
            continue
        # Every variant's steps before loss_step ran the script's own code, as eager's did: same
        # weights and inputs at loss_step in a seeded script, so the losses there differ by rounding
        # only, within the tolerance of the coarsest dtype involved (the step's compute dtype, the
        # patched code's). kprof+compile compiles one step after its patches verified, so its
        # weights also carry one patched step's rounding (far below the tolerance in practice).
        dts = [base_dtype] + [names[p["dtype"]] for p in r.patches if p.get("dtype") in names]
        dtype = max(dts, key=COARSENESS.__getitem__)
        tol = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
        b, a = float(ref), float(r.first_loss)
        r.loss_rel_diff = abs(a - b) / max(abs(b), 1e-12)
        r.loss_agree = abs(a - b) <= tol.atol + tol.rtol * abs(b)
        r.loss_rtol = tol.rtol
    res.choice, res.verdict = verdict(res)


def _ms(r: VariantResult) -> float:
    return float(r.step_time_ms["median"])


def _beats(fast: VariantResult, slow: VariantResult) -> bool:
    """`fast` is faster than `slow` beyond the noise: their p10-p90 step-time ranges don't overlap
    (fast's p90 below slow's p10). Otherwise the difference is within the noise."""
    f, s_ = fast.step_time_ms or {}, slow.step_time_ms or {}
    hi = f.get("p90") if _finite(f.get("p90")) else f.get("median")
    lo = s_.get("p10") if _finite(s_.get("p10")) else s_.get("median")
    return float(hi) < float(lo)


def verdict(res: CompareResult) -> tuple[str | None, str]:
    """(variant, one line). The candidates are the variants that completed with a loss that agrees
    with eager's (or could not be compared). Among those that the fastest does not beat beyond the
    noise (`_beats`), the simplest (SIMPLICITY); and eager unless the choice beats it."""
    eager = res.row("eager")
    where = " (CPU step times; profile on the GPU for the GPU answer)" if res.cpu else ""
    ok = [r for r in res.variants if r.ok]
    if eager is None or not eager.ok:
        if not ok:
            return None, "no verdict: no variant completed"
        fastest = min(ok, key=_ms)
        return None, (f"no verdict: no eager baseline ({'not run' if eager is None else 'it failed'}); the fastest "
                      f"that ran: {fastest.variant}, {_ms(fastest):.3g} ms/step{where}")
    disagree = [r for r in ok if r.loss_agree is False]
    eligible = [r for r in ok if r.loss_agree is not False]
    fastest = min(eligible, key=_ms)
    near = [r for r in eligible if not _beats(fastest, r)]
    choice = min(near, key=lambda r: SIMPLICITY.index(r.variant))
    if choice is not eager and not _beats(choice, eager):
        choice = eager
    parts = []
    if choice is eager:
        others = [r for r in eligible if r is not eager]
        best = min(others, key=_ms) if others else None
        if best is None:
            parts.append("stay with eager: no other variant completed" + (" with a matching loss" if disagree else ""))
        elif _ms(best) < _ms(eager):
            parts.append(f"stay with eager: the fastest, {best.variant}, is {_ms(eager) / _ms(best):.2f}x as fast "
                         f"({_ms(best):.3g} vs {_ms(eager):.3g} ms/step), within the noise (their p10-p90 step "
                         "times overlap)")
        else:
            parts.append(f"stay with eager: no variant is faster (the best other, {best.variant}, runs at "
                         f"{_ms(eager) / _ms(best):.2f}x eager's speed)")
    else:
        parts.append(f"use {choice.variant}: {_ms(eager) / _ms(choice):.2f}x eager's speed ({_ms(choice):.3g} vs "
                     f"{_ms(eager):.3g} ms/step, beyond the noise)")
        if fastest is not choice:
            parts.append(f"{fastest.variant} is {_ms(choice) - _ms(fastest):.3g} ms/step faster still, but within "
                         "the noise, so the simpler one")
        if "compile" in choice.variant and _finite(choice.warmup_s) and _finite(eager.warmup_s):
            extra, saved = choice.warmup_s - eager.warmup_s, _ms(eager) - _ms(choice)
            if extra > 0 and saved > 0:
                parts.append(f"compiling costs {extra:.3g} s more warm-up, repaid after ~{extra * 1e3 / saved:,.0f} steps")
    if disagree:
        parts.append("excluded, loss differs from eager's beyond tolerance: " + ", ".join(r.variant for r in disagree))
    return choice.variant, "; ".join(parts) + where


# --------------------------------------------------------------------------------------------
# Saving


def _save(res: CompareResult) -> None:
    """compare.json into the run directory of every variant that has one (the same document in
    each: a run keeps its comparison if the others are deleted, and no entry without a
    summary.json ever sits in the run store, where `kprof runs` would list it as broken)."""
    doc = json.dumps(res.to_dict(), indent=1, allow_nan=False)
    res.saved = []
    for r in res.variants:
        if r.run is None or not Path(r.run).is_dir():
            continue
        path = Path(r.run) / store.COMPARE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(doc)
        tmp.replace(path)
        res.saved.append(str(path))


def load_compare(run) -> dict:
    """The compare.json of a variant's run (a kprof.store.Run or its directory)."""
    path = Path(getattr(run, "path", run)) / store.COMPARE
    if not path.is_file():
        raise KprofError(f"{path.parent.name} is not part of a comparison (no {store.COMPARE}); "
                         "run `kprof apply SCRIPT --compare`")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise KprofError(f"{path} is unreadable ({e})") from e
