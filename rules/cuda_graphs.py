"""CUDA graphs for a launch-bound step: the model's forward (and so its backward) compiled with
torch.compile(mode="reduce-overhead"), installed on the live model with id `cuda_graphs`.

Why reduce-overhead and not torch.cuda.make_graphed_callables: CUDA graph trees (what
reduce-overhead runs under Inductor) record the forward and the backward as graphs, copy
non-static inputs into the graph's own buffers, treat parameters as static (the optimizer steps
them in place, so their addresses never change and nothing is copied), re-record per new input
shape, and give the RNG of dropout a graph-safe seed. make_graphed_callables needs sample inputs
with `requires_grad` set as the real ones will be, captures eagerly (no fusion on top), refuses
modules with hooks registered and can't replay at a shape it wasn't captured at. Reduce-overhead also fuses the elementwise ops between the matmuls, so fewer kernels
are left to launch even before the graph replays them in one call.

Installed like every kprof patch (kprof/patching/install.py): an instance-level `forward` on the
model's root module, proven at the model's first real call, before any graph is captured: the
original forward and the compiled one run forward and backward on copies of that call's inputs
and are compared, outputs and every parameter's gradient (kprof/patching/verify.py). That first
run of the compiled code is Inductor's compile plus CUDA graph trees' warm-up run, which records
nothing; the graph is captured at the next call, from the same kernels. A wrong compile is
reverted there; the loss watch of `kprof apply` covers the steps after. A call at a new input
shape is verified again (up to install.MAX_RECHECKS), then compiled and recorded at that shape.

Conditions, checked on the live model (`plan`), each declined with its reason: the model's
parameters and buffers on one CUDA device (on a CPU, reduce-overhead only compiles), the model
not already compiled (torch.compile / Module.compile: graphs are the compile's own mode to set),
and no dropout active in training mode (Inductor draws its own random numbers, so the compiled
forward can't be checked against eager's masks; a functional dropout the structure can't see
fails verification and is reverted). At each verification the inputs must be on the model's
device (`check`): a CPU tensor flowing into the graph leaves it uncaptured. The profile's side
(static input shapes over the recorded steps, no host sync inside the forward, launch-bound, not
compiled) is the `cuda_graphs` diagnosis in rules/diagnoses/launch_bound.py.

Torch's CUDA graph pitfalls: outputs live in the graph's memory pool and the next replay writes
them again. In training, graph trees start a new generation at the forward after the previous
backward ran (no torch.compiler.cudagraph_mark_step_begin needed), so a step's outputs are valid
through its backward; torch raises, not returns stale data, when one is read after the next
forward. A 0-dim output (a loss the forward computes) is cloned out of the pool, because scripts
and kprof's runner keep losses across steps and read them later; larger outputs are not (a
copy of the logits would cost their memory again).

In the ablation it is one group of its own (`wraps`: the model's own forward runs inside it, so
kprof's other patches on its children still run and are switched apart). Switching one of those
changes what the compiled forward calls: Dynamo compiles and records that configuration once (the
ablation's warm block runs each configuration once), then replays it. The runner keeps its global
module hooks through the timed steps of a run in which Dynamo compiled anything (removing them
would recompile: kprof/capture/runner.py `_set_quiet`), this patch's compile included, so the
ablation's eager configurations pay that hook cost per module call and its measured saving is
high by that much; the after run, timed in its own process against the plan's run, is not.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from kprof.rules.engine import ProfilePattern, Rule

ID = "cuda_graphs"

_COMPILED = [0]  # Dynamo graphs compiled by this patch's forwards, process-wide: graphs_compiled()


def dynamo_graphs() -> int:
    """Dynamo's process-wide count of compiled graphs (0 if Dynamo was never imported)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # internals moved: taken as not compiled (the after run's loss watch still checks)  # noqa: BLE001
        return 0


def graphs_compiled() -> int:
    """How many of `dynamo_graphs()` this patch compiled: `kprof apply`'s ablation tells the
    script's own torch.compile (ablated under that compile: kprof/patching/apply.py) from these."""
    return _COMPILED[0]


def _is_compiled(m: nn.Module) -> bool:
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None


def plan(m: nn.Module, *, cuda_only: bool = True) -> str:
    """'' when the root module `m` can run under CUDA graphs, else why not (module docstring).
    `cuda_only=False` accepts a CPU model, where reduce-overhead compiles without graphs (what
    the tests exercise of the install and its verification)."""
    if _is_compiled(m):
        return "the model is already compiled (torch.compile): set mode=\"reduce-overhead\" on that compile instead"
    tensors = list(m.parameters()) + list(m.buffers())
    if not tensors:
        return "the model has no parameters or buffers to place it on a device"
    devices = sorted({str(t.device) for t in tensors})
    if len(devices) > 1:
        return f"the model's tensors are on several devices ({', '.join(devices)}): one graph runs on one GPU"
    if cuda_only and tensors[0].device.type != "cuda":
        return (f"the model is on {devices[0]}, not a CUDA device: CUDA graphs record GPU kernels "
                "(on a CPU reduce-overhead only compiles)")
    drop = [f"{n or '<model>'} (p={mod.p:g})" for n, mod in m.named_modules()
            if isinstance(mod, nn.modules.dropout._DropoutNd) and mod.training and mod.p > 0]
    if drop:
        return (f"dropout active in training mode at {', '.join(drop[:3])}{' ...' if len(drop) > 3 else ''}: "
                "the compiled forward draws other random numbers than eager, so it can't be verified against it")
    return ""


def _clone_scalars(out):
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and t.dim() == 0 else t, out)


def compiled_forward(m: nn.Module) -> Callable:
    """The class's forward of `m`, bound and compiled with mode="reduce-overhead" (dynamic=False:
    one graph per input shape, as graph trees record one per shape anyway)."""
    return torch.compile(type(m).forward.__get__(m), mode="reduce-overhead", dynamic=False)


def graphed(m: nn.Module) -> Callable:
    """The forward the patch installs: `compiled_forward(m)`, counting the graphs it compiles and
    cloning 0-dim outputs out of the graph's pool (module docstring)."""
    from torch._dynamo.utils import counters  # imported once, not per call: host time per step is what this saves

    fn = compiled_forward(m)

    def forward(*args, **kwargs):
        before = counters["stats"]["unique_graphs"]
        try:
            return _clone_scalars(fn(*args, **kwargs))
        finally:
            _COMPILED[0] += counters["stats"]["unique_graphs"] - before

    return forward


def _input_devices(m: nn.Module, args, kwargs) -> tuple[bool, str] | None:
    """Rule.check: every tensor input on the model's device (a CPU tensor leaves the graph uncaptured)."""
    want = next(iter(m.parameters()), None)
    if want is None:
        return None
    bad = sorted({str(t.device) for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device != want.device})
    if bad:
        return False, f"inputs on {', '.join(bad)}, the model on {want.device}: a graph can't take them"
    return True, f"every input on {want.device}"


def cuda_graphs_rule(*, cuda_only: bool = True) -> Rule:
    """The rule; `cuda_only=False` also installs on a CPU model (compiled, no graphs: the tests)."""

    def match(path: str, m: nn.Module) -> dict | None:
        if path:  # the model's root only: its forward is the step's forward and backward
            return None
        why = plan(m, cuda_only=cuda_only)
        return {"declined": why} if why else {}

    def replace(m: nn.Module, p: dict) -> dict:
        return {} if "declined" in p else {"": graphed(m)}

    return Rule(
        id=ID,
        title="CUDA graphs: the model's forward and backward under torch.compile(mode=\"reduce-overhead\")",
        kernels=(),
        match=match,
        replace=replace,
        # Never matched from the profile: the cuda_graphs diagnosis (rules/diagnoses/launch_bound.py) plans it.
        profile=ProfilePattern(own_all=("<never>",)),
        check=lambda m, p, args, kwargs: _input_devices(m, args, kwargs),
        change="the model's forward and backward replayed as CUDA graphs (torch.compile mode=\"reduce-overhead\")",
        confidence="medium",
        wraps=True,
    )


RULE = cuda_graphs_rule()
