"""Benchmark cases, one file per kernel family; `benchmarks/bench_kernels.py` runs them all.

Each file defines `CASES: list[Case]`: one case is one row pair (fwd, fwd+bwd) of the top README's
kernel table and of benchmarks/results/kernels.csv. The launch-config sweeps beside the cases
(`python -m benchmarks.cases.<file> ...`) reproduce the sweep files in benchmarks/results/ and
the measured figures in the kernels' comments; each file's docstring says which.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Case:
    kernel: str  # registry name, e.g. "rms_norm"; the bytes model comes from its KernelSpec.cost
    label: str  # "RMSNorm 16384x4096"
    # make_inputs(device, dtype) -> kwargs; tensors that get grads have requires_grad=True.
    # Fresh random data (never zeros); sized larger than the 60 MB L2 where the shape is.
    make_inputs: Callable[[str, Any], dict]
    kprof: Callable[..., Any]  # kprof's public function, called as kprof(**inputs)
    eager: Callable[..., Any]  # the eager PyTorch formulation (HF-style); torch.compile(eager) is the compile peer
    liger: Callable[[], Callable[..., Any]] | None  # factory importing Liger lazily; None: Liger has no equivalent
    problem: dict  # spec.cost(**problem) -> {"fwd": Cost, "bwd": Cost}
    targets_us: dict = field(default_factory=dict)  # {"fwd": 70, "fwdbwd": 200} from the issue
    backward: bool = True  # time forward+backward too
    # Other settings of kprof's kernel timed in the same run, as impl "kprof <name>" (e.g. a chunk
    # size that trades memory for speed); checked for correctness like the default.
    kprof_variants: dict = field(default_factory=dict)
    # Variants that overwrite an input (e.g. linear + CE writing grad_hidden over hidden): checked
    # and timed after every other implementation, since the inputs hold garbage afterwards.
    kprof_inplace_variants: dict = field(default_factory=dict)
