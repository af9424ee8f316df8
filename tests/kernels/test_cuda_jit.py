"""kprof.kernels.cuda_jit: the disk cache of built extensions, on the CPU.

A CPU build of the CUDA router is impossible here (CPU torch, no CUDA runtime), so the cache's key,
hit, read-only and corrupt paths are tested with a tiny CPU-only C++ extension (Python's C API,
compiled by the same `cpp_extension.load` call). The cached load runs in a second process with
no compiler and no ninja on its PATH, so a hit that compiled anything would fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kprof.errors import KprofError
from kprof.kernels import cuda_jit

TINY = r"""
#include <Python.h>
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define STR2(a) #a
#define STR(a) STR2(a)
static PyObject* add_one(PyObject*, PyObject* a) { return PyLong_FromLong(PyLong_AsLong(a) + 1); }
static PyMethodDef methods[] = {{"add_one", add_one, METH_O, "x + 1"}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef def = {PyModuleDef_HEAD_INIT, STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};
PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&def); }
"""


def tiny(tag: str = "") -> cuda_jit.ExtensionSource:
    return cuda_jit.ExtensionSource(name="jit_test", cpp={"tiny.cpp": TINY + f"// {tag}\n"}, cuda={}, cflags=("-O0",))


slow = pytest.mark.slow
needs_cxx = pytest.mark.skipif(
    any(cuda_jit.shutil.which(t) is None for t in ("c++", "ninja")), reason="needs a C++ compiler and ninja")


@pytest.fixture
def fresh(monkeypatch):
    """No in-process hits from other tests."""
    monkeypatch.setattr(cuda_jit, "_loaded", {})


def test_cache_key_names_source_arch_and_torch(monkeypatch):
    a = cuda_jit.cache_key(tiny(), "sm_90")
    assert a.startswith("jit_test-") and "-sm_90-torch" in a
    assert cuda_jit.cache_key(tiny(), "sm_100") != a
    assert cuda_jit.cache_key(tiny("changed"), "sm_90") != a
    monkeypatch.setattr(cuda_jit.torch, "__version__", "9.9.9+cu999")
    assert cuda_jit.cache_key(tiny(), "sm_90").endswith("torch9.9.9_cu999")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    assert cuda_jit.cache_key(tiny(), "sm_90") != a


def test_no_compiler_is_one_line_error(monkeypatch, tmp_path, fresh):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(KprofError, match="no C\\+\\+ compiler") as e:
        cuda_jit.load(tiny(), "cpu", tmp_path / "cache")
    assert "\n" not in str(e.value)


_SECOND_PROCESS = """
import sys, time, warnings
warnings.simplefilter("error")  # a rebuild would warn or need the compiler
from kprof.kernels import cuda_jit
sys.path.insert(0, sys.argv[2])
from test_cuda_jit import tiny
t0 = time.perf_counter()  # the load alone: torch and kprof are imported by then in any user
mod, how = cuda_jit.load(tiny(), "cpu", __import__("pathlib").Path(sys.argv[1]))
print(how, mod.add_one(41), f"{time.perf_counter() - t0:.4f}")
"""


@needs_cxx
def test_second_process_loads_from_cache_without_compiler(tmp_path, fresh):
    root = tmp_path / "cache"
    mod, how = cuda_jit.load(tiny(), "cpu", root)
    assert (how, mod.add_one(1)) == ("built", 2)
    entry = root / cuda_jit.cache_key(tiny(), "cpu")
    assert json.loads((entry / "manifest.json").read_text())["module"] == cuda_jit._module_name(tiny())
    # No compiler and no ninja in the second process: only the cached object can serve it.
    env = {**os.environ, "PATH": str(tmp_path / "empty"), "CXX": str(tmp_path / "no-such-c++")}
    out = subprocess.run([sys.executable, "-c", _SECOND_PROCESS, str(root), os.path.dirname(__file__)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    how, value, seconds = out.stdout.split()
    assert (how, value) == ("cached", "42")
    print(f"cached load in a second process: {seconds} s")  # reported, not asserted: no timed assertions


def _corrupt_object(entry):
    so = next(entry.glob("*.so"))
    so.unlink()  # a new file: this process still maps the old one (writing into it is a SIGBUS)
    so.write_bytes(b"\x7fELF garbage")


def _corrupt_manifest(entry):
    (entry / "manifest.json").write_text("{not json")


@needs_cxx
@pytest.mark.parametrize("corrupt", [_corrupt_object, pytest.param(_corrupt_manifest, marks=slow)],
                         ids=["object", "manifest"])
def test_corrupt_entry_rebuilds_into_temp(corrupt, tmp_path, fresh, monkeypatch):
    root, src = tmp_path / "cache", tiny(corrupt.__name__)
    cuda_jit.load(src, "cpu", root)
    corrupt(root / cuda_jit.cache_key(src, "cpu"))
    monkeypatch.setattr(cuda_jit, "_loaded", {})
    with pytest.warns(UserWarning, match="is corrupt") as w:
        mod, how = cuda_jit.load(src, "cpu", root)
    assert how == "built-temp" and mod.add_one(2) == 3
    assert len(str(w[0].message).splitlines()) == 1


@needs_cxx
@slow
def test_unwritable_cache_rebuilds_into_temp(tmp_path, fresh):
    # A root below a regular file cannot be created by anyone (chmod would not stop root, and CI
    # may run as root).
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="not writable"):
        mod, how = cuda_jit.load(tiny("ro"), "cpu", blocker / "cache")
    assert how == "built-temp" and mod.add_one(5) == 6


@needs_cxx
@slow
@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through a read-only mode")
def test_read_only_cache_rebuilds_into_temp(tmp_path, fresh):
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o555)
    try:
        with pytest.warns(UserWarning, match="not writable"):
            _, how = cuda_jit.load(tiny("ro2"), "cpu", root)
        assert how == "built-temp"
    finally:
        root.chmod(0o755)
