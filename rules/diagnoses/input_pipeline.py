"""Input pipeline: the step waits for data -> DataLoader workers, pinned memory, non-blocking copies.

A DataLoader with num_workers=0 loads and collates every batch in the training process, between
two steps: on a GPU nothing is queued meanwhile, so the device idles for the whole fetch. A copy
from pageable (non-pinned) host memory makes the host wait: the CUDA runtime synchronizes the
stream before it stages a pageable source (CUDA runtime API, "API synchronization behavior"),
and `non_blocking=True` cannot help without pinned memory.

Evidence: summary["input_wait_by_step"] (kprof.analyze.tables.input_wait_by_step, from the trace):
per recorded step, the host time inside torch's `enumerate(DataLoader)#<Iterator>.__next__`
ranges and inside the calls that issued "Memcpy HtoD" copies, and on a GPU the device idle time
inside them (no kernel, memcpy or memset running on any stream). The iterator class tells
num_workers=0 (`_SingleProcessDataLoaderIter`) from workers; the memcpy name tells a pageable
source ("Pageable -> Device") from a pinned one. Where: the DataLoader's construction and the
`.to(device)` / `.cuda()` calls on the loop's batch, found in the script with `ast` (nothing is
run).

Saving: on a GPU, the device idle inside those ranges (median over steps): measured, the most
that workers prefetching the next batch and non-blocking pinned copies can hide. On a CPU there
is no device to idle: the main process's time in `DataLoader.__next__` (median over steps) is
what workers would take off the step, an upper bound reached only with spare cores.
"""

from __future__ import annotations

import ast
import math
import statistics
from pathlib import Path

from kprof.rules import edits
from kprof.rules.diagnoses.base import Diagnosis, Finding, is_gpu_run, parse_script, step_ms
from kprof.rules.edits import no_diff

# Flag the pipeline when its wait is at least 5% of the profiled step: a 5% data stall on a
# 100 ms step (5 ms) already outweighs the H200 Llama-1B run's steady idle (1.9-2.0 ms/step).
MIN_STEP_SHARE = 0.05
SINGLE_PROCESS = "_SingleProcessDataLoaderIter"
COPY_METHODS = ("to", "cuda")


def _median(rows: list[dict], key: str) -> float:
    xs = [float(r[key]) for r in rows if r.get(key) is not None and math.isfinite(float(r[key]))]
    return statistics.median(xs) if xs else math.nan


def _callee(call: ast.Call) -> str | None:
    return getattr(call.func, "attr", getattr(call.func, "id", None))


def _root(node: ast.AST) -> str | None:
    """`batch["x"].float` -> "batch": the name an expression starts from."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call, ast.Starred)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _names(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def script_sites(script: str | None) -> dict | None:
    """The DataLoader construction and the copies of its batches in `script`, read with ast:
    {"loader": (file:line, code, {kwarg: source}) or None, "copies": [(file:line, code, non_blocking)]}.
    None when the script can't be read or has no DataLoader call."""
    parsed = parse_script(script)
    if parsed is None:
        return None
    text, tree = parsed
    lines = text.splitlines()
    calls = sorted((c for c in ast.walk(tree) if isinstance(c, ast.Call) and _callee(c) == "DataLoader"),
                   key=lambda c: c.lineno)
    if not calls:
        return None
    # Variables bound to a DataLoader; the loader that matters is the one a for-loop iterates.
    bound: dict[str, ast.Call] = {}
    for a in ast.walk(tree):
        if isinstance(a, ast.Assign) and isinstance(a.value, ast.Call) and _callee(a.value) == "DataLoader":
            for t in a.targets:
                bound.update({n: a.value for n in _names(t)})
    loops = []
    for f in ast.walk(tree):
        if isinstance(f, (ast.For, ast.AsyncFor)):
            it_names = _names(f.iter)
            direct = [c for c in ast.walk(f.iter) if isinstance(c, ast.Call) and _callee(c) == "DataLoader"]
            used = direct or [bound[n] for n in sorted(it_names) if n in bound]
            if used:
                loops.append((f, used[0]))
    loader = loops[0][1] if loops else calls[0]
    kwargs = {k.arg: ast.get_source_segment(text, k.value) for k in loader.keywords if k.arg}

    copies = []
    for f, _ in loops:
        # Names holding the batch: the loop target, then what is unpacked or comprehended from it.
        held = _names(f.target)
        body = [n for stmt in f.body for n in ast.walk(stmt)]
        for _ in range(2):  # two passes: `x, y = batch` then `{k: v for k, v in x.items()}`
            for n in body:
                if isinstance(n, ast.Assign) and _root(n.value) in held:
                    for t in n.targets:
                        held |= _names(t)
                elif isinstance(n, ast.comprehension) and _root(n.iter) in held:
                    held |= _names(n.target)
        for n in body:
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in COPY_METHODS \
                    and _root(n.func.value) in held:
                nb = next((k.value for k in n.keywords if k.arg == "non_blocking"), None)
                # non_blocking=<expression> counts as set; only a missing or literal False one blocks.
                non_blocking = nb is not None and not (isinstance(nb, ast.Constant) and not nb.value)
                copies.append((f"{script}:{n.lineno}", lines[n.lineno - 1].strip(), non_blocking))
    copies = sorted(set(copies), key=lambda c: int(c[0].rsplit(":", 1)[1]))
    return {"loader": (f"{script}:{loader.lineno}", lines[loader.lineno - 1].strip(), kwargs), "copies": copies}


def _short(site: str) -> str:
    path, line = site.rsplit(":", 1)
    return f"{Path(path).name}:{line}"


def find(ops, summary: dict) -> list[Finding]:
    rows = summary.get("input_wait_by_step") or []
    if not rows:
        return []
    gpu = is_gpu_run(summary)
    st = step_ms(summary)
    loader_ms = _median(rows, "loader (us)") / 1e3
    h2d_host_ms = _median(rows, "h2d host (us)") / 1e3
    if gpu:
        wait_ms = _median(rows, "idle (us)") / 1e3
        loader_idle_ms = _median(rows, "loader idle (us)") / 1e3
        h2d_idle_ms = _median(rows, "h2d idle (us)") / 1e3
    else:
        wait_ms = loader_ms  # the CPU itself stops computing while it loads
        loader_idle_ms = h2d_idle_ms = math.nan
    if not (math.isfinite(wait_ms) and math.isfinite(st) and st > 0 and wait_ms >= MIN_STEP_SHARE * st):
        return []

    n = len(rows)
    calls = sum(int(r.get("loader calls") or 0) for r in rows) / n
    copies = sum(int(r.get("h2d copies") or 0) for r in rows) / n
    pageable = sum(int(r.get("h2d pageable") or 0) for r in rows) / n
    iterators = sorted({str(r.get("iterator")) for r in rows if r.get("iterator")})
    single = SINGLE_PROCESS in iterators
    sites = script_sites(summary.get("script"))
    loader_site = sites["loader"] if sites else None
    kw = loader_site[2] if loader_site else {}
    copy_sites = sites["copies"] if sites else []

    # Workers needed to hide the fetch: each loads one batch per `loader_ms`, and a batch is
    # consumed every `compute_ms`, so ceil(loader / compute) workers keep up.
    compute_ms = max(st - wait_ms, 0.0)
    need = math.ceil(loader_ms / compute_ms) if compute_ms > 0 and math.isfinite(loader_ms) and loader_ms > 0 else None
    cores = (summary.get("device") or {}).get("cpu_count")
    workers = min(need, cores) if need and cores else need
    # Fewer workers than needed: batches arrive every loader / workers ms, so the step becomes
    # max(compute, loader / workers) and only the rest of the wait is saved.
    short_ms = max(loader_ms / workers - compute_ms, 0.0) if need and workers and workers < need else 0.0

    lines = []
    if calls:
        what = "num_workers=0" if single else ", ".join(i.strip("_") for i in iterators) or "?"
        lines.append(f"DataLoader ({what}): {calls:g} fetch/step, {loader_ms:.2f} ms/step in __next__ "
                     f"({loader_ms / st:.0%} of step)" + (f", GPU idle {loader_idle_ms:.2f} ms of it" if gpu else ""))
    if copies:
        lines.append(f"host-to-device copies: {copies:g}/step ({pageable:g} from pageable memory), host blocked "
                     f"{h2d_host_ms:.2f} ms/step, GPU idle {h2d_idle_ms:.2f} ms of it")
    if loader_site:
        lines.append(f"built at {_short(loader_site[0])}"
                     + "".join(f"; batch copied at {_short(c[0])}" + ("" if c[2] else " (blocking)") for c in copy_sites))
    if need:
        lines.append(f"{need} worker{'s keep' if need > 1 else ' keeps'} up: ceil({loader_ms:.2f} ms load / {compute_ms:.2f} ms rest of step)"
                     + (f"; {cores} cores here" if cores else ""))

    fixes, hows = [], []
    pinned = str(kw.get("pin_memory", "False")) not in ("False", "None", "0")
    if calls and (single or not iterators):
        fixes.append(f"load batches in worker processes (num_workers={workers or 'N'}, persistent_workers=True)")
    elif calls:
        fixes.append("more DataLoader workers or a cheaper __getitem__ (the workers don't keep up)")
    blocking = [c for c in copy_sites if not c[2]]
    # Pinning matters for the copies: pageable ones seen on the GPU, or (CPU run, nothing copied)
    # the script's blocking copies of an unpinned batch, which would be pageable on a GPU.
    pin = bool(pageable) or (not pinned and bool(blocking or copies))
    if pin or blocking:
        fixes.append(" copied with ".join(x for x in ("pinned batches (pin_memory=True)" if pin else "",
                                                      ".to(device, non_blocking=True)" if blocking else "") if x))
    change = "; ".join(fixes) or "overlap data loading with the step"
    if loader_site:
        add = [f"num_workers={workers or 'N'}" if calls and single else "",
               "pin_memory=True" if pin and not pinned else "",
               "persistent_workers=True" if calls and single else ""]
        add = [a for a in add if a]
        if add:
            hows.append(f"{_short(loader_site[0])}: DataLoader(..., {', '.join(add)})")
    for site, code, nb in blocking:
        hows.append(f"{_short(site)}: .to(device, non_blocking=True)")
    how = "; ".join(hows) or change
    diff = _diff(summary.get("script"), loader_site, add if loader_site else [], blocking, calls and single and not workers)

    if gpu:
        note = ("measured: GPU idle while the host was in DataLoader.__next__ or a blocking host-to-device copy "
                "(median over steps); prefetching workers and non-blocking pinned copies hide at most this")
        conf = "high" if single or pageable else "medium"
    else:
        note = ("upper bound: the main process's time in DataLoader.__next__ per step (median)"
                + (f", less the {short_ms:.2f} ms {workers} workers leave (a batch every {loader_ms / workers:.2f} ms)"
                   if short_ms else "")
                + "; workers need cores of their own. CPU run: nothing idles; on a GPU the device would wait this long")
        conf = "medium"
    details = [{"iterator": ", ".join(iterators), "loader fetches per step": calls, "loader ms/step": loader_ms,
                "loader GPU idle ms/step": loader_idle_ms, "h2d copies per step": copies, "h2d pageable per step": pageable,
                "h2d host ms/step": h2d_host_ms, "h2d GPU idle ms/step": h2d_idle_ms, "workers needed": need,
                "loader site": loader_site[0] if loader_site else None,
                "loader kwargs": kw, "copy sites": [{"site": s, "code": c, "non_blocking": nb} for s, c, nb in copy_sites]}]
    return [Finding(
        where=f"DataLoader {_short(loader_site[0])}" if loader_site else "input pipeline",
        evidence="\n".join(lines),
        change=change,
        how=how,
        ms_per_step=(loader_ms if math.isfinite(loader_ms) else 0.0) + (h2d_host_ms if math.isfinite(h2d_host_ms) else 0.0),
        saving_ms=wait_ms - short_ms,
        saving_note=note,
        source=loader_site[0] if loader_site else (copy_sites[0][0] if copy_sites else ""),
        paths=([loader_site[0]] if loader_site else []) + [c[0] for c in copy_sites],
        cls="input pipeline",
        confidence=conf,
        details=details,
        diff=diff,
    )]


def _diff(script, loader_site, add: list[str], blocking: list, unknown_workers: bool) -> dict:
    """One diff over the script: the DataLoader's keywords and non_blocking=True on its batch copies."""
    if unknown_workers:
        return no_diff("the worker count can't be derived from this run (no compute time left in the step): "
                       "set num_workers by hand")
    changes = []
    if loader_site and add:
        changes.append((int(loader_site[0].rsplit(":", 1)[1]), ("DataLoader",),
                        dict(a.split("=", 1) for a in add)))
    changes += [(int(s.rsplit(":", 1)[1]), COPY_METHODS, {"non_blocking": "True"}) for s, _, _ in blocking]
    if not changes:
        return no_diff("no DataLoader call or batch copy found in the script to change")
    return edits.many_calls(script, changes)


DIAGNOSIS = Diagnosis(id="input_pipeline", title="the step waits for input data", find=find)
