"""Build kprof's C++/CUDA extensions at first use, into a disk cache a second process loads as is.

`torch.utils.cpp_extension.load` compiles and links; on a later call it still writes a ninja file
and runs ninja, and it needs a compiler on the PATH even when nothing changed. Here the built
shared object goes into a directory named by its cache key (extension name, a hash of the sources
and flags, GPU arch, torch version) with a manifest holding the object's sha256; a later process
that finds a matching manifest imports the object directly, with no compiler and no ninja.

Bad caches: a cache root that cannot be written (read-only, or not a directory) and a corrupt
entry (manifest unreadable, object missing, its hash off, or an import that fails) both rebuild
into a fresh temporary directory, with a one-line warning; the entry in the cache is left alone.

Cache root: $KPROF_CACHE_DIR, else $XDG_CACHE_HOME/kprof/ext, else ~/.cache/kprof/ext.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from kprof.errors import KprofError

_MANIFEST = "manifest.json"


@dataclass(frozen=True)
class ExtensionSource:
    """What to compile: C++ (and CUDA) sources by file name, and the flags."""

    name: str  # "moe_router"; the module is kprof_<name>_<hash>
    cpp: dict[str, str]  # file name -> text, compiled by the host compiler
    cuda: dict[str, str]  # file name -> text, compiled by nvcc (empty: a CPU-only extension)
    cflags: tuple[str, ...] = ("-O3",)
    cuda_cflags: tuple[str, ...] = ("-O3",)

    def digest(self) -> str:
        h = hashlib.sha256()
        for part in (self.name, *sorted(self.cpp.items()), *sorted(self.cuda.items()), self.cflags, self.cuda_cflags):
            h.update(repr(part).encode())
        # cpp_extension compiles for the archs this names when it is set, not the device's.
        h.update(os.environ.get("TORCH_CUDA_ARCH_LIST", "").encode())
        return h.hexdigest()[:16]


def arch_of(device: torch.device | None) -> str:
    """'sm_90' for a CUDA device, 'cpu' for a CPU-only extension."""
    if device is None or device.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def cache_key(src: ExtensionSource, arch: str) -> str:
    tv = re.sub(r"[^0-9A-Za-z.]+", "_", torch.__version__)
    return f"{src.name}-{src.digest()}-{arch}-torch{tv}"


def cache_root() -> Path:
    if os.environ.get("KPROF_CACHE_DIR"):
        return Path(os.environ["KPROF_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kprof" / "ext"


def _module_name(src: ExtensionSource) -> str:
    return f"kprof_{src.name}_{src.digest()}"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _writable(d: Path) -> bool:
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        return True
    except OSError:
        return False


def check_toolchain(src: ExtensionSource) -> None:
    """Raise KprofError (one line) unless a host compiler, ninja and, for CUDA sources, nvcc exist."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise KprofError(f"no C++ compiler ({cxx!r} not on PATH)")
    if not cpp_extension.is_ninja_available():
        raise KprofError("ninja is not installed (pip install ninja)")
    if src.cuda:
        home = cpp_extension.CUDA_HOME
        nvcc = os.path.join(home, "bin", "nvcc") if home else None
        if not torch.version.cuda:
            raise KprofError("this torch build has no CUDA")
        if not nvcc or not os.path.exists(nvcc):
            raise KprofError("no nvcc (set CUDA_HOME to a CUDA toolkit)")


def _build(src: ExtensionSource, build_dir: Path) -> ModuleType:
    from torch.utils import cpp_extension

    check_toolchain(src)
    build_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for fname, text in {**src.cpp, **src.cuda}.items():
        p = build_dir / fname
        if not p.exists() or p.read_text() != text:  # an unchanged file keeps ninja's timestamp
            p.write_text(text)
        paths.append(str(p))
    name = _module_name(src)
    try:
        mod = cpp_extension.load(
            name=name, sources=paths, build_directory=str(build_dir), extra_cflags=list(src.cflags),
            extra_cuda_cflags=list(src.cuda_cflags), with_cuda=bool(src.cuda), verbose=False,
        )
    except Exception as e:  # cpp_extension raises RuntimeError/CalledProcessError with the whole log
        lines = [ln for ln in str(e).splitlines() if "error" in ln.lower()] or str(e).splitlines() or [type(e).__name__]
        raise KprofError(f"building {name} failed: {lines[0].strip()}") from e
    # A second build of one name in a process (a rebuild after a corrupt entry) is named
    # <name>_v<n> by cpp_extension's versioner; the module's name is the file's.
    so = Path(mod.__file__) if getattr(mod, "__file__", None) else build_dir / f"{name}.so"
    if not so.exists():
        raise KprofError(f"building {name} left no {so.name} in {build_dir}")
    tmp = build_dir / f"{_MANIFEST}.{os.getpid()}"
    tmp.write_text(json.dumps({"module": so.name[: -len(".so")], "file": so.name, "sha256": _sha256(so),
                               "torch": torch.__version__}))
    os.replace(tmp, build_dir / _MANIFEST)  # the manifest appears whole or not at all
    return mod


def _cached(src: ExtensionSource, d: Path) -> tuple[str, Path] | None | str:
    """(module name, the cached object's path); None if there is no entry; a reason string if it
    is corrupt."""
    manifest = d / _MANIFEST
    if not manifest.exists():
        return None
    try:
        m = json.loads(manifest.read_text())
        so = d / m["file"]
        if not m["module"].startswith(_module_name(src)) or _sha256(so) != m["sha256"]:
            return f"{so.name} does not match its manifest"
        return m["module"], so
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable entry ({type(e).__name__}: {e})"


# In-process: key -> (module, how), so a process builds or imports each extension once.
_loaded: dict[str, tuple[ModuleType, str]] = {}


def load(src: ExtensionSource, arch: str, root: Path | None = None) -> tuple[ModuleType, str]:
    """(the extension module, how it came): 'cached' (imported from the cache, nothing compiled),
    'built' (compiled into the cache) or 'built-temp' (compiled into a temporary directory because
    the cache was read-only or corrupt; a one-line warning says which). Raises KprofError when it
    cannot be built (no compiler, no nvcc, a compile error)."""
    key = cache_key(src, arch)
    if key in _loaded:
        return _loaded[key]
    root = root or cache_root()
    d = root / key
    why = None
    hit = _cached(src, d)
    if isinstance(hit, tuple):
        try:
            _loaded[key] = (_import(*hit), "cached")
            return _loaded[key]
        except (ImportError, OSError) as e:
            why = f"cache entry {d} is corrupt ({str(e).splitlines()[0]})"
    elif isinstance(hit, str):
        why = f"cache entry {d} is corrupt ({hit})"
    elif not _writable(d):
        why = f"cache directory {root} is not writable"
    if why is None:
        _loaded[key] = (_build(src, d), "built")
    else:
        check_toolchain(src)  # no warning about the cache when nothing could be built anyway
        tmp = Path(tempfile.mkdtemp(prefix=f"kprof-{key}-"))
        warnings.warn(f"kprof: {why}; building {src.name} into {tmp}", stacklevel=2)
        _loaded[key] = (_build(src, tmp), "built-temp")
    return _loaded[key]


__all__ = ["ExtensionSource", "arch_of", "cache_key", "cache_root", "check_toolchain", "load"]
