"""SASS instruction counts of kprof's streaming kernels, compiled ahead of time for sm_90a on any
machine (no GPU needed: ptxas and cuobjdump ship with Triton's NVIDIA backend).

Why: bias + GELU's backward is issue-bound on the H200 (ncu: 69% SM vs 50% DRAM throughput), so
instructions per element, not bytes, set its time. At the measured 4.27 TB/s copy bandwidth an SM
can issue ~47 instructions per element of a 6-byte/element kernel (bf16 backward: read dy, x;
write dx) and ~31 per element of a 4-byte one (forward: read x, write y).

    python -m benchmarks.sass_count                       # the table: bias_gelu and glu, ACT 0/1/2
    python -m benchmarks.sass_count --kernels bg_bwd --act 2 --set maxnreg=None --dump /tmp/sass

For each kernel: registers, local-memory (spill) bytes, total SASS instructions (NOPs left out)
and, for each loop (a backward branch), the instructions from its head to its branch. `loop/elem`:
the per-row-step cost over the elements a thread handles per step (BLOCK_M * BLOCK_N /
(32 * num_warps)), what a persistent kernel (bias_gelu's backward) pays per element; with nested
loops, the innermost one's. `total/elem`: the whole kernel over the same elements, what a
one-tile-per-program kernel (the forwards) pays. Compiled with the launchers' defaults for bf16
(bias_gelu's BWD_MAXNREG). Run it in a
fresh Python WITHOUT TRITON_INTERPRET (it removes the variable itself, before importing triton).

Reproduces: the "SASS per element" table in kernels/bias_gelu.py's docstring and the top README's
bias+GELU erf figures (backward loop 28.8 -> 25.8 instructions per element, forward 25.8 -> 23.8),
with `python -m benchmarks.sass_count` on any machine (CPU is enough).
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)
# Triton <= 3.9 fuses a * b + c into FMA by default (3.9 warns that 3.10 will not); the GPU image's
# 3.6 fuses, so count what it runs.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import argparse  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

# Launch plans measured (kernels/bias_gelu.py, kernels/glu.py at 16384x16384 bf16): the forward's
# streaming plan is one row of 2048 columns at 4 warps (FWD_TILE); the backward's BWD_TILE=2048, BWD_WARPS=8.
KERNELS = {  # name -> (module, function, default constexprs, num_warps)
    "bg_fwd": ("kprof.kernels.bias_gelu", "_bias_gelu_fwd_kernel", {"BLOCK_M": 1, "BLOCK_N": 2048, "EVEN": True}, 4),
    "bg_bwd": ("kprof.kernels.bias_gelu", "_bias_gelu_bwd_kernel", {"BLOCK_M": 1, "BLOCK_N": 2048, "EVEN": True, "ACC_F64": False}, 8),
    "glu_fwd": ("kprof.kernels.glu", "_glu_fwd_kernel", {"BLOCK_M": 1, "BLOCK_N": 4096, "EVEN": True}, 8),
    "glu_bwd": ("kprof.kernels.glu", "_glu_bwd_kernel", {"BLOCK_M": 1, "BLOCK_N": 4096, "EVEN": True}, 8),
}
_FP64_PTRS = {"part_ptr"}  # bias_gelu's fp64 dbias partials; every other pointer is bf16


def _cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def compile_kernel(fn, consts: dict, num_warps: int = 8, arch: int = 90, maxnreg: int | None = None):
    """triton.compile for sm_`arch`, every pointer and integer argument 16-divisible (what the
    JIT specializes for aligned tensors and strides; without it the loads do not vectorize).
    Constexprs missing from `consts` take the kernel's defaults."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}
    sig = {}
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a.endswith("_ptr"):
            sig[a] = "*fp64" if a in _FP64_PTRS else "*bf16"
        else:
            sig[a] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if sig[a] != "constexpr"}
    options = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", arch, 32), options=options)


def _objdump(compiled, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([_cuobjdump(), flag, f.name], capture_output=True, text=True, check=True).stdout


def sass_of(compiled) -> str:
    return _objdump(compiled, "-sass")


def resources(compiled) -> tuple[int, int]:
    """(registers per thread, spill bytes per thread) from `cuobjdump -res-usage`
    (CompiledKernel.n_regs needs a GPU to load the module). Spills: the larger of LOCAL and
    STACK; ptxas reports a register spill of these kernels as STACK with LOCAL 0 (seen with the
    LayerNorm backward, 2026-11-30), so LOCAL alone understated it."""
    text = _objdump(compiled, "-res-usage")

    def field(name):
        m = re.search(name + r":(\d+)", text)
        return int(m.group(1)) if m else 0

    return field("REG"), max(field("LOCAL"), field("STACK"))


_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRA = re.compile(r"\bBRA\b\s+(?:`\(?)?(0x[0-9a-f]+|\.L_x_\d+)")


@dataclass
class Sass:
    lines: list[tuple[int, str]]  # (address, instruction), NOPs left out
    labels: dict[str, int]  # nvdisasm-style label -> address (cuobjdump prints addresses instead)

    @classmethod
    def parse(cls, text: str) -> "Sass":
        lines, labels, pending = [], {}, []
        for raw in text.splitlines():
            m = _LABEL.match(raw)
            if m:
                pending.append(m.group(1))
                continue
            m = _INSN.search(raw)
            if m:
                addr = int(m.group(1), 16)
                labels.update((lab, addr) for lab in pending)
                pending = []
                if not m.group(2).startswith("NOP"):
                    lines.append((addr, m.group(2)))
        if lines and re.fullmatch(r"BRA\s+0x[0-9a-f]+", lines[-1][1]):
            lines.pop()  # the `BRA` to itself after the last EXIT is padding, not code
        return cls(lines, labels)

    @property
    def total(self) -> int:
        return len(self.lines)

    def loops(self) -> list[tuple[int, int]]:
        """(head index, branch index) of each backward branch, outermost first."""
        index = {addr: i for i, (addr, _) in enumerate(self.lines)}
        out = []
        for i, (addr, ins) in enumerate(self.lines):
            m = _BRA.search(ins)
            if not m:
                continue
            tgt = self.labels.get(m.group(1)) if m.group(1).startswith(".") else int(m.group(1), 16)
            if tgt is not None and tgt <= addr:
                head = min((j for a, j in index.items() if a >= tgt), default=None)
                if head is not None:
                    out.append((head, i))
        return sorted(out, key=lambda ab: (ab[0], -ab[1]))

    def opcodes(self, lo: int = 0, hi: int | None = None) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _, ins in self.lines[lo : (hi + 1 if hi is not None else None)]:
            words = ins.split()
            op = words[1] if words[0].startswith("@") else words[0]
            counts[op] = counts.get(op, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def _resolve(name: str, act: int, overrides: dict):
    """(jit function, constexprs, num_warps, maxnreg) for KERNELS[name] at `act` with `overrides`."""
    import importlib

    mod, fn_name, consts, warps = KERNELS[name]
    module = importlib.import_module(mod)
    fn = getattr(module, fn_name)
    consts = {"ACT": act, "FAST": True, **consts}
    maxnreg = getattr(module, _MAXNREG[name]) if name in _MAXNREG else None
    for k, v in overrides.items():
        if k == "num_warps":
            warps = int(v)
        elif k == "maxnreg":
            maxnreg = None if v in ("None", 0) else int(v)
        elif k in fn.arg_names:
            consts[k] = v
        else:
            raise SystemExit(f"{fn.__name__} has no constexpr {k}")
    return fn, consts, warps, maxnreg


# kernels launched with a register cap: the module attribute that holds it
_MAXNREG = {"bg_bwd": "BWD_MAXNREG", "bg_fwd": "FWD_MAXNREG"}


def measure(name: str, act: int, overrides: dict | None = None, dump: str | None = None) -> dict:
    fn, consts, warps, maxnreg = _resolve(name, act, overrides or {})
    k = compile_kernel(fn, consts, warps, maxnreg=maxnreg)
    text = sass_of(k)
    regs, local = resources(k)
    if dump:
        Path(dump).mkdir(parents=True, exist_ok=True)
        Path(dump, f"{name}_act{act}.sass").write_text(text)
    s = Sass.parse(text)
    loops = s.loops()
    per_thread = consts["BLOCK_M"] * consts["BLOCK_N"] / (32 * warps)
    bodies = [b - a + 1 for a, b in loops]
    step = bodies[-1] if loops else s.total
    inner = loops[-1] if loops else (0, len(s.lines) - 1)
    return {
        "kernel": name, "act": act, "regs": regs, "spills": local, "total": s.total,
        "loops": bodies, "loop_per_elem": step / per_thread, "total_per_elem": s.total / per_thread,
        "ops": s.opcodes(*inner),
    }


def _value(v: str):
    return {"True": True, "False": False}.get(v, int(v) if v.lstrip("-").isdigit() else v)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"comma list of {sorted(KERNELS)}")
    p.add_argument("--act", default="0,1,2", help="ACT values: 0 silu, 1 gelu tanh, 2 gelu erf")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="override constexprs (e.g. EVEN=False), num_warps or maxnreg")
    p.add_argument("--dump", help="write each kernel's SASS to DIR/<kernel>_act<act>.sass")
    p.add_argument("--ops", action="store_true", help="print the innermost loop's opcode histogram")
    a = p.parse_args()
    overrides = {k: _value(v) for k, v in (kv.split("=", 1) for kv in a.set)}
    print(f"{'kernel':8s} {'act':>3s} {'regs':>4s} {'local':>5s} {'total':>5s} {'loop body':>10s} {'loop/elem':>9s} "
          f"{'total/elem':>10s}")
    for name in a.kernels.split(","):
        for act in (int(x) for x in a.act.split(",")):
            r = measure(name, act, overrides, a.dump)
            loops = "/".join(map(str, r["loops"])) or "-"
            print(f"{name:8s} {act:3d} {r['regs']:4d} {r['spills']:5d} {r['total']:5d} {loops:>10s} "
                  f"{r['loop_per_elem']:9.1f} {r['total_per_elem']:10.1f}", flush=True)
            if a.ops:
                print("   ", " ".join(f"{op}:{n}" for op, n in r["ops"].items()), flush=True)


if __name__ == "__main__":
    main()
