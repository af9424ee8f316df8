"""One registry of kprof's fused kernels: what each replaces, its limits, and its cost model.

Each kernel module registers one `KernelSpec` at import. The profiler's roofline (cost of a
`kprof::*` custom op seen in a trace), the benchmarks (GB/s and % of copy bandwidth) and
`kprof suggest` (saving estimates) all read costs from here, so the byte count lives once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple, Sequence

import torch


class Cost(NamedTuple):
    """FLOPs and the minimal bytes moved through device memory (each input read once,
    each output written once)."""

    flops: float
    bytes: float

    def __add__(self, other: "Cost") -> "Cost":  # type: ignore[override]
        return Cost(self.flops + other.flops, self.bytes + other.bytes)


class TensorMeta(NamedTuple):
    """What a profiler trace records about one tensor argument of an op."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class KernelSpec:
    name: str  # "rms_norm"
    replaces: str  # one line: what eager code this fuses
    dtypes: tuple[torch.dtype, ...]
    limits: str  # one line: shape limits and what happens past them
    deterministic: bool  # bitwise run-to-run determinism on the same inputs (tested)
    fn: Callable  # public function (autograd-aware)
    module: type | None  # nn.Module drop-in, if any
    reference: Callable  # pure-PyTorch reference with the same signature as `fn`
    # Problem-level cost: cost(**problem) -> {"fwd": Cost, "bwd": Cost}; the problem keys are the
    # kernel's own (e.g. n_rows, n_cols, dtype). Used by benchmarks and suggest.
    cost: Callable[..., Mapping[str, Cost]]
    # Per custom op: "kprof::rms_norm_fwd" -> f(input metas in op-argument order) -> Cost.
    # Used by the profiler for kprof ops it sees in a trace.
    op_costs: Mapping[str, Callable[[Sequence[TensorMeta]], Cost]] = field(default_factory=dict)
    cuda_only: bool = False  # True if it has no interpreter/CPU path (falls back to reference)


REGISTRY: dict[str, KernelSpec] = {}


def register(spec: KernelSpec) -> KernelSpec:
    if spec.name in REGISTRY and REGISTRY[spec.name] is not spec:
        raise ValueError(f"kernel {spec.name!r} registered twice")
    REGISTRY[spec.name] = spec
    return spec


def get(name: str) -> KernelSpec:
    from kprof.errors import KprofError

    if name not in REGISTRY:
        raise KprofError(f"unknown kernel {name!r}; known: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def op_cost(op_name: str, metas: Sequence[TensorMeta]) -> Cost | None:
    """Cost of a kprof custom op from its input metas, or None if no spec knows the op or the
    metas are missing (a run cut short before its shapes step records ops without shapes)."""
    for spec in REGISTRY.values():
        f = spec.op_costs.get(op_name)
        if f is not None:
            if not metas:
                return None
            return f(metas)
    return None
