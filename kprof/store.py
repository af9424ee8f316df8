"""The run store: one directory per profiled run, written atomically.

Layout (`.kprof/runs/` under the current directory by default; `kprof profile --out DIR` moves it):

    .kprof/runs/20250101-120000-gpt_train/
        summary.json     everything the report shows: device, ceilings and their origin, versions,
                         step definition, step times, overhead, memory, coverage, class breakdown,
                         top ops, host syncs, status
        ops.parquet      the per-op table (one row per executed op per recorded step)
        trace.json.gz    the raw Chrome trace; opens in https://ui.perfetto.dev

A run is first written into a hidden temp dir in the same parent and then renamed into place, so a
reader never sees half a run and an interrupted save leaves only a `.tmp-*` dir behind (ignored by
`list_runs`). Two saves in the same second race for the same name; `os.rename` of a directory onto
an existing non-empty one fails on POSIX, so the loser takes the next free suffix (-2, -3, ...)
and neither clobbers the other. Run dirs are never empty (summary.json is always written), which
is what makes that rename check safe.
"""

from __future__ import annotations

import datetime as _dt
import errno
import gzip
import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from kprof.errors import KprofError

DEFAULT_ROOT = Path(".kprof") / "runs"
SUMMARY = "summary.json"
OPS = "ops.parquet"
KERNELS = "kernels.parquet"  # GPU runs: one row per kernel per recorded step
NCU = "ncu.json"  # written by `kprof profile --ncu`: Nsight Compute counters of the top kernels
TRACE = "trace.json.gz"
PLAN = "plan.json"  # written by kprof suggest
APPLY = "apply.json"  # in the patched run of kprof apply
COMPARE = "compare.json"  # in each run of kprof apply --compare
MEMORY = "memory.json.gz"  # the shapes step's memory record (kprof/capture/runner.py _memory_record)
MEMORY_SNAPSHOT = "memory_snapshot.pickle"  # torch.cuda.memory._snapshot() (pytorch.org/memory_viz)
FORMAT = 1  # bump when summary.json changes incompatibly

# Parquet schema metadata key listing object columns stored as JSON text because Arrow could not
# type them (e.g. `concrete_inputs`, whose items mix ints, floats, strings and None).
_JSON_COLUMNS_KEY = b"kprof.json_columns"


@dataclass
class Run:
    """A saved run: its directory, its summary, and (loaded on first use) its ops table."""

    path: Path
    summary: dict
    _ops: pd.DataFrame | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def ops(self) -> pd.DataFrame:
        if self._ops is None:
            self._ops = load_ops(self.path)
        return self._ops

    @property
    def summary_path(self) -> Path:
        return self.path / SUMMARY

    @property
    def ops_path(self) -> Path:
        return self.path / OPS

    @property
    def trace_path(self) -> Path | None:
        p = self.path / TRACE
        return p if p.exists() else None


# ---------------------------------------------------------------------------------------------
# Writing


def run_dir_name(script: str, when: _dt.datetime) -> str:
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(script).stem) or "script"
    return f"{when:%Y%m%d-%H%M%S}-{stem}"


def save_run(
    summary: dict,
    ops: pd.DataFrame,
    trace_path: str | os.PathLike | None,
    *,
    root: str | os.PathLike = DEFAULT_ROOT,
    name: str | None = None,
    memory: dict | None = None,
    memory_snapshot: str | os.PathLike | None = None,
    kernels: pd.DataFrame | None = None,
) -> Path:
    """Write a run atomically under `root` and return its final directory.

    `name` defaults to `<YYYYmmdd-HHMMSS>-<script stem>` from `summary["script"]` and now.
    """
    def fill(tmp: Path) -> dict:
        files = {"summary": SUMMARY, "ops": OPS, "trace": TRACE if trace_path else None}
        _write_ops(ops, tmp / OPS)
        if trace_path:
            _gzip_copy(Path(trace_path), tmp / TRACE)
        if kernels is not None and len(kernels):
            _write_ops(kernels, tmp / KERNELS)
            files["kernels"] = KERNELS
        if memory is not None:
            with gzip.open(tmp / MEMORY, "wt", compresslevel=6) as f:
                json.dump(jsonable(memory), f)
            files["memory"] = MEMORY
        if memory_snapshot and Path(memory_snapshot).is_file():
            shutil.copyfile(memory_snapshot, tmp / MEMORY_SNAPSHOT)
            files["memory_snapshot"] = MEMORY_SNAPSHOT
        return files

    return _save_atomic(summary, fill, root, name)


RANKS = "ranks"  # in a multi-process run: one complete run folder per rank, ranks/rank<N>


def save_group(summary: dict, lead: Path, ranks: Sequence[Path], *, root: str | os.PathLike = DEFAULT_ROOT) -> Path:
    """One run of a multi-process job: `lead`'s (rank 0's) ops and trace with the merged
    `summary` at the top, and every rank's complete run folder moved under ranks/. Atomic like
    save_run: the folder appears complete or not at all."""
    def fill(tmp: Path) -> dict:
        files = {"ops": OPS, "trace": TRACE, "kernels": KERNELS, "memory": MEMORY, "memory_snapshot": MEMORY_SNAPSHOT}
        for f in files.values():
            if (lead / f).exists():
                shutil.copy2(lead / f, tmp / f)
        (tmp / RANKS).mkdir()
        for r in ranks:
            shutil.move(str(r), str(tmp / RANKS / r.name))
        return ({"summary": SUMMARY} | {k: v for k, v in files.items() if (tmp / v).exists()}
                | {"ranks": RANKS})

    return _save_atomic(summary, fill, root, None)


def _save_atomic(summary: dict, fill, root, name: str | None) -> Path:
    """A hidden temporary folder under `root`, filled by `fill(tmp)` (which returns the files
    map), summary.json written last (its presence marks a complete run: see load_summary), then
    renamed to a free name; removed again on any failure."""
    root = ensure_root(root)
    base = name or run_dir_name(summary.get("script", "script"), _dt.datetime.now())
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{base}-", dir=root))
    except OSError as e:
        raise KprofError(f"cannot save the run in {root}: {e.strerror or e}; free space or pass --out DIR") from e
    try:
        summary = dict(summary)
        summary.setdefault("format", FORMAT)
        summary["files"] = fill(tmp)
        with open(tmp / SUMMARY, "w") as f:
            json.dump(jsonable(summary), f, indent=1, allow_nan=False)
        return rename_free(tmp, root, base)
    except OSError as e:  # a full disk, a store made read-only meanwhile: one line, not a traceback
        shutil.rmtree(tmp, ignore_errors=True)
        raise KprofError(f"cannot save the run in {root}: {e.strerror or e}; free space or pass --out DIR") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def ensure_root(root: str | os.PathLike, *, exit_code: int = 2) -> Path:
    """Create the run store directory if needed; a KprofError if it can't be (checked before a
    long profile so a bad --out fails at once, exit code 2 there)."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KprofError(f"cannot create the run store {root}: {e.strerror or e}; pass --out DIR to save elsewhere",
                         exit_code=exit_code) from e
    if not root.is_dir():
        raise KprofError(f"the run store {root} is not a folder; pass --out DIR to save elsewhere", exit_code=exit_code)
    if not os.access(root, os.W_OK):
        raise KprofError(f"the run store {root} is not writable; pass --out DIR to save elsewhere", exit_code=exit_code)
    return root


def rename_free(tmp: Path, root: Path, base: str) -> Path:
    for i in range(1, 1000):
        final = root / (base if i == 1 else f"{base}-{i}")
        if final.exists():
            continue
        try:
            os.rename(tmp, final)
            return final
        except OSError as e:  # lost a race for this name to a concurrent save
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
    raise KprofError(f"more than 999 runs named {base} in {root}; clean up old runs")


def _write_ops(ops: pd.DataFrame, path: Path) -> None:
    # Parquet because it keeps the table typed and columnar, stores list columns (input shapes,
    # strides) natively, and is read directly by pandas, polars and duckdb.
    import pyarrow as pa
    import pyarrow.parquet as pq

    df = ops.reset_index(drop=True)
    json_cols = []
    arrays = {}
    for col in df.columns:
        try:
            arrays[col] = pa.array(df[col], from_pandas=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            json_cols.append(col)
            arrays[col] = pa.array([json.dumps(jsonable(v)) for v in df[col]], type=pa.string())
    table = pa.table(arrays) if arrays else pa.table({})
    meta = dict(table.schema.metadata or {})
    meta[_JSON_COLUMNS_KEY] = json.dumps(json_cols).encode()
    pq.write_table(table.replace_schema_metadata(meta), path)


def _gzip_copy(src: Path, dst: Path) -> None:
    if not src.exists():
        raise KprofError(f"the profiler's trace {src} is missing; the run can't be saved with its trace")
    if src.suffix == ".gz":
        shutil.copyfile(src, dst)
        return
    # Level 6 (zlib's default): GPU traces reach hundreds of MB and level 9 is several times slower
    # for a few percent.
    with open(src, "rb") as fi, gzip.open(dst, "wb", compresslevel=6) as fo:
        shutil.copyfileobj(fi, fo, length=1 << 20)


# Files kprof writes for the user outside the run store (`apply --write`, `report --html`): never
# clobbered silently.


def check_write_target(path: Path, script: str | None = None, *, force: bool = False, option: str = "--write",
                       example: str = "keep_patches.py") -> None:
    """Refuse an output file before any work starts: a folder, a path that can't be written, or an
    existing file (unless `force`: then write_keep_file keeps a backup). `option` is the flag that
    named the file and `example` a file name to suggest, both for the messages."""
    if str(path) == "-":
        return
    if path.is_dir():
        raise KprofError(f"{option} {path} is a folder; pass a file path such as {path / example}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise KprofError(f"{option} {path}: the folder {parent} does not exist; create it or pass another path")
    try:  # the one sure test of writability (permissions, read-only mounts, immutable folders)
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise KprofError(f"{option} {path}: cannot write in {parent} ({e.strerror or e}); pass a writable path") from None
    if path.exists() or path.is_symlink():
        mine = script is not None and path.resolve() == Path(script).resolve()
        if not force:
            raise KprofError(f"{option} {path} exists{' and is the training script itself' if mine else ''}; pass a new "
                             f"file name, or add --force to replace it (the old file is kept as {backup_name(path)})")
        if not os.access(path, os.W_OK) or not path.is_file():
            raise KprofError(f"{option} {path} exists and is not a writable file; pass another path")


def backup_name(path: Path) -> Path:
    """FILE.bak, or FILE.bak.1, .2, ... when that exists: an earlier backup is never overwritten."""
    bak = path.with_name(path.name + ".bak")
    i = 1
    while bak.exists() or bak.is_symlink():
        bak = path.with_name(f"{path.name}.bak.{i}")
        i += 1
    return bak


def write_keep_file(path: Path, text: str) -> Path | None:
    """Write `text` to `path` whole or not at all (a temporary file renamed over it); an existing
    file is first copied to backup_name(path), which is returned."""
    bak = None
    if path.exists():
        bak = backup_name(path)
        shutil.copy2(path, bak)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".kprof-tmp", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        if bak is not None:
            shutil.copymode(bak, tmp)
        else:  # mkstemp's file is private (0600); a new file gets the usual mode (0666 less the umask)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return bak


def jsonable(v: Any) -> Any:
    """Plain JSON types: numpy scalars/arrays to Python, NaN/inf to None, Paths to str."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set)):
        return [jsonable(x) for x in v]
    if isinstance(v, os.PathLike):
        return os.fspath(v)
    if hasattr(v, "tolist"):  # numpy scalar or array, torch tensor
        return jsonable(v.tolist())
    if hasattr(v, "isoformat"):
        return v.isoformat()
    return str(v)


# ---------------------------------------------------------------------------------------------
# Reading


def list_runs(root: str | os.PathLike = DEFAULT_ROOT) -> list[Path]:
    """Run directories under `root`, oldest first (by the timestamp in the name, then mtime).
    Hidden dirs (unfinished saves) are skipped; a missing root is an empty store."""
    root = Path(root)
    if not root.is_dir():
        return []
    runs = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return sorted(runs, key=lambda p: (p.name[:15], p.stat().st_mtime_ns, p.name))


def latest_run(root: str | os.PathLike = DEFAULT_ROOT) -> Path:
    runs = list_runs(root)
    if not runs:
        raise KprofError(f"no runs in {root}; profile a script first: kprof profile SCRIPT")
    return runs[-1]


def resolve_run(spec: str | os.PathLike | None, root: str | os.PathLike = DEFAULT_ROOT) -> Path:
    """A run directory from a path, a run name inside `root`, or None for the latest run."""
    if spec is None:
        return latest_run(root)
    p = Path(spec)
    if p.is_file() and p.name in (SUMMARY, OPS, TRACE):  # a file inside a run: its run
        return p.parent
    if p.is_dir():
        return p
    if (Path(root) / p).is_dir():
        return Path(root) / p
    raise KprofError(f"run directory {p} not found; list saved runs with: kprof runs")


def load_summary(run: str | os.PathLike) -> dict:
    path = Path(run) / SUMMARY
    if not Path(run).is_dir():
        raise KprofError(f"run directory {run} not found; list saved runs with: kprof runs")
    if not path.is_file():
        raise KprofError(f"{path} is missing: {run} is not a complete kprof run (profile again)")
    try:
        with open(path) as f:
            summary = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KprofError(f"{path} is corrupt ({e}); profile the script again") from e
    if not isinstance(summary, dict) or "script" not in summary:
        raise KprofError(f"{path} is not a kprof run summary (no 'script' field); profile the script again")
    bad = _wrong_types(summary)
    if bad:
        raise KprofError(f"{path} is corrupt ({bad}); profile the script again or delete {Path(run).name}")
    if summary.get("format", FORMAT) > FORMAT:
        raise KprofError(f"{path} was written by a newer kprof (format {summary['format']}); upgrade kprof")
    return summary


# The fields of summary.json that the commands read, with the JSON types they may hold (None
# where a field may be null). A run whose fields have other types is refused as corrupt at load,
# so no command meets a str where it reads a dict.
_NUM = (int, float)
_FIELDS: dict[str, tuple] = {
    "script": (str,), "status": (str,), "format": (int,), "argv": (list,), "device": (dict, None),
    "ceilings": (dict, None), "step_definition": (str, None), "warmup": (int, None), "steps": (int, None),
    "steps_recorded": (int, None), "step_times_ms": (list, None), "profiled_step_times_ms": (list, None),
    "step_time_ms": (dict, None), "profiled_step_time_ms": (dict, None), "tokens_per_step": (*_NUM, None),
    "tokens_per_s": (*_NUM, None), "peak_memory_bytes": (*_NUM, None), "busy_pct": (*_NUM, None),
    "coverage_pct": (*_NUM, None), "profiler_overhead_pct": (*_NUM, None), "class_breakdown": (list, None),
    "top_ops": (list, None), "syncs": (list, None), "losses": (list, None), "loss_dtype": (str, None), "module_classes": (dict, None),
    "warnings": (list, None), "error": (str, None), "exit_code": (int, None), "status_note": (str, None),
    "analysis_error": (str, None), "apply_of": (dict, None),
}
_JSON_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
               bool: "a boolean", type(None): "null"}


def _wrong_types(summary: dict) -> str:
    """'field X is a string, not an object' for the first field of the wrong type, else ''."""
    def ok(v, types) -> bool:
        if v is None:
            return None in types
        if isinstance(v, bool):
            return bool in types
        return isinstance(v, tuple(t for t in types if t is not None))

    for key, types in _FIELDS.items():
        if key in summary and not ok(summary[key], types):
            want = " or ".join(_JSON_NAMES[t if t is not None else type(None)] for t in types)
            return f"field {key!r} is {_JSON_NAMES.get(type(summary[key]), type(summary[key]).__name__)}, not {want}"
    for key in ("step_time_ms", "profiled_step_time_ms"):
        for k, v in (summary.get(key) or {}).items():
            if not ok(v, (*_NUM, str, list, None)):
                return f"field {key}.{k} is {_JSON_NAMES.get(type(v), type(v).__name__)}"
    for key in ("top_ops", "class_breakdown", "syncs"):
        if any(not isinstance(r, dict) for r in summary.get(key) or []):
            return f"field {key!r} holds a non-object row"
    return ""


def load_ops(run: str | os.PathLike) -> pd.DataFrame:
    path = Path(run) / OPS
    if not path.is_file():
        raise KprofError(f"{path} is missing: {run} is not a complete kprof run (profile again)")
    return _read_table(path)


def _read_table(path: Path) -> pd.DataFrame:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise KprofError(f"{path} is corrupt ({e}); profile the script again") from e
    meta = table.schema.metadata or {}
    json_cols = json.loads(meta.get(_JSON_COLUMNS_KEY, b"[]"))
    df = table.to_pandas()
    # Arrow hands list columns back as numpy arrays of arrays; give them back as the lists the op
    # table was built with (input_shapes == [[8, 128], [128]]).
    for fld in table.schema:
        if pa.types.is_list(fld.type) or pa.types.is_large_list(fld.type):
            df[fld.name] = table.column(fld.name).to_pylist()
    for col in json_cols:
        df[col] = [json.loads(s) for s in df[col]]
    return df


def load_memory(run: str | os.PathLike) -> dict | None:
    """A run's memory record (None for a run saved without one)."""
    path = Path(run) / MEMORY
    if not path.is_file():
        return None
    try:
        with gzip.open(path, "rt") as f:
            return json.load(f)
    except (OSError, EOFError, json.JSONDecodeError) as e:
        raise KprofError(f"{path} is corrupt ({e}); profile the script again") from e


def load_kernels(run: str | os.PathLike) -> pd.DataFrame | None:
    """The run's kernels.parquet, or None when it has none (a CPU run, or a run from before it)."""
    path = Path(run) / KERNELS
    if not path.is_file():
        return None
    return _read_table(path)


def write_json(run: str | os.PathLike, name: str, doc: dict) -> Path:
    """Write `doc` as `name` into an existing run, atomically (a temporary file renamed)."""
    path = Path(run) / name
    tmp = path.with_name(f".{name}.tmp")
    with open(tmp, "w") as f:
        json.dump(jsonable(doc), f, indent=1, allow_nan=False)
    os.replace(tmp, path)
    return path


def read_json(run: str | os.PathLike, name: str) -> dict | None:
    """`name` from a run as a dict; None when absent. A corrupt file is a KprofError."""
    path = Path(run) / name
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KprofError(f"{path} is corrupt ({e}); re-run the command that wrote it") from e


def load_run(spec: str | os.PathLike | None = None, root: str | os.PathLike = DEFAULT_ROOT) -> Run:
    """A saved run (the latest under `root` by default); its ops table loads on first use."""
    path = resolve_run(spec, root)
    return Run(path=path, summary=load_summary(path))


def check_same_script(run, script: str) -> None:
    planned = run.summary.get("script")
    if not planned:
        return
    if Path(planned).resolve() != Path(script).resolve():
        raise KprofError(f"run {run.name} profiled {planned}, not {script}; profile this script first "
                         f"(kprof profile {script}) or pass --run with one of its runs")


def latest_kept(script: str, root: str | os.PathLike = DEFAULT_ROOT) -> tuple[str, list[str]] | None:
    """The newest `kprof apply` of `script` under `root`: (its run name, the rule ids its ablation
    kept). None when the script was never applied there."""
    target = Path(script).resolve()
    for p in reversed(list_runs(root)):
        try:
            doc = json.loads((p / APPLY).read_text())
        except (OSError, ValueError):
            continue
        planned, kept = doc.get("script"), doc.get("kept")
        if isinstance(planned, str) and isinstance(kept, list) and Path(planned).resolve() == target:
            return p.name, [k for k in kept if isinstance(k, str)]
    return None


def is_plain_run(path) -> bool:
    """A run of the script as written: not the patched run of an `apply` (apply.json, or the
    `apply_of` mark in summary.json that even a failed apply's partial run carries) nor a
    patched or compiled variant of `apply --compare` (compare.json naming another run as eager).
    Only such a run's plan reflects the unpatched model."""
    path = Path(path)
    if (path / APPLY).exists():
        return False
    try:
        if json.loads((path / SUMMARY).read_text()).get("apply_of") is not None:
            return False
    except (OSError, ValueError, AttributeError):
        pass  # an unreadable summary is reported when the run is loaded
    try:
        doc = json.loads((path / COMPARE).read_text())
    except (OSError, ValueError):
        return True
    return (doc.get("runs") or {}).get("eager") == path.name


def latest_plain_run(root):
    """The latest readable run that is_plain_run: what `suggest` and `apply` use by default, so
    that a previous apply's or --compare's patched/compiled runs (partial ones included) are not
    mistaken for a profile, and one corrupt run does not hide the others."""
    runs = list_runs(root)
    if not runs:
        latest_run(root)  # raises: no runs
    errors = []
    for p in reversed(runs):
        if is_plain_run(p):
            try:
                return Run(path=p, summary=load_summary(p))
            except KprofError as e:
                errors.append(str(e))
    if errors:
        raise KprofError(f"no readable run of a script as written in {root} ({errors[0]}); profile the script again")
    raise KprofError(f"every run in {root} is a patched or compiled run of kprof apply; profile the script as "
                     "written first: kprof profile SCRIPT")
