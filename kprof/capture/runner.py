"""Run an unmodified training script in this process and profile a few of its steps.

`run_script(script, argv, cfg)` executes the script as `__main__` (like `python script.py`) with
global hooks that need no edits to the script:

* Steps. A global optimizer step post-hook marks step boundaries ("optimizer.step (AdamW)").
  Scripts without an optimizer (inference loops) are stepped by the calls of their outermost
  module ("outermost forward (GPT)"). In `step_mode="auto"` the first optimizer step decides
  for optimizer steps; outermost calls decide for forward steps only after
  `AUTO_FORWARD_AFTER_CALLS` of them went by with no optimizer step (more if an optimizer
  exists: `AUTO_FORWARD_AFTER_CALLS_WITH_OPTIMIZER`). If an optimizer step comes later while
  forward steps are still being measured, the run switches to optimizer steps and starts over.
* Schedule, in steps: `warmup` untouched, `steps` timed without the profiler, one profiler
  warm-up step (CUPTI start-up and any recompiles caused by kprof's hooks land here, not in the
  numbers), `steps` recorded under torch.profiler, each inside a `kprof.step#<n>` range. Then
  the script is stopped (unless `run_to_end`) by a private BaseException, so the script's own
  `except Exception:` cannot swallow it.
* Modules. Global forward pre/post hooks open/close a `kprof.module:<path>:<Class>` range (and
  an NVTX range `<path> (<Class>)`) around every module forward while the profiler runs; `<path>`
  is the module's name in its root's `named_modules()`. During warm-up the hooks only track
  nesting (to find roots); during the timed steps they are removed (see `_set_quiet`). Parse a
  range name with `name[len("kprof.module:"):].rsplit(":", 1)`: paths may contain ":"
  (ModuleDict keys), class names cannot. Modules built inside a forward and never registered
  get `<parent path>.<unregistered Class>`.
* Host syncs (kprof.capture.syncs), losses (a wrapper around torch.autograd.backward: per step, the
  sum of the scalars passed to backward, before any GradScaler scaling), tokens per step (the
  outermost forward's `input_ids` / first 2-D integer tensor), step times (CUDA events at the
  boundaries on a GPU run, perf_counter otherwise) and peak memory.
* A step cut short by an error or Ctrl-C keeps its range in the exported trace under
  `kprof.partial_step#<n>`, so `kprof.step#<n>` ranges are always complete steps.

In optimizer mode a step boundary runs inside torch's `Optimizer.step#<Class>.step` range (the
post-hook is called within it), so `kprof.step#<n+1>` starts a few microseconds before that
range of step n ends; every op of the optimizer step still lies inside `kprof.step#<n>`.

Everything kprof installs is removed when the script ends, however it ends.
"""

from __future__ import annotations

import collections
import importlib.metadata
import json
import os
import platform
import re
import resource
import runpy
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from kprof.capture import nvtx
from kprof.capture.compiled import KernelRecorder
from kprof.capture.syncs import SyncDetector
from kprof.errors import KprofError

MODULE_RANGE_PREFIX = "kprof.module:"
STEP_RANGE_PREFIX = "kprof.step#"
# A partly run step (the script raised or was interrupted inside it) is renamed in the exported
# trace so that analysis, which reads `kprof.step#<n>`, only sees complete steps.
PARTIAL_STEP_RANGE_PREFIX = "kprof.partial_step#"
# The profiler warm-up step, recorded with shapes (and stacks, if asked) and the host-sync
# detector on; the recorded steps that follow are timed without shapes or stacks (see
# `_start_timing_profiler`), with the detector still on (a sync every N steps needs the steps).
SHAPES_STEP_RANGE = "kprof.shapes_step#0"
# The profiler exports no shapes for a TensorList longer than this (torch's
# TENSOR_LIST_DISPLAY_LENGTH_LIMIT); kprof writes them into the trace from the profiler's events.
TRACE_TENSORLIST_LIMIT = 30

# Auto step mode: outermost-module calls without any optimizer step before kprof decides the
# script has no training step. 16 > common gradient-accumulation factors when no optimizer was
# even built. If one was built (torch.optim.Optimizer.__init__ ran), wait far longer: nanoGPT's
# train.py evaluates 2 x eval_iters = 400 forward calls under no_grad before its first step and
# accumulates 40 micro-batches per step on one GPU (gradient_accumulation_steps = 5 * 8).
AUTO_FORWARD_AFTER_CALLS = 16
AUTO_FORWARD_AFTER_CALLS_WITH_OPTIMIZER = 512
# Steps run with the profiler started but not recording (torch.profiler.schedule's `warmup`):
# Kineto/CUPTI set-up and Dynamo recompiles triggered by kprof's torch-function mode land here.
PROFILER_WARMUP_STEPS = 1
# Steps run after the recorded ones to record op shapes (and stacks, host syncs) for them.
SHAPES_STEPS = 1
# Memory on the shapes step (never on the timed or recorded steps). The profiler's memory events
# (profile_memory=True) cost one record per allocation and free (~1 us each); on a CUDA run the
# allocator's history adds a Python stack per allocation (~2 us, torch.cuda.memory docs) and keeps
# at most this many entries (a ring buffer, each entry a few KB with its frames: <= ~100 MB), so a
# step of 10k allocations (a 12-layer GPT-2 makes ~6k allocs + frees) fits whole.
MEMORY_HISTORY_MAX_ENTRIES = 20_000

StepMode = str  # "auto" | "optimizer" | "forward"
_STEP_MODES = ("auto", "optimizer", "forward")


@dataclass
class RunConfig:
    warmup: int = 3
    steps: int = 5
    run_to_end: bool = False
    step_mode: StepMode = "auto"
    record_shapes: bool = True  # on the shapes step (the profiler warm-up step)
    with_stack: bool = False  # on the shapes step
    # Record shapes on every recorded step too, for ops whose shapes vary from step to step (MoE
    # dispatch, packed sequences): costs profiler overhead on the timed steps.
    shapes_every_step: bool = False
    # Called once per root module at its first call, before its forward (kprof apply patches here).
    on_root_module: Callable[[nn.Module], None] | None = None
    # Called once per optimizer at its first step(), before the update: the object is fully built
    # (a subclass's __init__ has finished) and holds the first real gradients (kprof apply
    # switches a live optimizer to its fused step here).
    on_optimizer: Callable[[Any], None] | None = None
    trace_dir: str | None = None
    # The host-sync detector is a torch function mode: kprof apply --compare's compile variants
    # run without it, so that torch.compile traces what the user's own compile would.
    detect_syncs: bool = True
    # Called at each timed step's start with its index i (0..steps-1) and with i == steps when the
    # timed steps end, after the step's time mark (kprof apply's ablation switches patches here).
    # A true return stops the script there: no profiler phase, step_times_ms holds the i steps.
    on_step: Callable[[int], bool | None] | None = None


@dataclass
class RawRun:
    script: str
    argv: list[str]
    status: str  # "completed" | "stopped" | "error" | "interrupted"
    error: str | None
    exit_code: int
    device: dict
    step_definition: str
    warmup: int
    steps: int
    steps_recorded: int
    step_times_ms: list[float]
    profiled_step_times_ms: list[float]
    peak_memory_bytes: int | None
    trace_path: str | None
    syncs: list[dict]
    losses: list[float]
    tokens_per_step: int | None
    module_classes: dict[str, str]
    wall_time_s: float
    # Beyond the shared contract (all have defaults):
    message: str | None = None  # one line for the user, e.g. why the script was stopped
    loss_dtype: str | None = None  # the coarsest dtype the losses were returned in ("torch.bfloat16")
    peak_memory_label: str | None = None  # what peak_memory_bytes measures
    steps_before_timing: int = 0  # untouched steps actually run (>= warmup when auto decided late)
    profiler_warmup_steps: int = PROFILER_WARMUP_STEPS
    warnings: list[str] = field(default_factory=list)
    syncs_cpu: list[dict] = field(default_factory=list)  # would-be syncs, for a run that used no GPU
    shapes_recorded: str = "shapes step"  # "shapes step" | "every step": where op shapes come from
    sync_steps: int = 0  # steps the host-sync detector watched (profiler warm-up, recorded, shapes)
    # The shapes step's memory record (see `_memory_record`): allocator events, module and phase
    # ranges, the model's parameter/gradient/optimizer-state storages; None if not recorded.
    memory: dict | None = None
    memory_snapshot_path: str | None = None  # torch.cuda.memory._snapshot() pickled (CUDA runs)
    # topk choices per module in the shapes step (SyncDetector.routing_summary): MoE routing
    routing: list[dict] = field(default_factory=list)
    # The outermost module's tensor inputs on the annotated steps (profiler warm-up, recorded,
    # shapes step): [{"shapes": [[32, 256], ...], "calls": n}], one per distinct set of shapes.
    # More than one: the step's shapes change (what a CUDA graph, replaying one shape, can't take).
    root_input_shapes: list[dict] = field(default_factory=list)
    # torch.compile: Inductor's kernel call sites and Dynamo's graph-break/recompile log messages
    # (kprof/capture/compiled.py); empty when the script compiled nothing.
    inductor_kernels: list[dict] = field(default_factory=list)
    compile_events: list[dict] = field(default_factory=list)


class _StopScript(BaseException):
    """Raised from a kprof hook once the recorded steps are done: unwinds the user's script.
    A BaseException so that the script's `except Exception:` does not swallow it."""


class _AbortRun(BaseException):
    """Raised from a kprof hook when kprof itself must stop the run (e.g. on_root_module failed);
    carries the original exception, which run_script re-raises after cleaning up."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


def run_script(
    script: str,
    argv: list[str] | None = None,
    cfg: RunConfig | None = None,
    progress: Callable[..., Any] | None = None,
) -> RawRun:
    """Run `script` as __main__ with `argv`, profile `cfg.steps` of its steps, return a RawRun.

    `progress(event, **info)` is called with:
      "mode"  step_definition=..., reason=...        when the step definition is decided
      "step"  phase=..., index=..., total=..., step=..., last_ms=...
              at each step boundary; phase of the step starting there: "warmup", "timing",
              "profiler-warmup", "profiling", or "done" after the last recorded step
      "export" path=...                              before the trace is written
    A progress callback that raises is dropped (with a warning in RawRun.warnings).

    Raises KprofError (exit code 2) for a missing/unreadable script or a bad config; anything
    the script does wrong is reported in the RawRun instead.
    """
    cfg = cfg or RunConfig()
    argv = list(argv or [])
    path = _check_script(script)
    _check_config(cfg)
    return _Session(path, argv, cfg, progress).run()


def _check_script(script: str) -> str:
    path = os.path.abspath(os.path.expanduser(script))
    if not os.path.exists(path):
        raise KprofError(f"script not found: {script!r}. Pass the path of a Python file, e.g. `kprof profile train.py`.", exit_code=2)
    if os.path.isdir(path):
        raise KprofError(f"{script!r} is a folder, not a script. Pass the training script inside it, e.g. {os.path.join(script, 'train.py')!r}.", exit_code=2)
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise KprofError(f"cannot read script {script!r}: {e.strerror}. Check its permissions.", exit_code=2) from e
    return path


def _check_config(cfg: RunConfig) -> None:
    if not isinstance(cfg.steps, int) or cfg.steps <= 0:
        raise KprofError(f"--steps must be a positive integer (got {cfg.steps!r}); try --steps 5.", exit_code=2)
    if not isinstance(cfg.warmup, int) or cfg.warmup < 0:
        raise KprofError(f"--warmup must be 0 or more (got {cfg.warmup!r}); try --warmup 3.", exit_code=2)
    if cfg.step_mode not in _STEP_MODES:
        raise KprofError(f"unknown step mode {cfg.step_mode!r}; use one of {', '.join(_STEP_MODES)}.", exit_code=2)
    if cfg.trace_dir is not None and os.path.exists(cfg.trace_dir) and not os.path.isdir(cfg.trace_dir):
        raise KprofError(f"trace dir {cfg.trace_dir!r} exists and is not a folder; pass a folder.", exit_code=2)


def device_info(use_cuda: bool | None = None) -> dict:
    """The machine the run is on, for the report and for looking up roofline ceilings.
    `use_cuda=False` describes the CPU even where a GPU is present (a script that ran on the CPU
    of a GPU machine is a CPU run: its idle time is the host's, its ceilings the CPU's)."""
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "triton": _dist_version("triton"),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
    }
    if torch.cuda.is_available() if use_cuda is None else use_cuda:
        try:
            idx = torch.cuda.current_device()
            props = torch.cuda.get_device_properties(idx)
            info.update(
                type="cuda",
                index=idx,
                name=props.name,
                capability=f"{props.major}.{props.minor}",
                sm_count=props.multi_processor_count,
                total_memory=props.total_memory,
            )
        except Exception as e:  # e.g. the script left the context broken (device-side assert)
            info.update(type="cuda", index=None, name=f"unknown CUDA device ({e.__class__.__name__})",
                        capability=None, sm_count=None, total_memory=None)
    else:
        try:
            mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            mem = None
        info.update(type="cpu", name=_cpu_name(), capability=None, sm_count=None, total_memory=mem, cpu_count=os.cpu_count())
    return info


def _compiler_tracing() -> bool:
    """Whether FX or AOTAutograd is tracing (e.g. the backward graph compiled at the first
    backward): the modules called then are the compiler's GraphModules, not the script's. A hook
    that took one for a new root wrapped it, and the trace recursed through the wrapper (GPT
    example, kprof + torch.compile under `--compare`, H200 2026-11-29: Inductor RecursionError)."""
    try:
        from torch.fx import _symbolic_trace
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        # is_fx_tracing() logs a deprecation warning on every run since torch added
        # is_fx_symbolic_tracing() (fx.symbolic_trace only; compile/export are the caller's
        # torch.compiler.is_compiling()): probe for the new name, fall back on older torch.
        fx_tracing = getattr(_symbolic_trace, "is_fx_symbolic_tracing", None) or _symbolic_trace.is_fx_tracing
        return bool(fx_tracing() or get_proxy_mode() is not None)
    except Exception:  # private API moved: assume not tracing  # noqa: BLE001
        return False


def _torch_flags() -> dict:
    """The process-wide torch settings a training script commonly changes."""
    return {
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "fp32_precision": torch.get_float32_matmul_precision(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "default_dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
    }


def _restore_torch_flags(f: dict) -> None:
    # The precision setter first: it also sets allow_tf32, which the explicit value then overrides.
    torch.set_float32_matmul_precision(f["fp32_precision"])
    torch.backends.cuda.matmul.allow_tf32 = f["matmul_tf32"]
    torch.backends.cudnn.allow_tf32 = f["cudnn_tf32"]
    torch.backends.cudnn.benchmark = f["cudnn_benchmark"]
    torch.backends.cudnn.deterministic = f["cudnn_deterministic"]
    torch.use_deterministic_algorithms(f["deterministic"])
    torch.set_default_dtype(f["default_dtype"])
    torch.set_grad_enabled(f["grad"])


_NEVER_FORGET = frozenset({"kprof", "torch", "triton", "transformers", "nvtx", "numpy", "pandas"})


def _forget_modules(before: set, script_dir: str) -> None:
    """Drop the modules imported during the run from the script's folder (its helpers)."""
    root = os.path.join(script_dir, "")
    for name in set(sys.modules) - before:
        if name.split(".")[0] in _NEVER_FORGET:  # a script beside kprof's own checkout
            continue
        f = getattr(sys.modules.get(name), "__file__", None) or ""
        if f and os.path.realpath(f).startswith(root):
            sys.modules.pop(name, None)


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


class _Marks:
    """Timestamps at step boundaries; consecutive differences are step times."""

    def __init__(self) -> None:
        self.cuda: bool | None = None  # decided at the first mark
        self.wall: list[float] = []
        self.events: list[Any] = []

    def mark(self) -> None:
        if self.cuda is None:
            # CUDA events only if the script already uses CUDA: creating one would otherwise
            # initialize a CUDA context in a CPU-only script (and time nothing).
            self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.wall.append(time.perf_counter())
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()  # on the current stream; completes when the GPU reaches it
            self.events.append(ev)

    def durations_ms(self, cuda_sync: Callable[[], Any]) -> list[float]:
        if self.cuda and len(self.events) >= 2:
            try:
                cuda_sync()
                return [a.elapsed_time(b) for a, b in zip(self.events, self.events[1:])]
            except Exception:  # e.g. a device-side assert killed the context: fall back to wall time
                pass
        return [(b - a) * 1e3 for a, b in zip(self.wall, self.wall[1:])]


class _ModInfo:
    __slots__ = ("path", "cls", "range_name", "nvtx_name", "root")

    def __init__(self, path: str, cls: str, root: nn.Module):
        self.path = path
        self.cls = cls
        self.range_name = f"{MODULE_RANGE_PREFIX}{path}:{cls}"
        self.nvtx_name = f"{path} ({cls})" if path else f"({cls})"
        # Weak: infos live in a WeakKeyDictionary keyed by module; a strong reference to the
        # root would keep every module (and a model the script dropped) alive.
        self.root = weakref.ref(root)


def _unwrap_compiled(module: nn.Module) -> nn.Module:
    # torch.compile(model) returns an OptimizedModule wrapping the real model as `_orig_mod`.
    inner = getattr(module, "_orig_mod", None)
    if type(module).__name__ == "OptimizedModule" and isinstance(inner, nn.Module):
        return inner
    return module


class _Session:
    def __init__(self, script: str, argv: list[str], cfg: RunConfig, progress: Callable[..., Any] | None):
        self.script = script
        self.argv = argv
        self.cfg = cfg
        self.progress = progress
        self.warnings: list[str] = []
        # device_info() initializes CUDA; it runs after the script so the script's own use of
        # CUDA (or not) decides how steps are timed.
        self.cuda_run = torch.cuda.is_available()
        self._cuda_sync = torch.cuda.synchronize  # the real one, whatever is patched later
        self.main_thread = threading.get_ident()

        # step definition
        self.mode = "pending" if cfg.step_mode == "auto" else cfg.step_mode
        self.tentative = False  # auto mode chose forward steps; an optimizer step can overturn it
        self.primary_called: nn.Module | None = None  # the outermost module object first called
        self.primary_cls = ""
        self.primary_opt: Any = None  # weakref to the optimizer whose steps are the boundaries
        self.primary_opt_cls = ""
        self.optimizers: weakref.WeakSet = weakref.WeakSet()
        self.in_opt_hook = False  # inside cfg.on_optimizer: its optimizers' steps are no boundaries
        self.root_calls = 0  # outermost calls of the primary module (main thread) so far

        # schedule (reset when the step definition changes)
        self.e = -1  # index of the last boundary in the current schedule
        self.w_eff = cfg.warmup
        self.steps_before = cfg.warmup
        self.done = False
        self.quiet = False  # timing phase: hooks do the minimum
        self.timed = _Marks()
        self.prof_marks = _Marks()
        self.prof: Any = None
        self.trace_started = False
        self.step_handle: Any = None
        self.step_open = -1
        self.steps_recorded = 0
        self.peak: int | None = None
        self.cuda_base = 0  # CUDA memory allocated when the recorded steps began
        self.trace_path: str | None = None
        self.detector: SyncDetector | None = None
        self.stopped_detector: SyncDetector | None = None  # restarted by _start_sync_detector
        self.shapes_handle: Any = None  # the open SHAPES_STEP_RANGE
        self.shapes_pending = False  # the shapes step starts at the next outermost forward
        self.shapes_trace: str | None = None  # the shapes step's exported trace
        self.full_lists: dict = {}  # (op, start us) -> full TensorList records (see _full_tensorlists)
        self.sync_steps = 0
        self.syncs: list[dict] = []
        self.syncs_cpu: list[dict] = []
        self.mem_tensors: dict = {}  # storages captured at the shapes step's start and end
        self.mem_extra: dict = {}  # CUDA counters of the shapes step
        self.memory: dict | None = None
        self.memory_snapshot_path: str | None = None
        self.mem_history = False

        # modules
        self.info: "weakref.WeakKeyDictionary[nn.Module, _ModInfo]" = weakref.WeakKeyDictionary()
        self.roots: list[tuple[weakref.ref, str, str]] = []  # (root, path prefix, class)
        self.module_classes: dict[str, str] = {}
        self.tls = threading.local()
        self.all_stacks: list[list] = []
        self.annotating = False
        self.root_shapes: dict[tuple, int] = {}  # RawRun.root_input_shapes
        self.reindexed: dict[int, int] = {}

        # per-step data
        self.loss_cur: list[torch.Tensor] = []
        self.losses_by_step: list[list[torch.Tensor]] = []
        self.any_loss = False
        self.scaled: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.tokens_cur = 0
        self.tokens_by_step: list[int] = []

        self.stop_message: str | None = None
        self._undo: list[Callable[[], None]] = []
        self._module_hooks: list[Any] = []
        self._root_hook: Any = None
        self.dynamo_baseline = _dynamo_count()  # see _dynamo_used
        self.compile_recorder = KernelRecorder()

    # ------------------------------------------------------------------ run
    def run(self) -> RawRun:
        t0 = time.perf_counter()
        status, error, exit_code = "completed", None, 0
        abort: BaseException | None = None
        saved_argv, saved_path = sys.argv, list(sys.path)
        saved_modules, saved_torch = set(sys.modules), _torch_flags()
        try:
            self._install()
        except BaseException:
            self._uninstall()
            raise
        try:
            sys.argv = [self.script, *self.argv]
            sys.path.insert(0, os.path.dirname(self.script))
            try:
                with warnings.catch_warnings():
                    # torch warns that global hooks fire twice for torch.compile's
                    # OptimizedModule; kprof maps the wrapper and the model to the same path.
                    warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
                    runpy.run_path(self.script, run_name="__main__")
            finally:
                sys.argv = saved_argv
                sys.path[:] = saved_path
                # Two runs in one process (kprof apply, --compare, the library API) must not see
                # each other: the script's own modules are imported afresh next time (a planted
                # script's helper module kept the first run's device, H200 2026-11-29), and the
                # torch flags it set (TF32, cuDNN, default dtype) are put back.
                _forget_modules(saved_modules, os.path.dirname(os.path.realpath(self.script)))
                _restore_torch_flags(saved_torch)
        except _StopScript:
            status = "stopped"
        except _AbortRun as e:
            abort = e.cause
        except SystemExit as e:
            code = e.code
            if code is None or code == 0:
                status = "completed"
            elif isinstance(code, int):
                status, exit_code, error = "error", code, f"SystemExit: {code}"
            else:  # sys.exit("message") prints the message and exits with 1
                status, exit_code, error = "error", 1, str(code)
        except KeyboardInterrupt:
            status, exit_code = "interrupted", 130
        except BaseException as e:  # the script's own error, including SyntaxError at compile
            status, exit_code, error = "error", 1, self._script_traceback(e)
        finally:
            self._uninstall()
            try:
                self._finish_profiler(complete=False)
            except KeyboardInterrupt:  # held while the trace was written (_interrupts_held)
                status, exit_code = "interrupted", 130
        if abort is not None:
            raise abort
        return self._result(status, error, exit_code, time.perf_counter() - t0)

    def _script_traceback(self, e: BaseException) -> str:
        # Drop the frames of kprof and runpy above the script's first frame.
        tb = e.__traceback__
        script = os.path.realpath(self.script)
        while tb is not None and os.path.realpath(tb.tb_frame.f_code.co_filename) != script:
            tb = tb.tb_next
        if tb is None:  # e.g. SyntaxError: no frame in the script
            tb = e.__traceback__
            while tb is not None and tb.tb_next is not None and "runpy" in tb.tb_frame.f_code.co_filename:
                tb = tb.tb_next
        return "".join(traceback.format_exception(type(e), e, tb))

    # ------------------------------------------------------------------ install / uninstall
    def _install(self) -> None:
        from torch.optim import optimizer as optim_module

        self._add_module_hooks()
        self._undo.append(self._remove_module_hooks)
        h = optim_module.register_optimizer_step_post_hook(self._opt_post_hook)
        self._undo.append(h.remove)

        # Know whether an optimizer exists (auto mode waits longer for its first step).
        orig_init = torch.optim.Optimizer.__init__
        session = self

        def init(opt, *args, **kwargs):
            orig_init(opt, *args, **kwargs)
            session.optimizers.add(opt)

        torch.optim.Optimizer.__init__ = init  # type: ignore[method-assign]
        self._undo.append(lambda: setattr(torch.optim.Optimizer, "__init__", orig_init))

        if self.cfg.on_optimizer is not None:
            stepped: weakref.WeakSet = weakref.WeakSet()

            def first_step(opt, args, kwargs):
                if torch.compiler.is_compiling() or opt in stepped:
                    return None
                stepped.add(opt)
                if session.in_opt_hook:
                    return None  # a copy the hook steps to prove its change: not the script's
                session.in_opt_hook = True
                try:
                    session.cfg.on_optimizer(opt)
                except Exception as e:
                    raise _AbortRun(e) from e
                finally:
                    session.in_opt_hook = False
                return None

            h = optim_module.register_optimizer_step_pre_hook(first_step)
            self._undo.append(h.remove)
        # Inductor's kernels and Dynamo's breaks are recorded from the first torch.compile call
        # (nn.Module.compile calls it too).
        orig_compile = torch.compile

        def compile_(*args, **kwargs):
            session.compile_recorder.start()
            return orig_compile(*args, **kwargs)

        torch.compile = compile_  # type: ignore[assignment]
        self._undo.append(lambda: setattr(torch, "compile", orig_compile))
        self._undo.append(self.compile_recorder.stop)

        # Losses: whatever each step calls .backward() on (Tensor.backward calls this too).
        orig_backward = torch.autograd.backward

        def backward(tensors, *args, **kwargs):
            session._note_backward(tensors)
            return orig_backward(tensors, *args, **kwargs)

        backward.__wrapped__ = orig_backward  # type: ignore[attr-defined]
        torch.autograd.backward = backward
        self._undo.append(lambda: setattr(torch.autograd, "backward", orig_backward))

        # With AMP, scripts call scaler.scale(loss).backward(): remember the unscaled loss.
        try:
            from torch.amp.grad_scaler import GradScaler
        except ImportError:
            GradScaler = None
        if GradScaler is not None:
            orig_scale = GradScaler.scale

            def scale(scaler, outputs):
                out = orig_scale(scaler, outputs)
                if isinstance(outputs, torch.Tensor) and isinstance(out, torch.Tensor):
                    session.scaled[id(out)] = (out, outputs)
                return out

            GradScaler.scale = scale  # type: ignore[method-assign]
            self._undo.append(lambda: setattr(GradScaler, "scale", orig_scale))

    def _add_module_hooks(self) -> None:
        from torch.nn.modules import module as nn_module

        if self._module_hooks:
            return
        self._module_hooks.append(nn_module.register_module_forward_pre_hook(self._pre_hook))
        try:
            h = nn_module.register_module_forward_hook(self._post_hook, with_kwargs=True, always_call=True)
        except TypeError:  # older torch without with_kwargs/always_call on global hooks
            h = nn_module.register_module_forward_hook(self._post_hook)
        self._module_hooks.append(h)

    def _remove_module_hooks(self) -> None:
        while self._module_hooks:
            self._module_hooks.pop().remove()

    def _set_quiet(self, quiet: bool) -> None:
        """Timed steps run with as little of kprof as possible: the numbers users compare against.

        Any global module hook sends every module call down torch's slow `_call_impl` path
        (measured here: ~3 us per module call on a loaded 2-core VM, for 126 tiny modules a
        +20% forward), so the hooks are removed for the timed steps. Not when Dynamo has compiled
        anything: it guards on the global hook dicts, and removing them recompiles (checked on
        torch 2.13: a second graph at the first call after removal). Then the hooks stay and
        return at once.
        """
        if quiet == self.quiet:
            return
        self.quiet = quiet
        if quiet:
            self._close_all_ranges()
            if not _dynamo_used(self.dynamo_baseline):
                self._remove_module_hooks()
                if self.mode == "forward" and self.primary_called is not None:
                    self._root_hook = self.primary_called.register_forward_pre_hook(self._quiet_root_hook)
        else:
            if self._root_hook is not None:
                self._root_hook.remove()
                self._root_hook = None
            self._add_module_hooks()
            self._close_all_ranges()

    def _quiet_root_hook(self, module: nn.Module, args: tuple) -> None:
        if self.quiet and threading.get_ident() == self.main_thread:
            self._root_call()
        return None

    def _uninstall(self) -> None:
        if self._root_hook is not None:
            self._root_hook.remove()
            self._root_hook = None
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except Exception as e:  # keep undoing the rest
                self.warnings.append(f"kprof could not remove one of its hooks: {e!r}")

    # ------------------------------------------------------------------ progress
    def _progress(self, event: str, **info: Any) -> None:
        if self.progress is None:
            return
        try:
            self.progress(event, **info)
        except Exception as e:
            self.warnings.append(f"progress callback raised {e!r}; progress display turned off")
            self.progress = None

    # ------------------------------------------------------------------ hooks
    def _stack(self) -> list:
        st = getattr(self.tls, "stack", None)
        if st is None:
            st = self.tls.stack = []
            self.all_stacks.append(st)
        return st

    def _pre_hook(self, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling() or _compiler_tracing():
            return None
        if self.done:
            if module is self.primary_called and threading.get_ident() == self.main_thread:
                self._stop_again()
                if self.mode == "forward":
                    self._close_step_data()
            return None
        if self.quiet:
            # Timing steps: only forward-step boundaries matter; no nesting, no ranges.
            if module is self.primary_called and self.mode == "forward" and threading.get_ident() == self.main_thread:
                self._root_call()
            return None
        try:
            st = self._stack()
            if not st:
                self._outermost_call(module)  # may raise _StopScript / _AbortRun
                if self.annotating and module is self.primary_called:
                    sig = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
                    self.root_shapes[sig] = self.root_shapes.get(sig, 0) + 1
                if self.shapes_pending and threading.get_ident() == self.main_thread:
                    self._start_shapes_step()
                st = self._stack()  # a boundary may have reset the stacks
            if self.quiet:  # this call's boundary started the timing phase
                return None
            handle = None
            info = None
            if self.annotating:
                info = self._info_for(module, st)
                handle = torch.ops.profiler._record_function_enter_new(info.range_name, None)
                nvtx.range_push(info.nvtx_name)
            st.append((module, handle, info is not None))
        except (_StopScript, _AbortRun):
            raise
        except Exception as e:  # a kprof bug must not break the user's forward
            self._internal_error("forward pre-hook", e)
        return None

    def _post_hook(self, module: nn.Module, *rest: Any) -> None:
        # rest is (args, kwargs, output) normally, (args, output) when torch calls always_call
        # hooks after a forward raised.
        if torch.compiler.is_compiling() or self.done or self.quiet:
            return None
        try:
            st = self._stack()
            for i in range(len(st) - 1, -1, -1):
                if st[i][0] is module:
                    break
            else:
                return None  # pushed before kprof was tracking (or by another thread)
            while len(st) > i:
                _, handle, pushed = st.pop()
                self._close_range(handle, pushed)
            if not st and module is self.primary_called and threading.get_ident() == self.main_thread:
                args = rest[0] if rest else ()
                kwargs = rest[1] if len(rest) == 3 else {}
                self.tokens_cur += _count_tokens(args, kwargs)
        except Exception as e:
            self._internal_error("forward hook", e)
        return None

    def _module_path(self) -> str:
        """The path of the innermost module running now (this thread), "" outside any."""
        st = self._stack()
        info = self.info.get(st[-1][0]) if st else None
        return info.path if info is not None else ""

    def _close_range(self, handle: Any, pushed: bool) -> None:
        if handle is not None:
            torch.ops.profiler._record_function_exit._RecordFunction(handle)
        if pushed:
            nvtx.range_pop()

    def _close_all_ranges(self) -> None:
        for st in self.all_stacks:
            while st:
                _, handle, pushed = st.pop()
                try:
                    self._close_range(handle, pushed)
                except Exception:
                    pass

    def _opt_post_hook(self, opt: Any, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling() or self.in_opt_hook:
            return None
        if self.done:
            if self.primary_opt is not None and self.primary_opt() is opt:
                self._stop_again()
                self._close_step_data()
            return None
        if self.primary_opt is None:
            if self.mode == "forward" and not self.tentative:
                return None  # forward steps were asked for
            self.primary_opt = weakref.ref(opt)
            self.primary_opt_cls = type(opt).__name__
            reason = "optimizer.step() was called" if self.mode != "optimizer" else "--step-mode optimizer"
            self._decide("optimizer", reason=reason)
        elif self.primary_opt() is not opt:
            return None  # a second optimizer (e.g. a GAN's): its steps are not boundaries
        self._boundary()
        return None

    def _stop_again(self) -> None:
        # The script caught _StopScript (bare `except:` / `except BaseException:`) and went on:
        # stop it again, but only at a step boundary, so its `finally:` cleanup is not cut short.
        if not self.cfg.run_to_end and threading.get_ident() == self.main_thread:
            raise _StopScript()

    def _internal_error(self, where: str, e: Exception) -> None:
        msg = f"kprof {where} failed: {e!r} (module attribution may be incomplete)"
        if msg not in self.warnings:
            self.warnings.append(msg)

    # ------------------------------------------------------------------ roots and paths
    def _outermost_call(self, module: nn.Module) -> None:
        if module not in self.info:
            self._discover(module)
        if module is self.primary_called or (self.primary_called is None and threading.get_ident() == self.main_thread):
            if self.primary_called is None:
                self.primary_called = module
                self.primary_cls = self.info[module].cls if module in self.info else type(module).__name__
            if threading.get_ident() == self.main_thread:
                self._root_call()

    def _discover(self, module: nn.Module) -> None:
        # A module called outside any forward: a submodule of a known root (added since it was
        # indexed, or called directly), or a new root.
        for ref, prefix, _ in self.roots:
            root = ref()
            if root is not None and any(m is module for m in root.modules()):
                self._index(root, prefix)
                return
        target = _unwrap_compiled(module)
        cls = type(target).__name__
        # A root of the same class that no longer exists (e.g. `nn.CrossEntropyLoss()(x, y)`
        # built anew each step) passes its path on, so the path is stable across steps.
        for i, (ref, old_prefix, old_cls) in enumerate(self.roots):
            if ref() is None and old_cls == cls:
                prefix = old_prefix
                del self.roots[i]
                break
        else:
            prefix = ""
            if self.roots:
                used = {p for _, p, _ in self.roots}
                prefix, n = cls, 2
                while prefix in used:
                    prefix, n = f"{cls}#{n}", n + 1
        self.roots.append((weakref.ref(target), prefix, cls))
        if self.cfg.on_root_module is not None:
            try:
                self.cfg.on_root_module(target)
            except Exception as e:
                raise _AbortRun(e) from e
        self._index(target, prefix)
        if module is not target:
            self.info[module] = self.info[target]

    def _index(self, root: nn.Module, prefix: str) -> None:
        for name, m in root.named_modules():
            known = self.info.get(m)
            if known is not None and known.root() is not root:
                continue  # shared with an earlier root: keep its first path
            path = f"{prefix}.{name}" if prefix and name else (prefix or name)
            info = _ModInfo(path, type(m).__name__, root)
            self.info[m] = info
            self.module_classes.setdefault(path, info.cls)
        self.reindexed[id(root)] = self.e

    def _info_for(self, module: nn.Module, st: list) -> _ModInfo:
        info = self.info.get(module)
        if info is not None:
            return info
        parent = self.info.get(st[-1][0]) if st else None
        parent_root = parent.root() if parent is not None else None
        if parent_root is not None and self.reindexed.get(id(parent_root)) != self.e:
            # New submodule (e.g. added by a patch): re-index its root, at most once a step.
            root_prefix = next((p for r, p, _ in self.roots if r() is parent_root), "")
            self._index(parent_root, root_prefix)
            info = self.info.get(module)
            if info is not None:
                return info
        if parent is None and not st:
            self._discover(module)
            return self.info[module]
        # Not registered anywhere (built inside a forward, or called from outside via a
        # reference): name it under the module that called it.
        base = parent.path if parent is not None else ""
        name = f"<unregistered {type(module).__name__}>"
        path = f"{base}.{name}" if base else name
        info = _ModInfo(path, type(module).__name__, parent_root if parent_root is not None else module)
        self.info[module] = info
        self.module_classes.setdefault(path, info.cls)
        return info

    # ------------------------------------------------------------------ step definition
    def _root_call(self) -> None:
        self.root_calls += 1
        if self.mode == "forward":
            if self.e < 0 and not self.tentative:
                self._progress("mode", step_definition=self.step_definition(), reason="--step-mode forward")
            self._boundary()
        elif self.mode == "pending":
            limit = AUTO_FORWARD_AFTER_CALLS_WITH_OPTIMIZER if len(self.optimizers) else AUTO_FORWARD_AFTER_CALLS
            # root_calls - 1 calls completed before this one, with no optimizer step.
            if self.root_calls - 1 >= limit:
                self.tentative = True
                self._decide("forward", reason=f"{self.root_calls - 1} calls of the outermost module without an optimizer step")
                self._boundary()

    def _decide(self, mode: str, reason: str) -> None:
        if self.mode == "forward" and self.tentative and mode == "optimizer":
            # Forward steps were only a guess: an optimizer step proves otherwise. Start over.
            self._abandon_profile()
            self.tentative = False
            self.warnings.append("switched from forward steps to optimizer steps after an optimizer.step() appeared")
        seen = 1 if mode == "optimizer" else self.root_calls - 1
        self.mode = mode
        self.e = -1
        self.w_eff = max(0, self.cfg.warmup - seen)
        self.steps_before = self.w_eff + seen
        self.timed = _Marks()
        self.prof_marks = _Marks()
        self.losses_by_step = []
        self.tokens_by_step = []
        if mode == "forward":
            self.loss_cur = []  # calls before the decision are not steps of this definition
            self.tokens_cur = 0
        self._progress("mode", step_definition=self.step_definition(), reason=reason)

    def step_definition(self) -> str:
        if self.mode == "optimizer":
            return f"optimizer.step ({self.primary_opt_cls or 'not called'})"
        if self.mode == "forward":
            return f"outermost forward ({self.primary_cls or 'no module called'})"
        return "none (no optimizer step and too few module calls to decide)"

    # ------------------------------------------------------------------ boundaries
    def _boundary(self) -> None:
        """One step ends (index e-1) and the next begins (index e)."""
        self.e += 1
        e = self.e
        w, s, p = self.w_eff, self.cfg.steps, PROFILER_WARMUP_STEPS
        t_end = w + s  # boundary that ends the timed steps and starts the profiler warm-up
        r0, r1 = t_end + p, t_end + p + s  # first/last boundary of the recorded steps

        # In optimizer mode boundary 0 is the first optimizer step: it closes a step too.
        if e >= 1 or self.mode == "optimizer":
            self._close_step_data()
        self.loss_cur = []
        self.tokens_cur = 0
        self.scaled.clear()

        if e == r1 + 1 and (self.shapes_handle is not None or self.shapes_pending):
            self.shapes_pending = False  # a step with no forward: no shapes, see _finish_profiler
            self._complete_shapes_step()  # may raise _StopScript
            return
        if w <= e <= t_end:
            self.timed.mark()
            if self.cfg.on_step is not None:
                try:
                    stop = self.cfg.on_step(e - w)
                except Exception as e_:
                    raise _AbortRun(e_) from e_
                if stop:
                    self.done = True
                    self.stop_message = f"kprof stopped the script after {e - w} timed steps (on_step asked to)"
                    raise _StopScript()
        if e == t_end:
            self._start_profiler()
        if r0 <= e <= r1:
            self.prof_marks.mark()
        if r0 < e <= r1:
            self._close_step_range(complete=True)
        if e == r0 and self.prof is not None:
            try:
                if self.cuda_run and torch.cuda.is_initialized():
                    torch.cuda.reset_peak_memory_stats()
                    self.cuda_base = torch.cuda.memory_allocated()
                self.prof.start_trace()
                self.trace_started = True
            except Exception as e_:
                self._profiler_failed(e_)
        if r0 <= e < r1 and self.trace_started:
            j = e - r0
            self.step_handle = torch.ops.profiler._record_function_enter_new(f"{STEP_RANGE_PREFIX}{j}", None)
            self.step_open = j
            # The detector stays on through the recorded steps: a sync every N steps (a logged
            # loss.item()) is seen only if enough steps are watched. 0 is the profiler warm-up step.
            if self.detector is not None:
                self.detector.step = j + 1

        self._set_quiet(w <= e < t_end)

        last_ms = None
        if len(self.timed.wall) >= 2 and e <= t_end:
            last_ms = (self.timed.wall[-1] - self.timed.wall[-2]) * 1e3
        elif len(self.prof_marks.wall) >= 2:
            last_ms = (self.prof_marks.wall[-1] - self.prof_marks.wall[-2]) * 1e3
        if e < w:
            phase, idx, total = "warmup", e, w
        elif e < t_end:
            phase, idx, total = "timing", e - w, s
        elif e < r0:
            phase, idx, total = "profiler-warmup", e - t_end, p
        elif e < r1:
            phase, idx, total = "profiling", e - r0, s
        else:
            phase, idx, total = "done", s, s
        self._progress("step", phase=phase, index=idx, total=total, step=e, last_ms=last_ms)

        if e == r1:
            self._finish_profiler(complete=True)
            if self.trace_path is not None and self.cfg.record_shapes and not self.cfg.shapes_every_step:
                # One more step: the sync detector watches all of it, the shapes profiler starts
                # at its first outermost forward (see _start_shapes_step).
                self.shapes_pending = True
                if self.detector is None:
                    self._start_sync_detector()
                if self.detector is not None:
                    self.detector.step = self.cfg.steps + 1
                    self.sync_steps += 1
                return
            self._stop_after_recording()

    def _stop_after_recording(self) -> None:
        s, p = self.cfg.steps, PROFILER_WARMUP_STEPS
        self.done = True
        if not self.cfg.run_to_end:
            shapes = " + 1 with shapes" if self.sync_steps == 1 or self.full_lists or self.shapes_trace else ""
            self.stop_message = (
                f"kprof stopped the script after {self.steps_recorded} recorded steps "
                f"({self.steps_before} warm-up, {s} timed, {p} profiler warm-up, {s} recorded{shapes}); "
                "pass --run-to-end to let it finish."
            )
            raise _StopScript()

    def _activities(self) -> list:
        from torch.profiler import ProfilerActivity

        return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda_run else [])

    def _start_profiler(self) -> None:
        """Prepare the profiler that times the recorded steps; the profiler warm-up step follows
        (CUPTI start-up and recompiles land there). It records no shapes, no stacks and runs no
        sync detector, which add host time to every op (the profiled step ran +105-160% slower
        than the unprofiled one on the H200 runs with all three on): those are recorded in one
        more step after the recorded ones (`_start_shapes_step`), whose shapes trace.op_table
        gives the timed steps' ops. With shapes_every_step, this profiler records them all."""
        from torch.profiler import profile

        every = self.cfg.shapes_every_step
        try:
            self.prof = profile(activities=self._activities(), record_shapes=self.cfg.record_shapes and every,
                                with_stack=self.cfg.with_stack and every)
            self.prof.prepare_trace()
        except Exception as e:
            self._profiler_failed(e)
            return
        self.annotating = True
        self._close_all_ranges()  # nesting restarts clean with ranges on
        self._start_sync_detector()  # the profiler warm-up step: not timed (and the shapes step)
        if self.detector is not None:
            self.detector.step = 0
            self.sync_steps = 1 + self.cfg.steps

    def _start_sync_detector(self) -> None:
        if not self.cfg.detect_syncs:
            return
        if self.stopped_detector is None and _dynamo_used(self.dynamo_baseline):
            # Dynamo guards on the torch function mode stack: pushing the detector recompiles every
            # compiled frame at the switch, and Dynamo logs only the first failed guard, so the
            # script's own recompile reasons were hidden behind kprof's (torch 2.13, the planted
            # recompile of tests/profile/test_compiled.py).
            note = ("host-sync detection by source line skipped: the script compiled code with torch.compile, "
                    "and kprof's torch function mode would make it recompile; syncs still show in the trace "
                    "(cudaStreamSynchronize, memcpy) and as idle GPU time")
            if note not in self.warnings:  # once, though asked at the profiler warm-up and the shapes step
                self.warnings.append(note)
            return
        stack_len = torch._C._len_torch_function_stack()
        if stack_len == 0:
            # Restarted for the shapes step: the same detector, so its counts cover every watched step.
            self.detector = self.stopped_detector or SyncDetector(self.script, cuda_run=self.cuda_run)
            self.detector.install()
        else:
            # A mode pushed before the boundary and popped after it would pop ours instead.
            self.warnings.append(
                "host-sync detection skipped: a torch function mode (e.g. `with torch.device(...)`) "
                "was active at the step boundary"
            )

    def _start_shapes_step(self) -> None:
        """One more step after the recorded ones, at its first outermost forward (no range is
        open there: a range entered under one profiler session and ended under the next
        corrupted the heap, torch 2.13), recorded with shapes, stacks (if asked) and the sync
        detector. It ends at the next step boundary (`_complete_shapes_step`)."""
        from torch.profiler import profile

        self.shapes_pending = False
        try:
            self.prof = profile(activities=self._activities(), record_shapes=self.cfg.record_shapes,
                                with_stack=self.cfg.with_stack, profile_memory=True)
            self._start_memory_capture()
            self.prof.start()
        except Exception as e:
            self.warnings.append(f"torch.profiler failed to start the shapes step: {e!r}; ops have no shapes")
            self.prof = None
            self._end_memory_capture()
            self._stop_after_recording()
            return
        self.annotating = True
        self._close_all_ranges()
        self.shapes_handle = torch.ops.profiler._record_function_enter_new(SHAPES_STEP_RANGE, None)
        if self.detector is not None:  # the routing histograms come from this step only
            self.detector.where, self.detector.routing = self._module_path, True

    def _complete_shapes_step(self) -> None:
        """End the shapes step, merge it into the recorded steps' trace, stop the script."""
        self._end_shapes_step()
        self._stop_sync_detector()
        self._close_all_ranges()
        self.annotating = False
        if self.shapes_trace is not None and self.trace_path is not None:
            try:
                _merge_shapes_step(self.trace_path, self.shapes_trace, self.full_lists)
            except (OSError, ValueError, KeyError) as e:
                self.warnings.append(f"could not merge the shapes step into the trace: {e!r}; ops have no shapes")
        self._drop_shapes_trace()
        self._stop_after_recording()

    def _stop_sync_detector(self) -> None:
        d = self.detector
        if d is not None:
            d.uninstall()
            d.routing = False
            # Both sets: whether the script used the GPU (not whether there is one) is decided from
            # the trace by the analysis; a CPU script on a GPU machine gets the would-be syncs.
            self.syncs = d.summary(cuda_used=self.cuda_run)
            self.syncs_cpu = d.summary(cuda_used=False)
            self.detector, self.stopped_detector = None, d

    def _end_shapes_step(self) -> None:
        """Close the shapes step: stop its profiler and export its trace (kept for the merge)."""
        if self.shapes_handle is not None:
            try:
                torch.ops.profiler._record_function_exit._RecordFunction(self.shapes_handle)
            finally:
                self.shapes_handle = None
        self._stop_sync_detector()
        prof, self.prof = self.prof, None
        self._end_memory_capture()
        if prof is None:
            return
        try:
            prof.stop()
        except Exception as e:
            self.warnings.append(f"torch.profiler failed to stop after the shapes step: {e!r}")
            return
        self.full_lists = _full_tensorlists(prof, self.warnings)
        try:
            if self.cfg.trace_dir:
                os.makedirs(self.cfg.trace_dir, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix="kprof-shapes-", suffix=".trace.json", dir=self.cfg.trace_dir)
            os.close(fd)
            prof.export_chrome_trace(path)
            self.shapes_trace = path
        except Exception as e:
            self.warnings.append(f"could not export the shapes step's trace: {e!r}; ops have no shapes")
            return
        try:
            self.memory = _memory_record(path, self.mem_tensors, self.mem_extra, self.cuda_run and self.mem_extra.get("cuda", False))
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.warnings.append(f"could not read the shapes step's memory events: {e!r}; no memory breakdown")

    # ------------------------------------------------------------------ memory (shapes step)
    def _model_tensors(self) -> dict:
        """{kind: [[data_ptr, nbytes, name, dtype], ...]} for the roots' parameters, their grads
        and the optimizers' state: the storages the memory breakdown classifies by identity."""
        out: dict[str, list] = {"parameters": [], "gradients": [], "optimizer_state": []}
        names: dict[int, str] = {}
        seen: set = set()
        for ref, prefix, _ in self.roots:
            root = ref()
            if root is None:
                continue
            for name, p in root.named_parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                full = f"{prefix}.{name}" if prefix else name
                names[id(p)] = full
                out["parameters"].append(_tensor_entry(p, full))
                if p.grad is not None:
                    out["gradients"].append(_tensor_entry(p.grad, full + ".grad"))
        for opt in list(self.optimizers):
            for p, st in list(getattr(opt, "state", {}).items()):
                for k, v in (st.items() if isinstance(st, dict) else ()):
                    if isinstance(v, torch.Tensor) and v.numel() > 1:  # not the scalar `step`
                        out["optimizer_state"].append(_tensor_entry(v, f"{names.get(id(p), '?')}.{k}"))
        return out

    def _start_memory_capture(self) -> None:
        try:
            self.mem_tensors = {"at_forward_start": self._model_tensors()}
        except Exception as e:  # noqa: BLE001 - a model kprof can't walk costs the breakdown only
            self.warnings.append(f"could not list the model's tensors for the memory breakdown: {e!r}")
            self.mem_tensors = {}
        self.mem_extra = {"cuda": False}
        if not (self.cuda_run and torch.cuda.is_initialized()):
            return
        try:
            torch.cuda.reset_peak_memory_stats()
            self.mem_extra.update(cuda=True, allocated_at_start=torch.cuda.memory_allocated())
            torch.cuda.memory._record_memory_history(
                "all", context="alloc", stacks="python", max_entries=MEMORY_HISTORY_MAX_ENTRIES)
            self.mem_history = True
        except Exception as e:  # a private API: losing it costs the snapshot, not the run
            self.warnings.append(f"could not record the CUDA allocator's history: {e!r}")

    def _end_memory_capture(self) -> None:
        if not self.mem_tensors and not self.mem_history:
            return
        try:
            self.mem_tensors["at_step_end"] = self._model_tensors()
        except Exception as e:  # noqa: BLE001
            self.warnings.append(f"could not list the model's tensors for the memory breakdown: {e!r}")
        if not self.mem_extra.get("cuda"):
            return
        try:
            self.mem_extra.update(max_allocated=torch.cuda.max_memory_allocated(),
                                  max_reserved=torch.cuda.max_memory_reserved())
        except Exception:
            pass
        if not self.mem_history:
            return
        try:
            import pickle

            snap = torch.cuda.memory._snapshot()
            fd, path = tempfile.mkstemp(prefix="kprof-memory-", suffix=".pickle", dir=self.cfg.trace_dir)
            with os.fdopen(fd, "wb") as f:
                pickle.dump(snap, f)
            self.memory_snapshot_path = path
            self.mem_extra["snapshot_entries"] = sum(len(t) for t in snap.get("device_traces") or [])
        except Exception as e:
            self.warnings.append(f"could not take the CUDA memory snapshot: {e!r}")
        finally:
            try:
                torch.cuda.memory._record_memory_history(None)
            except Exception:
                pass
            self.mem_history = False

    def _profiler_failed(self, e: Exception) -> None:
        self.warnings.append(f"torch.profiler failed to start: {e!r}; no trace recorded")
        self.prof = None
        self.annotating = False

    def _close_step_range(self, complete: bool) -> None:
        if self.step_handle is None:
            return
        if self.detector is not None:
            self.detector.step = None
        try:
            torch.ops.profiler._record_function_exit._RecordFunction(self.step_handle)
        finally:
            self.step_handle = None
        if complete:
            self.steps_recorded += 1

    def _finish_profiler(self, complete: bool) -> None:
        """Stop recording, export the trace if any step was recorded. Safe to call twice.
        A Ctrl-C (or SIGTERM) that arrives meanwhile is held until the trace is written, then
        raised: an interrupt just after the last recorded step keeps the run."""
        with _interrupts_held():
            self._finish_profiler_now(complete)

    def _finish_profiler_now(self, complete: bool) -> None:
        partial = self.step_open if (self.step_handle is not None and not complete) else None
        self._close_step_range(complete=complete)
        if self.shapes_handle is not None:  # the script ended inside the shapes step: keep it
            self._complete_shapes_step_at_end()
            return
        if self.shapes_pending:
            self.shapes_pending = False
            self.warnings.append("the script ended before the step that records op shapes (one more after "
                                 "the recorded steps); ops have no shapes, so their costs are unknown")
            if self.detector is not None and complete is False and self.steps_recorded == self.cfg.steps:
                # No forward came after the last recorded step: what the detector saw since is the
                # code after the loop (a final print(loss)), run once, not a per-step sync.
                self.detector.forget_step(self.cfg.steps + 1)
                self.sync_steps -= 1
        self._close_all_ranges()
        self.annotating = False
        self._stop_sync_detector()
        if self.prof is None:
            self._drop_shapes_trace()
            return
        prof, self.prof = self.prof, None
        if self.cuda_run and self.trace_started and torch.cuda.is_initialized():
            try:
                self.peak = torch.cuda.max_memory_allocated()
            except Exception:
                pass
        try:
            prof.stop_trace() if self.trace_started else prof.stop()
        except Exception as e:
            self.warnings.append(f"torch.profiler failed to stop: {e!r}")
            return
        if not self.trace_started or self.steps_recorded == 0:
            return
        trace_dir = self.cfg.trace_dir or tempfile.mkdtemp(prefix="kprof-")
        os.makedirs(trace_dir, exist_ok=True)
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.splitext(os.path.basename(self.script))[0])
        path = os.path.join(trace_dir, f"{stem}.{os.getpid()}.{int(time.time())}.trace.json")
        self._progress("export", path=path)
        try:
            prof.export_chrome_trace(path)
        except Exception as e:
            self.warnings.append(f"could not export the trace to {path}: {e!r}")
            return
        if partial is not None:
            _rename_partial_step(path, partial)
        self.trace_path = path

    def _complete_shapes_step_at_end(self) -> None:
        try:
            self._complete_shapes_step()
        except _StopScript:
            pass

    def _drop_shapes_trace(self) -> None:
        if self.shapes_trace is not None:
            try:
                os.remove(self.shapes_trace)
            except OSError:
                pass
            self.shapes_trace = None

    def _abandon_profile(self) -> None:
        """Drop a profile taken under a step definition that turned out wrong."""
        self._close_step_range(complete=False)
        if self.shapes_handle is not None:
            torch.ops.profiler._record_function_exit._RecordFunction(self.shapes_handle)
            self.shapes_handle = None
        self._drop_shapes_trace()
        self.shapes_pending = False
        self.full_lists = {}
        self.sync_steps = 0
        self.stopped_detector = None
        self._close_all_ranges()
        self.annotating = False
        self._set_quiet(False)
        if self.detector is not None:
            self.detector.uninstall()
            self.detector = None
        if self.prof is not None:
            try:
                self.prof.stop_trace() if self.trace_started else self.prof.stop()
            except Exception:
                pass
            self.prof = None
        self.trace_started = False
        self.steps_recorded = 0

    # ------------------------------------------------------------------ per-step data
    def _close_step_data(self) -> None:
        self.losses_by_step.append(self.loss_cur)
        self.tokens_by_step.append(self.tokens_cur)
        self.loss_cur = []
        self.tokens_cur = 0
        self.scaled.clear()

    def _note_backward(self, tensors: Any) -> None:
        t = tensors[0] if isinstance(tensors, (list, tuple)) and tensors else tensors
        if not isinstance(t, torch.Tensor) or t.numel() != 1:
            return
        pair = self.scaled.get(id(t))
        if pair is not None and pair[0] is t:
            t = pair[1]  # the loss before GradScaler multiplied it
        with torch._C.DisableTorchFunction():
            # `.data`, not `.detach()`: the same alias without autograd, and no aten::detach op
            # in the recorded trace (an op kprof added would be charged to the user's step).
            self.loss_cur.append(t.data)
        self.any_loss = True

    def _loss_dtype(self) -> str | None:
        """The coarsest floating dtype among the recorded losses: a loss returned in bf16 is only
        known to its spacing (0.06 near 12), which bounds how closely two runs can be compared."""
        dts = {t.dtype for step in self.losses_by_step for t in step if t.is_floating_point()}
        return str(max(dts, key=lambda d: torch.finfo(d).eps)) if dts else None

    def _losses(self) -> list[float]:
        if not self.any_loss or not self.losses_by_step:
            return []
        flat = [t for step in self.losses_by_step for t in step]
        values: list[float] = []
        if flat:
            by_device: dict[Any, list[int]] = collections.defaultdict(list)
            for i, t in enumerate(flat):
                by_device[t.device].append(i)
            out = [0.0] * len(flat)
            for dev, idx in by_device.items():
                # One read-back per device, after the script is done.
                vals = torch.stack([flat[i].reshape(()).float() for i in idx]).tolist()
                for i, v in zip(idx, vals):
                    out[i] = v
            values = out
        # With gradient accumulation a step backpropagates several micro-batch losses; scripts
        # scale each by 1/n, so their sum is the step's mean loss.
        result, k = [], 0
        for step in self.losses_by_step:
            n = len(step)
            result.append(sum(values[k : k + n]) if n else float("nan"))
            k += n
        return result

    def _tokens(self) -> int | None:
        counts = [c for c in self.tokens_by_step if c > 0]
        if not counts:
            return None
        return collections.Counter(counts).most_common(1)[0][0]

    # ------------------------------------------------------------------ result
    def _result(self, status: str, error: str | None, exit_code: int, wall: float) -> RawRun:
        if self.cuda_run and self.peak is not None and self.peak > self.cuda_base:
            label = "torch.cuda.max_memory_allocated over the recorded steps"
        else:
            # A CPU run, or a script that allocated nothing on CUDA during the recorded steps on a
            # machine that has it (found on the H200: a CPU-only script reported a CUDA peak of 0
            # in its own process, and in a test process the CUDA memory other tests still held).
            label = "process peak RSS (ru_maxrss), whole run; not GPU memory"
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self.peak = rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux
        message = self.stop_message
        if not self.cfg.detect_syncs:
            self.warnings.append("host syncs were not watched in this run (run without kprof's sync detector)")
        if status == "completed" and self.steps_recorded < self.cfg.steps:
            message = (
                f"the script ended after {self.steps_recorded} of {self.cfg.steps} recorded steps "
                f"(step definition: {self.step_definition()}); it needs "
                f"{self.cfg.warmup} warm-up + {self.cfg.steps} timed + {PROFILER_WARMUP_STEPS} profiler warm-up "
                f"+ {self.cfg.steps} recorded + {SHAPES_STEPS} shapes steps. Run it longer or lower --warmup/--steps."
            )
            if self.mode != "optimizer":
                message += (" A script with no optimizer step (no backward: inference, evaluation) is stepped by "
                            "calls of its outermost module: pass --step forward.")
        elif status == "interrupted":
            message = f"interrupted; {self.steps_recorded} recorded steps kept"
        elif status == "error":
            message = f"the script failed (exit code {exit_code}); {self.steps_recorded} recorded steps kept"
        return RawRun(
            script=self.script,
            argv=self.argv,
            status=status,
            error=error,
            exit_code=exit_code,
            device=device_info(),
            step_definition=self.step_definition(),
            warmup=self.cfg.warmup,
            steps=self.cfg.steps,
            steps_recorded=self.steps_recorded,
            step_times_ms=self.timed.durations_ms(self._cuda_sync),
            profiled_step_times_ms=self.prof_marks.durations_ms(self._cuda_sync),
            peak_memory_bytes=self.peak,
            trace_path=self.trace_path,
            syncs=self.syncs,
            syncs_cpu=self.syncs_cpu,
            losses=self._losses(),
            loss_dtype=self._loss_dtype(),
            tokens_per_step=self._tokens(),
            module_classes=dict(self.module_classes),
            wall_time_s=wall,
            message=message,
            peak_memory_label=label,
            steps_before_timing=self.steps_before,
            warnings=self.warnings + self.compile_recorder.warnings,
            shapes_recorded="every step" if self.cfg.shapes_every_step else "shapes step",
            sync_steps=self.sync_steps,
            memory=self.memory,
            memory_snapshot_path=self.memory_snapshot_path,
            routing=self._routing(),
            root_input_shapes=[{"shapes": [list(x) for x in sig], "calls": n} for sig, n in self.root_shapes.items()],
            inductor_kernels=list(self.compile_recorder.kernels),
            compile_events=list(self.compile_recorder.events),
        )

    def _routing(self) -> list[dict]:
        d = self.stopped_detector or self.detector
        if d is None:
            return []
        try:
            return d.routing_summary()
        except Exception as e:  # the run is still good without the routing histograms
            self.warnings.append(f"could not count the topk routing choices: {e!r}")
            return []


@contextmanager
def _interrupts_held():
    """Hold SIGINT and SIGTERM for the block (main thread only; signal handlers live there) and
    raise KeyboardInterrupt after it if one arrived."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    saved = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        saved[sig] = signal.signal(sig, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    if got:
        raise KeyboardInterrupt("SIGTERM" if signal.SIGTERM in got else "SIGINT")


def _dynamo_count() -> int | None:
    """Dynamo's process-wide count of compiled graphs + frames (0 if never imported, None if its
    internals moved)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"]) + int(sum(counters["frames"].values()))
    except Exception:
        return None


def _dynamo_used(baseline: int | None = 0) -> bool:
    """Whether torch.compile/Dynamo compiled any frame since `baseline` (a `_dynamo_count()`).

    Relative to the session's start: code compiled before kprof installed its hooks was compiled
    with no global hooks, the state removing them returns to, so it does not recompile; only
    what the script compiled under kprof's hooks would. (Absolute counts also broke the timed
    phase of every run after any compile in the same process, e.g. in a test worker.)"""
    now = _dynamo_count()
    if now is None or baseline is None:  # internals moved: assume compiled, keep the hooks (always correct)
        return True
    return now > baseline


def _count_tokens(args: tuple, kwargs: dict) -> int:
    """B*T of the outermost forward's token ids: `input_ids=` or the first 2-D integer tensor."""
    t = kwargs.get("input_ids") if kwargs else None
    if not isinstance(t, torch.Tensor):
        t = None
        for a in (*args, *(kwargs or {}).values()):
            if isinstance(a, torch.Tensor) and a.dim() == 2 and not a.is_floating_point() and not a.is_complex() and a.dtype != torch.bool:
                t = a
                break
    if t is None or t.dim() != 2:
        return 0
    return int(t.shape[0]) * int(t.shape[1])


def _rename_partial_step(path: str, index: int) -> None:
    """Rename the range of a step cut short by an error/interrupt, so analysis skips it."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        text = text.replace(f'"{STEP_RANGE_PREFIX}{index}"', f'"{PARTIAL_STEP_RANGE_PREFIX}{index}"')
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError:
        pass


def _full_tensorlists(prof: Any, warnings_: list[str]) -> dict:
    """{(op name, start in us): {"dims", "strides"}} for every op of a stopped profiler with a
    TensorList argument longer than TRACE_TENSORLIST_LIMIT, read from the profiler's own events,
    which keep the whole list (its chrome trace writes `[]` for it: the H200 Llama runs' foreach
    AdamW ops showed "[0 tensors]"). Keyed for the trace export, whose `ts` is (start ns -
    baseTimeNanoseconds) / 1000 (checked on torch 2.13). The flat event list, not
    experimental_event_tree(): freeing that tree's parent/child cycles after its profiler
    crashed the process in the garbage collector (torch 2.13, 1 run in 2 under pytest)."""
    try:
        events = prof.profiler.kineto_results.events()
    except Exception as e:  # a private API: its loss costs the long lists their shapes, not the run
        warnings_.append(f"could not read the profiler's events for long tensor lists: {e!r}")
        return {}
    out: dict = {}
    for ev in events:
        try:
            types = ev.dtypes()
            if "TensorList" not in types:
                continue
            dims, strides = ev.structured_input_shapes(), ev.structured_input_strides()
        except Exception:  # noqa: BLE001 - one odd event keeps its trace record
            continue
        long = [i for i, (t, d) in enumerate(zip(types, dims))
                if t == "TensorList" and isinstance(d, list) and len(d) > TRACE_TENSORLIST_LIMIT]
        if long:
            out[(ev.name(), ev.start_ns() // 1000)] = {
                "dims": [dims[i] if i in long else None for i in range(len(types))],
                "strides": [strides[i] if i in long and i < len(strides) else None for i in range(len(types))]}
    return out


def _merge_shapes_step(path: str, shapes_path: str, full_lists: dict) -> None:
    """Append the shapes step's host ops and ranges to the trace at `path`, with the long tensor
    lists filled in (`full_lists`). Their ids are dropped: the timed trace's kernels must not link
    to them. The analysis reads the step by its SHAPES_STEP_RANGE (trace.op_table)."""
    with open(path, encoding="utf-8") as f:
        main = json.load(f)
    with open(shapes_path, encoding="utf-8") as f:
        shapes = json.load(f)
    base = int(shapes.get("baseTimeNanoseconds") or 0)
    shift_us = (base - int(main.get("baseTimeNanoseconds") or 0)) / 1e3
    added = []
    for ev in shapes.get("traceEvents") or []:
        if not isinstance(ev, dict) or ev.get("ph") != "X" or ev.get("cat") not in ("cpu_op", "user_annotation"):
            continue
        args = {k: v for k, v in (ev.get("args") or {}).items()
                if k not in ("External id", "Record function id", "Ev Idx", "correlation")}
        us = int((base + round(float(ev["ts"]) * 1e3)) // 1000)
        rec = next((full_lists[k] for k in ((ev.get("name"), us + d) for d in (0, -1, 1)) if k in full_lists), None)
        if rec is not None and isinstance(args.get("Input Dims"), list):
            dims, strides = list(args["Input Dims"]), list(args.get("Input Strides") or [])
            strides += [[] for _ in range(len(dims) - len(strides))]
            for i, d in enumerate(rec["dims"]):
                if d is not None and i < len(dims):
                    dims[i], strides[i] = d, rec["strides"][i] or []
            args["Input Dims"], args["Input Strides"] = dims, strides
        added.append(ev | {"ts": float(ev["ts"]) + shift_us, "args": args})
    main["traceEvents"] = list(main.get("traceEvents") or []) + added
    with open(path, "w", encoding="utf-8") as f:
        json.dump(main, f)


def _tensor_entry(t: torch.Tensor, name: str) -> list:
    """[data_ptr, storage bytes, name, dtype] of one tensor (its whole storage: a view of a
    flat buffer holds the buffer)."""
    with torch._C.DisableTorchFunction():
        try:
            nbytes = t.untyped_storage().nbytes()
        except Exception:  # noqa: BLE001 - e.g. a tensor subclass without a storage
            nbytes = t.numel() * t.element_size()
        return [int(t.data_ptr()), int(nbytes), name, str(t.dtype).replace("torch.", "")]


# Ranges of the shapes step the memory breakdown reads: module forwards, the optimizer step and
# the backward nodes (their `Sequence number` names the forward op, hence the module).
_MEMORY_RANGE_PREFIXES = (MODULE_RANGE_PREFIX, "Optimizer.step#", "autograd::engine::evaluate_function:",
                          SHAPES_STEP_RANGE)


def _memory_record(shapes_path: str, tensors: dict, extra: dict, cuda: bool) -> dict:
    """The shapes step's memory record from its exported trace: the profiler's allocation events
    of the model's device ([t_us, addr, bytes (+alloc/-free), total allocated, total reserved]),
    ranges ([name, t0_us, t1_us, tid, sequence number or -1]) and forward ops with a sequence
    number ([t_us, seq, tid]). Times are microseconds since the Unix epoch (the trace's
    baseTimeNanoseconds added back), the clock of the allocator's history too."""
    with open(shapes_path, encoding="utf-8") as f:
        doc = json.load(f)
    base_us = int(doc.get("baseTimeNanoseconds") or 0) / 1e3
    want = 1 if cuda else 0  # the profiler's Device Type: 0 CPU, 1 CUDA
    events, ranges, fwd = [], [], []
    for ev in doc.get("traceEvents") or []:
        if not isinstance(ev, dict):
            continue
        name, args = ev.get("name"), ev.get("args") or {}
        if name == "[memory]":
            if args.get("Device Type") == want and "Addr" in args:
                events.append([float(ev["ts"]) + base_us, int(args["Addr"]), int(args.get("Bytes") or 0),
                               int(args.get("Total Allocated") or 0), int(args.get("Total Reserved") or 0)])
            continue
        if ev.get("ph") != "X" or not isinstance(name, str):
            continue
        t0 = float(ev["ts"]) + base_us
        seq = args.get("Sequence number")
        seq = int(seq) if isinstance(seq, (int, float)) else -1
        if name.startswith(_MEMORY_RANGE_PREFIXES):
            ranges.append([name, t0, t0 + float(ev.get("dur") or 0), ev.get("tid"), seq])
        elif seq >= 0 and ev.get("cat") == "cpu_op":
            fwd.append([t0, seq, ev.get("tid")])
    events.sort(key=lambda e: e[0])
    return {"source": "profiler", "device": "cuda" if cuda else "cpu", "events": events, "ranges": ranges,
            "forward_ops": fwd, "tensors": tensors, "cuda": extra}
