"""A planted drifting kernel for issue 22's check on the H200: kprof's own fused RMSNorm, scaled
by 1 + 1e-3 x (its call count). Its first calls are within the bf16 tolerance, so it verifies;
by the 100th call (step 6 of the 1B Llama, 17 norms a step) its output is 10% too large. The
whole-run loss watch must call the run diverged and write nothing.

    kprof apply examples/llama_train.py --rules benchmarks/planted --patch drift_rms_norm \\
        --keep-losers --json -- --preset 1b --device cuda

(`bash benchmarks/gpu_run.sh drift` runs it on the newest 1B Llama run.)
"""

from __future__ import annotations

import dataclasses

from kprof.rules.rms_norm import RULE as RMS


def replace(m, p):
    forwards = RMS.replace(m, p)
    calls = [0]

    def drifting(fwd):
        def forward(x):
            calls[0] += 1
            return fwd(x) * (1.0 + 1e-3 * calls[0])
        return forward

    return {k: drifting(f) for k, f in forwards.items()}


RULE = dataclasses.replace(RMS, id="drift_rms_norm", title="RMSNorm that drifts (planted)", replace=replace)
