"""Find device-to-host synchronizations in a training step and blame the user's source line.

A host sync stalls the CPU until the GPU has drained its queue, so the next kernels are
launched late and the GPU idles; in a step that is otherwise launch-bound one `loss.item()` per
step can cost as much as the whole optimizer. The profiler shows the stall (a long
`cudaStreamSynchronize`/`cudaMemcpyAsync`) but not which line of the script caused it.

How: a `TorchFunctionMode` sees every torch function and Tensor method call on the host. A small
table (`_CHECKS`, below) maps the calls that must wait for the device to a kind string; for
those, the stack is walked up to the innermost frame in the user's code (the script or its
folder, never torch, kprof, the stdlib or site-packages) and the event is counted under
(kind, file, line). `torch.cuda.synchronize` is patched while the detector is installed (it is
not a tensor function, so the mode cannot see it).

On a CPU-only run nothing really syncs, but the same calls would on a GPU; they are reported
with `would_sync_on_gpu: True`, so a planted `.item()` shows up in CI and in the CPU demo.
On a CUDA run only calls on CUDA tensors are counted (`.item()` of a CPU tensor is free).

Routing (MoE): while `routing` is on (the runner sets it for the shapes step only), every
`topk` call also leaves a reference to its indices under the current module path (`where`). No
op runs then: the per-choice counts are taken by `routing_summary()` after the profiler stopped,
so the recorded op sequence is the script's own. That is the tokens-per-expert histogram the MoE
load-imbalance diagnosis reads, for any router that picks its experts with `topk`.

Not seen: syncs inside compiled regions (Dynamo graph-breaks on them; the broken-out part runs
eagerly and is seen), `torch.cuda.Stream.synchronize`/`Event.synchronize`, and syncs in
C++-only paths (e.g. `torch.linalg` error checks).
"""

from __future__ import annotations

import importlib.util
import linecache
import os
import site
import sys
import sysconfig
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

# A check gets (args, kwargs) of the intercepted call and returns
# (kind, tensor that would be read back or None, counts on a CPU-only run) or None (no sync).
_Check = Callable[[tuple, dict], "tuple[str, Any, bool] | None"]


def _first_tensor(args: tuple) -> Any:
    return args[0] if args and isinstance(args[0], torch.Tensor) else None


def _always(kind: str) -> _Check:
    def check(args: tuple, kwargs: dict):
        return kind, _first_tensor(args), True

    return check


def _data_dependent(name: str) -> _Check:
    return _always(f"{name} (data-dependent shape)")


def _check_to(args: tuple, kwargs: dict):
    # Tensor.to(self, device/dtype/tensor, ..., non_blocking=...): parse like torch does.
    try:
        device, _dtype, non_blocking, _fmt = torch._C._nn._parse_to(*args[1:], **kwargs)
    except Exception:
        return None
    if device is None or device.type != "cpu" or non_blocking:
        return None
    # Not counted on CPU-only runs: there a script's `.to(device)` resolves to "cpu" too, and
    # moving data to the compute device cannot be told apart from reading results back.
    return "Tensor.to(cpu)", _first_tensor(args), False


def _check_cpu(args: tuple, kwargs: dict):
    return "Tensor.cpu", _first_tensor(args), True


def _check_copy(args: tuple, kwargs: dict):
    # dst.copy_(src, non_blocking=False): a blocking copy from the device into host memory.
    # Not counted on CPU-only runs: there every copy_ is host-to-host, mostly not meant as a
    # read-back (EMA updates, buffers), so it would be noise.
    if len(args) < 2 or not isinstance(args[1], torch.Tensor):
        return None
    non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
    if non_blocking or args[0].device.type != "cpu":
        return None
    return "Tensor.copy_ (device to host)", args[1], False


def _is_mask(index: Any) -> bool:
    if isinstance(index, torch.Tensor):
        return index.dtype in (torch.bool, torch.uint8)
    if isinstance(index, (tuple, list)):
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in index)
    return False


def _check_getitem(args: tuple, kwargs: dict):
    if len(args) >= 2 and _is_mask(args[1]):
        return "Tensor.__getitem__[bool mask] (data-dependent shape)", args[0], True
    return None


def _check_setitem(args: tuple, kwargs: dict):
    # x[mask] = scalar (or a 1-element CPU tensor) is turned into masked_fill_ by ATen
    # (canDispatchToMaskedFill in TensorAdvancedIndexing.cpp): no sync. Any other value goes
    # through nonzero() on the mask: a sync.
    if len(args) < 3 or not _is_mask(args[1]):
        return None
    value = args[2]
    if not isinstance(value, torch.Tensor) or (value.numel() == 1 and value.device.type == "cpu"):
        return None
    return "Tensor.__setitem__[bool mask] (data-dependent shape)", args[0], True


def _check_where(args: tuple, kwargs: dict):
    # torch.where(cond) is nonzero(cond, as_tuple=True); torch.where(cond, a, b) is elementwise.
    if len(args) == 1 and not kwargs:
        return "torch.where(cond) (data-dependent shape)", args[0], True
    return None


def _check_repeat_interleave(args: tuple, kwargs: dict):
    # Output length is sum(repeats): known on the host only for an int repeats or output_size=.
    if kwargs.get("output_size") is not None:
        return None
    if len(args) == 1 and isinstance(args[0], torch.Tensor) and "repeats" not in kwargs:
        repeats = args[0]  # torch.repeat_interleave(repeats)
    else:
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    if isinstance(repeats, torch.Tensor) and repeats.numel() > 1:
        return "repeat_interleave(tensor repeats) (data-dependent shape)", repeats, True
    return None


T = torch.Tensor
_CHECKS: dict[Any, _Check] = {
    T.item: _always("Tensor.item"),
    T.tolist: _always("Tensor.tolist"),
    T.numpy: _always("Tensor.numpy"),
    T.__array__: _always("Tensor.__array__ (numpy conversion)"),
    T.cpu: _check_cpu,
    T.to: _check_to,
    T.copy_: _check_copy,
    # print(t), str(t), f"{t}" all land in one of these two (Tensor has no __str__).
    T.__repr__: _always("Tensor.__repr__ (print/str of a tensor)"),
    T.__format__: _always("Tensor.__format__ (f-string/format of a tensor)"),
    T.__bool__: _always("Tensor.__bool__ (if tensor / bool(tensor))"),
    T.__int__: _always("Tensor.__int__"),
    T.__float__: _always("Tensor.__float__"),
    T.__index__: _always("Tensor.__index__"),
    T.__contains__: _always("Tensor.__contains__ (x in tensor)"),
    T.is_nonzero: _always("Tensor.is_nonzero"),
    torch.equal: _always("torch.equal"),
    T.equal: _always("Tensor.equal"),
    torch.allclose: _always("torch.allclose"),
    T.allclose: _always("Tensor.allclose"),
    torch.nonzero: _data_dependent("torch.nonzero"),
    T.nonzero: _data_dependent("Tensor.nonzero"),
    torch.argwhere: _data_dependent("torch.argwhere"),
    T.argwhere: _data_dependent("Tensor.argwhere"),
    torch.masked_select: _data_dependent("torch.masked_select"),
    T.masked_select: _data_dependent("Tensor.masked_select"),
    torch.unique: _data_dependent("torch.unique"),
    T.unique: _data_dependent("Tensor.unique"),
    torch.unique_consecutive: _data_dependent("torch.unique_consecutive"),
    T.unique_consecutive: _data_dependent("Tensor.unique_consecutive"),
    # bincount reads max(input) back to size its output.
    torch.bincount: _data_dependent("torch.bincount"),
    T.bincount: _data_dependent("Tensor.bincount"),
    torch.where: _check_where,
    torch.repeat_interleave: _check_repeat_interleave,
    T.repeat_interleave: _check_repeat_interleave,
    T.__getitem__: _check_getitem,
    T.__setitem__: _check_setitem,
}
del T


_TOPK = frozenset({torch.topk, torch.Tensor.topk})
MAX_ROUTING_CHOICES = 1 << 16


def _is_topk(func: Any) -> bool:
    try:
        return func in _TOPK
    except TypeError:  # an unhashable callable: not topk
        return False


# torch files that only forward a call to __torch_function__ (Tensor.__repr__, torch.unique, ...):
# frames in them are skipped when asking who made the call.
_TORCH_DIR = os.path.dirname(torch.__file__)
_PLUMBING = frozenset(
    os.path.join(_TORCH_DIR, f) for f in ("overrides.py", "_tensor.py", "functional.py", "_jit_internal.py")
)


def _norm_dir(path: str) -> str:
    return os.path.join(os.path.realpath(path), "")


def _library_dirs() -> list[str]:
    """Folders whose frames are never the user's: torch, kprof (and kprof.kernels), the stdlib
    and every site-packages, so a script folder that holds a virtualenv still blames the script."""
    # Located, not imported: capture sits below the kernels and the package's top level.
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dirs = {os.path.dirname(torch.__file__), here}
    try:
        spec = importlib.util.find_spec("kprof.kernels")
        if spec is not None and spec.origin:
            dirs.add(os.path.dirname(spec.origin))
    except Exception:  # a broken kernels package must not hide syncs
        pass
    paths = sysconfig.get_paths()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        if paths.get(key):
            dirs.add(paths[key])
    try:
        dirs.update(site.getsitepackages())
        dirs.add(site.getusersitepackages())
    except Exception:  # site can be stripped down in embedded interpreters
        pass
    return sorted(_norm_dir(d) for d in dirs if d)


@dataclass
class _Site:
    kind: str
    file: str
    line: int
    code: str
    function: str
    via: str | None
    real: bool  # a device tensor was read back (a real sync), or a CPU run's would-be sync
    count: int = 0
    steps: set = field(default_factory=set)
    by_step: dict = field(default_factory=dict)  # step -> calls in it


class SyncDetector(TorchFunctionMode):
    """Counts host syncs by (kind, file, line) while `step` is not None.

    `install()` pushes the mode and patches torch.cuda.synchronize; `uninstall()` undoes both,
    even if other modes were pushed on top in the meantime. Set `step` to the recorded step
    index to count, or to None to pass calls through untouched.
    """

    def __init__(self, script: str, *, cuda_run: bool):
        super().__init__()
        self.script = os.path.realpath(script)
        self.user_dir = _norm_dir(os.path.dirname(self.script))
        self.cuda_run = cuda_run
        self.step: int | None = None
        self._sites: dict[tuple[str, str, int], _Site] = {}
        self._lib_dirs = _library_dirs()
        self._own_dirs = [_norm_dir(os.path.dirname(torch.__file__)), _norm_dir(os.path.dirname(os.path.dirname(__file__)))]  # kprof/
        self._is_user: dict[str, bool] = {}
        self._is_own: dict[str, bool] = {}
        self._installed = False
        self._orig_cuda_sync: Callable | None = None
        self.routing = False  # record topk indices (the shapes step)
        self.where: Callable[[], str] | None = None  # the current module path, from the runner
        self._topk: list[tuple] = []  # (module, k, choices, dim, indices, file:line) per topk call

    # -- the mode ----------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Under Dynamo tracing this folds to a plain call: nothing recorded, no graph break.
        # is_compiling() must come first: Dynamo would otherwise guard on `self.step` and
        # recompile at every recorded step.
        if torch.compiler.is_compiling():
            return func(*args, **kwargs)
        if self.step is not None:
            try:
                check = _CHECKS.get(func)
            except TypeError:  # an unhashable callable: not one of ours
                check = None
            if check is not None:
                try:
                    hit = check(args, kwargs)
                except Exception:  # a check must never change the script's behaviour
                    hit = None
                if hit is not None:
                    kind, tensor, counts_on_cpu = hit
                    # Both kinds are kept; summary() reports one set, by whether the script used
                    # the GPU (known only at the end: a script on the CPU of a GPU machine is a
                    # CPU run, H200 2026-11-29).
                    if self.cuda_run and isinstance(tensor, torch.Tensor) and tensor.device.type not in ("cpu", "meta"):
                        self._record(kind, real=True)
                    elif counts_on_cpu and not self._called_by_torch():
                        # On a CPU run torch's own calls are skipped: torch code reads back
                        # host-side tensors on purpose (AdamW's `step` counter is a CPU tensor
                        # even for CUDA params), which would be false alarms here.
                        self._record(kind, real=False)
        if self.routing and _is_topk(func):
            out = func(*args, **kwargs)
            try:
                self._keep_topk(args, kwargs, out)
            except Exception:  # recording must never change the script's behaviour
                pass
            return out
        return func(*args, **kwargs)

    def _keep_topk(self, args: tuple, kwargs: dict, out: Any) -> None:
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        k = kwargs.get("k", args[1] if len(args) > 1 else None)
        dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
        idx = getattr(out, "indices", None)
        if x is None or not isinstance(k, int) or not isinstance(idx, torch.Tensor) or x.dim() == 0:
            return
        choices = x.shape[dim]
        # A router chooses k of n experts, k < n; 2**16 bounds the histogram (DeepSeek-V3: 256).
        if 0 < k < choices <= MAX_ROUTING_CHOICES:
            where = self.where() if self.where is not None else ""
            self._topk.append((where, k, int(choices), int(dim) % x.dim(), idx, self._caller()))

    def _caller(self) -> str:
        """file:line of the innermost frame outside torch and kprof: the line that called topk
        (in the script, or in a library such as transformers)."""
        frame = sys._getframe(2)
        while frame is not None and self._torch_or_kprof(frame.f_code.co_filename):
            frame = frame.f_back
        out = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else ""
        del frame
        return out

    def routing_summary(self) -> list[dict]:
        """Per (module, k, choices): how many times each choice was picked by the topk calls of
        the routing steps, summed over calls; one record each, in call order. Call it after
        the profiler stopped (it runs bincount, a sync on a GPU)."""
        acc: dict[tuple[str, int, int], dict] = {}
        for where, k, n, dim, idx, site in self._topk:
            rec = acc.setdefault((where, k, n), {"module": where, "k": k, "choices": n, "calls": 0, "source": site,
                                                  "counts": torch.zeros(n, dtype=torch.int64)})
            flat = idx.detach().movedim(dim, -1).reshape(-1).to("cpu", torch.int64)
            rec["counts"] += torch.bincount(flat.clamp(0, n - 1), minlength=n)[:n]
            rec["calls"] += 1
        self._topk.clear()
        return [{**r, "counts": r["counts"].tolist()} for r in acc.values()]

    # -- install / uninstall -----------------------------------------------------------------
    def install(self) -> None:
        if self._installed:
            return
        self.__enter__()
        self._orig_cuda_sync = torch.cuda.synchronize
        orig = self._orig_cuda_sync
        detector = self

        def synchronize(device=None):
            if detector.step is not None:
                detector._record("torch.cuda.synchronize", real=detector.cuda_run)
            return orig(device)

        synchronize.__wrapped__ = orig  # type: ignore[attr-defined]
        torch.cuda.synchronize = synchronize
        self._installed = True

    def uninstall(self) -> None:
        if not self._installed:
            return
        self._installed = False
        self.step = None
        if self._orig_cuda_sync is not None:
            torch.cuda.synchronize = self._orig_cuda_sync
        _remove_mode(self)

    # -- attribution -------------------------------------------------------------------------
    def _user_file(self, filename: str) -> bool:
        known = self._is_user.get(filename)
        if known is None:
            real = os.path.realpath(filename) if not filename.startswith("<") else ""
            known = bool(real) and (real == self.script or real.startswith(self.user_dir))
            known = known and not any(real.startswith(d) for d in self._lib_dirs)
            self._is_user[filename] = known
        return known

    def _torch_or_kprof(self, filename: str) -> bool:
        known = self._is_own.get(filename)
        if known is None:
            real = os.path.realpath(filename) if not filename.startswith("<") else ""
            known = not real or any(real.startswith(d) for d in self._own_dirs)
            self._is_own[filename] = known
        return known

    def _called_by_torch(self) -> bool:
        """Whether the intercepted call was made by torch's own code (not through its
        __torch_function__ plumbing on behalf of someone else)."""
        frame = sys._getframe(2)
        while frame is not None:
            fname = frame.f_code.co_filename
            if fname == __file__ or fname in _PLUMBING:
                frame = frame.f_back
                continue
            own = self._torch_or_kprof(fname) and not fname.startswith("<")
            del frame
            return own
        return False

    def _record(self, kind: str, real: bool) -> None:
        frame = sys._getframe(1)
        user = None
        via = None
        while frame is not None:
            fname = frame.f_code.co_filename
            if self._user_file(fname):
                user = frame
                break
            if via is None and not self._torch_or_kprof(fname):
                via = f"{fname}:{frame.f_lineno}"
            frame = frame.f_back
        if user is None:
            file, line, function = "<unknown>", 0, "<unknown>"
        else:
            file, line, function = user.f_code.co_filename, user.f_lineno, user.f_code.co_name
        del frame, user
        key = (kind, file, line, real)
        s = self._sites.get(key)
        if s is None:
            code = linecache.getline(file, line).strip() if line else ""
            s = self._sites[key] = _Site(kind, file, line, code, function, via, real)
        s.count += 1
        if self.step is not None:
            s.steps.add(self.step)
            s.by_step[self.step] = s.by_step.get(self.step, 0) + 1

    def forget_step(self, step: int) -> None:
        """Drop the calls counted in `step`: it turned out not to be a step (the code after the
        script's training loop ran where kprof waited for one more step)."""
        for key, s in list(self._sites.items()):
            n = s.by_step.pop(step, 0)
            s.count -= n
            s.steps.discard(step)
            if s.count <= 0:
                del self._sites[key]

    def summary(self, cuda_used: bool | None = None) -> list[dict]:
        """One dict per (kind, file, line), most frequent first: the real syncs of a run that used
        the GPU (`cuda_used`, default: a CUDA machine), else the calls that would sync on one."""
        real = self.cuda_run if cuda_used is None else bool(cuda_used)
        rows = [
            {
                "kind": s.kind,
                "file": s.file,
                "line": s.line,
                "code": s.code,
                "function": s.function,
                "count": s.count,
                "steps": sorted(s.steps),
                # On a CPU-only run nothing really waits; these calls would on a GPU.
                "would_sync_on_gpu": not real,
                "real": real,
                "via": s.via,
            }
            for s in self._sites.values() if s.real == real
        ]
        rows.sort(key=lambda r: (-r["count"], r["file"], r["line"], r["kind"]))
        return rows


def _remove_mode(mode: TorchFunctionMode) -> None:
    """Pop `mode` from the torch-function mode stack even if the script pushed modes above it
    (e.g. a `with torch.device("cuda"):` opened in one step and closed in a later one):
    pop down to it, drop it, push the others back in order."""
    from torch._C import _pop_torch_function_stack, _push_on_torch_function_stack
    from torch.overrides import _get_current_function_mode_stack

    stack = _get_current_function_mode_stack()
    if mode not in stack:
        return
    above = []
    while True:
        top = _pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        _push_on_torch_function_stack(m)
