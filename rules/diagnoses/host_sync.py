"""Host syncs inside the training step (`.item()`, `.cpu()`, printing a tensor, data-dependent shapes).

Evidence: summary["syncs"], recorded during the profiled steps by kprof/capture/syncs.py's detector with
the user's file:line and code. A sync makes the host wait until the GPU has drained its queue;
the next kernels are launched only after that, so the GPU idles for at least the launch latency
of what follows, and for much longer when the host has work to do before its next launch.

Saving: on a GPU run, the GPU's idle time in the profiled steps (summary["idle_by_step"],
median over steps) is an upper bound: removing the syncs can recover at most all of it, and
other causes (data loading, Python overhead) share it. On a CPU run nothing waits (the detector
reports what *would* sync on a GPU), so no saving can be measured there.
"""

from __future__ import annotations

import math
import os
import re
import statistics

from kprof.analyze.modules import step_ms
from kprof.rules.diagnoses.base import Diagnosis, Finding, is_gpu_run, n_steps
from kprof.rules.edits import no_diff

# Sync kind (kprof/capture/syncs.py's kind strings) -> the fix. First match wins: the order is precedence.
FIXES: tuple[tuple[str, str], ...] = (
    (r"^torch\.cuda\.synchronize",
     "remove it from the step; to time steps, record torch.cuda.Event(enable_timing=True) pairs and read "
     "them after the loop"),
    (r"data-dependent shape",
     "keep shapes static inside the step: torch.where(cond, x, y) or masked_fill instead of indexing with a "
     "boolean mask, output_size= for repeat_interleave; or move this out of the step"),
    (r"^Tensor\.(cpu|to\(cpu\)|copy_|numpy|__array__)",
     "copy with .to('cpu', non_blocking=True) into pinned memory and read it a step later, or only every N steps"),
    (r"__bool__|is_nonzero|equal|allclose|__contains__",
     "don't branch on a tensor's value in the step: compute both sides with torch.where, or check it "
     "every N steps"),
    (r".*",
     "accumulate on the device (total += loss.detach()) and call .item() / print only every N steps "
     "(if step % N == 0)"),
)

MAX_SITES_SHOWN = 3  # the evidence cell lists the busiest sites; --json has all of them


def fix_for(kind: str) -> str:
    return next(fix for pat, fix in FIXES if re.search(pat, kind))


def _short(file: str) -> str:
    return os.path.basename(file) if file and not file.startswith("<") else (file or "?")


def _rate(x: float) -> str:
    """Syncs per step, to 2 significant digits (a loss printed every 4th step: 0.29, not 0.285714)."""
    return f"{x:.2g}"


def find(ops, summary: dict) -> list[Finding]:
    syncs = [s for s in summary.get("syncs") or [] if int(s.get("count") or 0) > 0]
    if not syncs:
        return []
    # The detector counts in every step it watched; that can include a last step the script
    # ended inside (steps_recorded counts finished steps only), so count the steps it saw too.
    watched = {int(x) for s in syncs for x in (s.get("steps") or [])}
    # Runs since the detector left the timed steps say how many steps it watched.
    n = int(summary.get("sync_steps") or 0) or max(n_steps(ops, summary), len(watched))
    gpu = is_gpu_run(summary)
    sites = sorted(syncs, key=lambda s: (-int(s["count"]), str(s.get("file")), int(s.get("line") or 0)))
    details = [{"file": s.get("file"), "line": s.get("line"), "code": s.get("code", ""), "kind": s.get("kind", ""),
                "per step": int(s["count"]) / n, "fix": fix_for(str(s.get("kind", "")))} for s in sites]
    lines = [f"{d['kind']} x{_rate(d['per step'])}/step at {_short(d['file'])}:{d['line']}"
             + (f"  `{d['code']}`" if d["code"] else "") for d in details[:MAX_SITES_SHOWN]]
    if len(details) > MAX_SITES_SHOWN:
        lines.append(f"... and {len(details) - MAX_SITES_SHOWN} more sites (see --json)")
    per_step = sum(d["per step"] for d in details)

    saving, note, conf = math.nan, "", "high"
    if gpu:
        idle = [float(r["idle (us)"]) for r in summary.get("idle_by_step") or [] if r.get("idle (us)") is not None]
        if idle:
            saving = statistics.median(idle) / 1e3
            note = "upper bound: all GPU idle time in the step (median over steps); other stalls share it"
            step = step_ms(summary)
            if step == step and saving > step:
                # Idle is measured in the profiled steps, which run slower than the unprofiled step
                # every saving is a share of: no saving can be more than the whole step.
                saving = step
                note = "upper bound: the whole unprofiled step (the profiled steps' GPU idle exceeds it)"
            lines.append(f"GPU idle {saving:.2f} ms/step (median)")
        else:
            note = "no GPU idle time recorded for the steps"
        conf = "medium"  # the bound is the idle time, not the idle caused by these syncs alone
    else:
        note = "CPU run: nothing waits here, so the cost can't be measured; on a GPU each call waits for the queue to drain"
    first = details[0]
    kinds = sorted({d["kind"] for d in details})
    return [Finding(
        where="\n".join(f"{_short(d['file'])}:{d['line']}" for d in details[:MAX_SITES_SHOWN])
              + (f"\n+{len(details) - MAX_SITES_SHOWN} more" if len(details) > MAX_SITES_SHOWN else ""),
        evidence=(f"host syncs per step: {_rate(per_step)} over {n} watched steps "
                  f"({'measured' if gpu else 'would sync on a GPU'}):\n" + "\n".join(lines)),
        change="; ".join(dict.fromkeys(fix_for(k) for k in kinds)),
        how=f"{_short(first['file'])}:{first['line']}: {first['fix']}",
        saving_ms=saving, saving_note=note, source=f"{first['file']}:{first['line']}",
        paths=[f"{d['file']}:{d['line']}" for d in details], cls="host sync", confidence=conf, details=details,
        diff=no_diff("the fix depends on what the script does with the synced value (logging, a branch, a "
                     "metric) and on its loop variable: no exact textual change is derived"),
    )]


DIAGNOSIS = Diagnosis(id="host_sync", title="host syncs inside the training step", find=find)
