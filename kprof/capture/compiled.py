"""What torch.compile did while the script ran: Inductor's kernels and Dynamo's graph breaks and
recompiles, recorded at compile time for kprof/analyze/compiled.py.

Compiled graphs do not call the module hooks the runner's `kprof.module:` ranges come from, so
the trace alone cannot say which module an Inductor kernel (`triton_poi_fused_add_0`,
`cpp_fused_gelu_view_1`) belongs to. Inductor knows: every kernel it generates is made from
post-grad FX nodes (`origins`) whose `meta` carries the module stack (`nn_module_stack`, or
`fwd_nn_module_stack` on backward nodes), the aten op they came from (`original_aten`) and their
fake tensors (`val`). `KernelRecorder` wraps the function Inductor calls for each generated
kernel with its nodes (`torch._inductor.debug.set_kernel_post_grad_provenance_tracing`, called
whatever `provenance_tracking_level` is; it returns at once when tracking is off) and keeps,
per kernel call site: the graph, fwd/bwd, the kernel name, the modules, the aten ops, each
node's op and argument shapes (for the cost model's FLOP formulas) and the tensors the kernel
reads from and writes to memory (for its bytes).

Checked on torch 2.13 (CPU, Inductor's C++ backend). Private APIs: anything missing turns the
recorder off with a warning, and the run is profiled as before.

While recording, Inductor's FX graph and AOTAutograd caches are off (a cache hit generates no
code, so no kernel would be seen; compile time is outside the recorded steps), and on a CPU each
C++ kernel is wrapped in a profiler range (`cpp.enable_kernel_profile`, named
`graph_<id>_<kernel>`; Triton launches have their own range, named after the kernel).

Graph breaks and recompiles come from Dynamo's `graph_breaks` and `recompiles` log artifacts
(torch._logging), read by a handler on their loggers rather than printed.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

# Inductor modules that imported the hook function by name (`from ..debug import ...`); the
# scheduler and ir import it from torch._inductor.debug at each call.
_HOOK_HOLDERS = ("torch._inductor.debug", "torch._inductor.codegen.cpp", "torch._inductor.codegen.triton")
_HOOK = "set_kernel_post_grad_provenance_tracing"
_LOG_ARTIFACTS = ("graph_breaks", "recompiles")
# Where torch 2.13 logs them (symbolic_convert.py and guards.py).
_LOG_LOGGERS = ("torch._dynamo.symbolic_convert.__graph_breaks", "torch._dynamo.guards.__recompiles")

# An FX node's path in nn_module_stack is relative to the compiled frame's locals: "L['self'].
# layers.0.mlp" (or "L['self']._modules['layers']._modules['0']" on some versions).
# The frame may be the module's call itself, with the module as an argument: "L['args'][0].model".
_ROOT_RE = re.compile(r"^[LG]\[['\"][^'\"]+['\"]\](?:\[[^\]]+\])*\.?")
_MODULES_RE = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]|\[['\"]?([^'\"\]]+)['\"]?\]")


def module_path(stack_entry: str) -> str:
    """'L['self'].layers.0.mlp' -> 'layers.0.mlp' (the path under the compiled module)."""
    s = "." + _ROOT_RE.sub("", str(stack_entry))
    s = _MODULES_RE.sub(lambda m: "." + (m.group(1) or m.group(2)), s)
    return s.strip(".")


def _tensor(v: Any) -> tuple[list[int], str, list[int]] | None:
    try:
        import torch

        if isinstance(v, torch.Tensor):
            shape = [int(d) for d in v.shape]
            return shape, str(v.dtype).removeprefix("torch."), [int(s) for s in v.stride()]
    except Exception:  # symbolic sizes (dynamic shapes): no static cost  # noqa: BLE001
        return None
    return None


def _arg_record(a: Any) -> tuple[list, str, list, str]:
    """One argument as the profiler records it: (shape, dtype or type name, strides, concrete)."""
    import torch.fx

    if isinstance(a, torch.fx.Node):
        t = _tensor(a.meta.get("val"))
        return (t[0], t[1], t[2], "") if t else ([], "", [], "")
    if isinstance(a, bool):
        return [], "Scalar", [], str(a)
    if isinstance(a, (int, float)):
        return [], "Scalar", [], str(a)
    if isinstance(a, (list, tuple)) and all(isinstance(x, int) for x in a):
        return [], "ScalarList", [], str(list(a))
    return [], "", [], ""


def _node_record(n: Any) -> dict | None:
    """The node's op and arguments in the trace's form (see costmodel.inclusive_cost)."""
    target = getattr(n, "target", None)
    pkt = getattr(target, "_overloadpacket", None)
    if n.op != "call_function" or pkt is None:
        return None
    name = str(pkt).replace(".", "::", 1)  # "aten.mul" -> "aten::mul"
    values = list(n.args)
    schema = getattr(target, "_schema", None)
    if schema is not None:  # every schema argument, as the profiler records them (defaults too)
        for a in schema.arguments[len(values):]:
            if a.kwarg_only and a.name.startswith("out"):
                break
            values.append(n.kwargs.get(a.name, a.default_value if a.has_default_value() else None))
    args = [_arg_record(a) for a in values]
    # A tensor's type here is its dtype name, which the cost model reads as a tensor.
    return {"op": name, "shapes": [a[0] for a in args], "dtypes": [a[1] for a in args],
            "strides": [a[2] for a in args], "concrete": [a[3] for a in args],
            "types": [a[1] for a in args]}


def _modules_of(n: Any) -> tuple[str, str] | None:
    stack = n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    path, cls = list(stack.values())[-1]
    return module_path(path), getattr(cls, "__name__", str(cls).rsplit(".", 1)[-1].rstrip("'>"))


def _memory(nodes: list) -> tuple[list, list]:
    """Tensors the fused nodes read from memory (arguments made outside them) and write (their
    values used outside them, or the graph's outputs), as [shape, dtype] pairs. Views are not
    written: they alias their base."""
    import torch.fx

    inside = set(nodes)
    reads, writes, seen = [], [], set()
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in seen:
                seen.add(a)
                t = _tensor(a.meta.get("val"))
                if t:
                    reads.append([t[0], t[1]])
        if any(u not in inside for u in n.users) and isinstance(n, torch.fx.Node):
            pkt = str(getattr(n.target, "_overloadpacket", ""))
            if pkt.split(".")[-1] in ("view", "reshape", "permute", "t", "expand", "_unsafe_view",
                                      "squeeze", "unsqueeze", "transpose", "as_strided", "slice", "select"):
                continue
            t = _tensor(n.meta.get("val"))
            if t:
                writes.append([t[0], t[1]])
    return reads, writes


def kernel_record(node_schedule: Any, kernel_name: str, is_extern: bool, graph: Any) -> dict:
    """One kernel call site: see the module docstring. Pure over Inductor's objects."""
    if is_extern or hasattr(node_schedule, "origins"):
        origins = list(getattr(node_schedule, "origins", ()) or ())
    else:
        origins = []
        for sn in node_schedule:
            ir_node = getattr(sn, "node", None)
            origins.extend(getattr(ir_node, "origins", ()) or ())
    nodes = sorted({o for o in origins if getattr(o, "op", "") == "call_function"}, key=lambda o: o.name)
    # An extern kernel's own node (the mm of a Linear) says where it is; its other origins are
    # the views and producers of its inputs, often in the module before.
    own = getattr(node_schedule, "origin_node", None) if is_extern else None
    mods = sorted({m for m in (_modules_of(n) for n in ([own] if own is not None else nodes)) if m is not None})
    aten = sorted({str(getattr(n.meta.get("original_aten"), "_overloadpacket", "")).replace(".", "::", 1)
                   for n in nodes if n.meta.get("original_aten") is not None} - {""})
    rec = {
        "graph": getattr(graph, "graph_id", None),
        "backward": bool(getattr(graph, "is_backward", False)),
        "kernel": str(kernel_name),
        "extern": bool(is_extern),
        "modules": [list(m) for m in mods],
        "aten": aten,
    }
    if not is_extern:  # extern kernels (mm, addmm, SDPA) are aten ops in the trace, costed there
        rec["nodes"] = [r for r in (_node_record(n) for n in nodes) if r is not None]
        rec["reads"], rec["writes"] = _memory(nodes)
    return rec


class _LogCatcher(logging.Handler):
    def __init__(self, out: list) -> None:
        super().__init__(logging.DEBUG)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        try:
            kind = "graph_break" if record.name.endswith("__graph_breaks") else "recompile"
            self.out.append({"kind": kind, "message": record.getMessage()})
        except Exception:  # noqa: BLE001  (a log line must never break the user's compile)
            pass


class KernelRecorder:
    """Install with `start()` before the script runs, `stop()` after; `kernels` and `events`
    (raw log messages: {"kind": "graph_break" | "recompile", "message": ...}) hold what was seen."""

    def __init__(self, cpu_kernel_ranges: bool = True) -> None:
        self.kernels: list[dict] = []
        self.events: list[dict] = []
        self.warnings: list[str] = []
        self.cpu_kernel_ranges = cpu_kernel_ranges
        self._undo: list = []
        self._started = False

    def _hook(self, orig):
        def hook(node_schedule, kernel_name, is_extern=False, *args, **kwargs):
            try:
                from torch._inductor.virtualized import V

                self.kernels.append(kernel_record(node_schedule, kernel_name, is_extern, V.graph))
            except Exception as e:  # noqa: BLE001  (never break the user's compile)
                if not self.warnings:
                    self.warnings.append(f"kprof could not read an Inductor kernel's nodes: {e!r}")
            return orig(node_schedule, kernel_name, is_extern, *args, **kwargs)

        return hook

    def start(self) -> None:
        """Idempotent. The runner calls it at the script's first torch.compile call: importing
        Inductor's config costs seconds, which a script that never compiles should not pay."""
        import importlib

        if self._started:
            return
        self._started = True
        try:
            import torch._functorch.config as fconfig
            import torch._inductor.config as iconfig

            for mod, key, value in ((iconfig, "fx_graph_cache", False), (fconfig, "enable_autograd_cache", False),
                                    (iconfig.cpp, "enable_kernel_profile", self.cpu_kernel_ranges)):
                if hasattr(mod, key):
                    old = getattr(mod, key)
                    setattr(mod, key, value)
                    self._undo.append(lambda m=mod, k=key, v=old: setattr(m, k, v))
            orig = importlib.import_module(_HOOK_HOLDERS[0]).__dict__[_HOOK]
            hook = self._hook(orig)
            for name in _HOOK_HOLDERS:
                # Codegen modules not imported yet will import the hook from debug by name.
                mod = sys.modules.get(name)
                if mod is not None and getattr(mod, _HOOK, None) is orig:
                    setattr(mod, _HOOK, hook)
                    self._undo.append(lambda m=mod: setattr(m, _HOOK, orig))
        except Exception as e:  # noqa: BLE001
            self.warnings.append(f"Inductor kernels will not be attributed (torch internals moved: {e!r})")
        self._watch_logs()

    def _watch_logs(self) -> None:
        handler = _LogCatcher(self.events)
        try:
            # Dynamo builds a recompile message only when the artifact is on in torch._logging's
            # state (guards.is_recompiles_enabled, torch 2.13); the loggers below keep it quiet.
            from torch._logging._internal import log_state

            for art in _LOG_ARTIFACTS:
                if not log_state.is_artifact_enabled(art):
                    log_state.enable_artifact(art)
                    self._undo.append(lambda a=art: log_state.artifact_names.discard(a))
        except Exception as e:  # noqa: BLE001
            self.warnings.append(f"recompiles may not be diagnosed (torch._logging moved: {e!r})")
        # Created here if Dynamo has not imported yet: torch._logging.getArtifactLogger returns
        # the same logger later and keeps its level (it only ever turns propagation off).
        names = set(_LOG_LOGGERS) | {n for n in logging.Logger.manager.loggerDict
                                     if any(n.endswith("__" + a) for a in _LOG_ARTIFACTS)}
        for name in sorted(names):
            lg = logging.getLogger(name)
            old = (lg.level, lg.propagate)
            # Captured, not printed: the artifact goes to this handler only while kprof runs.
            lg.setLevel(logging.DEBUG)
            lg.propagate = False
            lg.addHandler(handler)
            self._undo.append(lambda lg=lg, old=old: (lg.removeHandler(handler), lg.setLevel(old[0]),
                                                      setattr(lg, "propagate", old[1])))

    def stop(self) -> None:
        while self._undo:
            try:
                self._undo.pop()()
            except Exception as e:  # noqa: BLE001
                self.warnings.append(f"kprof could not undo a compile hook: {e!r}")
