"""Benchmark cases: SwiGLU / GeGLU (separate and packed gate|up) and bias + GELU.

Shapes and targets from the issue (H200, bf16). Floors at the measured 4.27 TB/s copy bandwidth:
- gate, up 8192x11008 (Llama-7B MLP width, 8K tokens; 180 MB per tensor, past the 60 MB L2):
  fwd 541 MB -> 127 us, fwd+bwd 1.44 GB -> 338 us.
- x 16384x16384 (537 MB): fwd 1.07 GB -> 251 us, fwd+bwd 2.68 GB -> 629 us.
Eager peers are the formulations users run today: HF LlamaMLP `act_fn(gate) * up`, Phi-3's
`gate, up = gate_up.chunk(2, -1)`, GPT-2's `gelu_new` (NewGELUActivation's explicit tanh
formula) on `x + bias`, and `F.gelu(x + bias)` (nn.GELU's erf default).

Liger notes: LigerSiLUMulFunction / LigerGELUMulFunction write d_gate, d_up into the saved gate
and up buffers in place (their backward overwrites the inputs), and Liger's GeGLU is tanh-only.
Liger has no bias+GELU kernel.

Reproduces (H200): the GLU and bias+GELU rows of the top README's kernel table (bench_kernels.py), and
    python -m benchmarks.cases.glu bias_gelu_fwd   glusweep-h200-20261130T0347-fwd.txt in benchmarks/results/
                                                   (forward tile 2048 + 32-register cap: erf 284.6 -> 261.4 us)
    python -m benchmarks.cases.glu bias_gelu       the backward tile/warps/dbias figures in kernels/bias_gelu.py
    python -m benchmarks.cases.glu glu_tiles       GLU_TILE's sweep in kernels/glu.py (SwiGLU fwd+bwd 332.5 us at 1024)
(the last two ran at 2026-11-30 01:22/03:22; their files are summarised in docs/results.md).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from benchmarks.cases import Case
from kprof.kernels import bias_gelu as _bg
from kprof.kernels import glu as _glu

# Measured H200 device-to-device copy bandwidth (bytes read + written), the reference;
# the harness re-measures it in every run for the pct_copy_bw column.
_H200_COPY_BW = 4.27e12
_M, _I = 8192, 11008  # SwiGLU/GeGLU: tokens x intermediate size (Llama-7B)
_BM, _BN = 16384, 16384  # bias + GELU


def _glu_inputs(approximate: str | None):
    def make(device, dtype):
        gate = torch.randn(_M, _I, device=device, dtype=dtype, requires_grad=True)
        up = torch.randn(_M, _I, device=device, dtype=dtype, requires_grad=True)
        return {"gate": gate, "up": up} if approximate is None else {"gate": gate, "up": up, "approximate": approximate}

    return make


def _packed_inputs(device, dtype):
    return {"gu": torch.randn(_M, 2 * _I, device=device, dtype=dtype, requires_grad=True)}


def _bias_inputs(approximate: str):
    def make(device, dtype):
        return {
            "x": torch.randn(_BM, _BN, device=device, dtype=dtype, requires_grad=True),
            "bias": torch.randn(_BN, device=device, dtype=dtype, requires_grad=True),
            "approximate": approximate,
        }

    return make


# --- eager formulations -------------------------------------------------------------------


def _eager_swiglu(gate, up):
    return F.silu(gate) * up  # HF LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)


def _eager_geglu(gate, up, approximate):
    return F.gelu(gate, approximate=approximate) * up  # HF GemmaMLP (gelu_pytorch_tanh)


def _eager_swiglu_packed(gu):
    gate, up = gu.chunk(2, dim=-1)  # HF Phi3MLP: gate_up_proj, then chunk
    return F.silu(gate) * up


def _eager_bias_gelu_new(x, bias, approximate):
    # GPT-2: c_fc output (here without its bias) + bias, then NewGELUActivation (gelu_new).
    t = x + bias
    return 0.5 * t * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (t + 0.044715 * torch.pow(t, 3.0))))


def _eager_bias_gelu(x, bias, approximate):
    return F.gelu(x + bias, approximate=approximate)


# --- Liger factories (imported lazily: this file must import without Liger) ---------------


def _liger_swiglu():
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return lambda gate, up: LigerSiLUMulFunction.apply(gate, up)


def _liger_geglu():
    from liger_kernel.ops.geglu import LigerGELUMulFunction  # tanh approximation only

    def run(gate, up, approximate):
        if approximate != "tanh":
            raise ValueError("Liger's GeGLU implements only approximate='tanh'")
        return LigerGELUMulFunction.apply(gate, up)

    return run


def _liger_swiglu_packed():
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    # What a Liger user does for a fused gate_up projection: chunk, then Liger copies each half
    # to contiguous memory (its ensure_contiguous) before the kernel.
    return lambda gu: LigerSiLUMulFunction.apply(*gu.chunk(2, dim=-1))


def _targets_at_bw_fraction(kernel: str, problem: dict, fraction: float) -> dict:
    """Times (us) at which the kernel reaches `fraction` of the H200 copy bandwidth."""
    from kprof.kernels import registry

    c = registry.get(kernel).cost(**problem)
    return {
        "fwd": round(c["fwd"].bytes / (fraction * _H200_COPY_BW) * 1e6, 1),
        "fwdbwd": round((c["fwd"].bytes + c["bwd"].bytes) / (fraction * _H200_COPY_BW) * 1e6, 1),
    }


_GLU_PROBLEM = {"n_rows": _M, "n_cols": _I, "dtype": torch.bfloat16}
_BIAS_TANH = {"n_rows": _BM, "n_cols": _BN, "dtype": torch.bfloat16, "approximate": "tanh"}
_BIAS_ERF = {"n_rows": _BM, "n_cols": _BN, "dtype": torch.bfloat16, "approximate": "none"}

CASES: list[Case] = [
    Case(
        kernel="swiglu",
        label=f"SwiGLU gate,up {_M}x{_I}",
        make_inputs=_glu_inputs(None),
        kprof=_glu.swiglu,
        eager=_eager_swiglu,
        liger=_liger_swiglu,
        problem=_GLU_PROBLEM,
        targets_us={"fwd": 135, "fwdbwd": 375},  # issue; torch.compile 130 fwd, Liger 465 fwd+bwd
    ),
    Case(
        kernel="geglu",
        label=f"GeGLU(tanh) gate,up {_M}x{_I}",
        make_inputs=_glu_inputs("tanh"),
        kprof=_glu.geglu,
        eager=_eager_geglu,
        liger=_liger_geglu,
        problem={**_GLU_PROBLEM, "approximate": "tanh"},
        # issue: fwd <= 135; fwd+bwd no slower than torch.compile, measured there at 340 us
        targets_us={"fwd": 135, "fwdbwd": 340},
    ),
    Case(
        kernel="swiglu_packed",
        label=f"SwiGLU packed gate|up {_M}x{2 * _I}",
        make_inputs=_packed_inputs,
        kprof=_glu.swiglu_packed,
        eager=_eager_swiglu_packed,
        liger=_liger_swiglu_packed,
        problem=_GLU_PROBLEM,  # same bytes as the separate form
        targets_us={"fwd": 135, "fwdbwd": 375},  # not in the issue: held to the separate form's targets
    ),
    Case(
        kernel="bias_gelu",
        label=f"Bias+GELU(tanh, GPT-2 gelu_new) {_BM}x{_BN}",
        make_inputs=_bias_inputs("tanh"),
        kprof=_bg.bias_gelu,
        eager=_eager_bias_gelu_new,
        liger=None,
        problem=_BIAS_TANH,
        targets_us=_targets_at_bw_fraction("bias_gelu", _BIAS_TANH, 0.90),  # issue: >= 90% of copy BW
    ),
    Case(
        kernel="bias_gelu",
        label=f"Bias+GELU(erf) {_BM}x{_BN}",
        make_inputs=_bias_inputs("none"),
        kprof=_bg.bias_gelu,
        eager=_eager_bias_gelu,
        liger=None,
        problem=_BIAS_ERF,
        targets_us=_targets_at_bw_fraction("bias_gelu", _BIAS_ERF, 0.90),
    ),
]


# --- launch-config sweep for bias + GELU's backward (run on the GPU; not part of CASES) --------

_BWD_KNOBS = ("BWD_TILE", "BWD_WARPS", "_PROGRAMS_PER_SM", "BWD_MAXNREG")


def _resident_regs(per_sm: int, warps: int) -> int | None:
    """The register cap at which `per_sm` programs of `warps` warps share an SM's 65536
    registers (ptxas allocates in steps of 8), or None where that is under 64 (the backward
    needs ~60 at the default tile: a lower cap spills, so those configs run uncapped, as before)."""
    regs = min(255, 65536 // (per_sm * warps * 32) // 8 * 8)
    return regs if regs >= 64 else None


def _bwd_configs() -> list[dict]:
    """(a) tile x warps x programs per SM, each at the cap that keeps its grid resident;
    (b) the default tile without the register cap. (The fp64 dbias accumulator for bf16 was a
    third variant; its switch is gone, docs/kernels.md.) 1024-element tiles and 16 programs per SM, slower
    in every earlier sweep, were dropped to keep the sweep inside one device call. (2026-11-30 01:22 also swept fp32 blocks of
    4-32 tiles per fp64 dbias add: slower for tanh, equal for erf; removed.)"""
    import itertools

    configs = [
        {"BWD_TILE": tile, "BWD_WARPS": warps, "_PROGRAMS_PER_SM": per_sm, "BWD_MAXNREG": _resident_regs(per_sm, warps)}
        for tile, warps, per_sm in itertools.product((2048, 4096), (4, 8), (4, 8))
    ]
    configs += [{"BWD_MAXNREG": None}]
    return configs


def sweep_bias_gelu() -> list[dict]:
    """GPU kernel time (torch.profiler, host overhead excluded; `benchmarks.cases.norms.
    kernel_time_us`) of kprof's bias + GELU at the issue's shape, tanh and erf: the forward once,
    then forward+backward over the backward's launch knobs (kernels/bias_gelu.py BWD_TILE,
    BWD_WARPS, _PROGRAMS_PER_SM, BWD_MAXNREG; `_bwd_configs`), each checked against
    the default config; knobs a config leaves out keep their defaults. % of copy bandwidth from
    the cost model's bytes and the issue's 4.27 TB/s. `python -m benchmarks.cases.glu`."""
    from benchmarks.cases.norms import kernel_time_us
    from kprof.kernels import registry

    defaults = {k: getattr(_bg, k) for k in _BWD_KNOBS}

    def use(config: dict) -> None:
        for k, v in {**defaults, **config}.items():
            setattr(_bg, k, v)

    rows = []
    try:
        for problem in (_BIAS_TANH, _BIAS_ERF):
            approx = problem["approximate"]
            cost = registry.get("bias_gelu").cost(**problem)
            fb_bytes = cost["fwd"].bytes + cost["bwd"].bytes
            inputs = _bias_inputs(approx)("cuda", torch.bfloat16)
            leaves = [inputs["x"], inputs["bias"]]
            dy = torch.randn_like(inputs["x"])
            use({})
            ref_y = _bg.bias_gelu(**inputs)
            ref = torch.autograd.grad(ref_y, leaves, dy)
            us = kernel_time_us(lambda: _bg.bias_gelu(**inputs), [])
            print(f"bias_gelu {approx:4s} fwd {us:7.1f} us  {100 * cost['fwd'].bytes / (us * 1e-6) / _H200_COPY_BW:5.1f}% of copy BW",
                  flush=True)
            for config in _bwd_configs():
                use(config)
                knobs = {k: getattr(_bg, k) for k in _BWD_KNOBS}
                label = " ".join(f"{k.strip('_').lower()}={v}" for k, v in knobs.items())
                try:
                    got = torch.autograd.grad(_bg.bias_gelu(**inputs), leaves, dy)
                    ok = all(bool((a.float() - b.float()).abs().max() <= 1e-2 * b.float().abs().max()) for a, b in zip(got, ref))
                    us = kernel_time_us(lambda: torch.autograd.backward(_bg.bias_gelu(**inputs), dy), leaves)
                except Exception as e:  # noqa: BLE001 - a config that fails to compile is a result
                    ok, us = False, float("nan")
                    print(f"  {label}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                pct = 100 * fb_bytes / (us * 1e-6) / _H200_COPY_BW
                rows.append({"act": approx, **knobs, "us": us, "pct": pct, "ok": ok})
                print(f"bias_gelu {approx:4s} fwd+bwd {label} {us:7.1f} us {pct:5.1f}% {'' if ok else 'MISMATCH'}", flush=True)
            inputs = leaves = dy = ref = ref_y = None
            torch.cuda.empty_cache()
    finally:
        use({})
    return rows


def sweep_bias_gelu_fwd(tiles=(2048, 4096, 8192), caps=(None, 32)) -> list[dict]:
    """GPU kernel time (torch.profiler, as sweep_bias_gelu) of bias + GELU's forward, tanh and
    erf, over elements per program (`bias_gelu.FWD_TILE`; 8 warps from 4096 up, else 4) and the
    register cap (`FWD_MAXNREG`: 32 lets 8 programs of 8 warps share an SM), each checked bitwise
    against the default (the launch changes no value). `python -m benchmarks.cases.glu bias_gelu_fwd`."""
    from benchmarks.cases.norms import kernel_time_us
    from kprof.kernels import registry

    defaults = (_bg.FWD_TILE, _bg.FWD_MAXNREG)

    def use(tile, cap):
        _bg.FWD_TILE, _bg.FWD_MAXNREG = tile, cap

    rows = []
    try:
        for problem in (_BIAS_TANH, _BIAS_ERF):
            approx = problem["approximate"]
            fwd_bytes = registry.get("bias_gelu").cost(**problem)["fwd"].bytes
            inputs = _bias_inputs(approx)("cuda", torch.bfloat16)
            use(*defaults)
            with torch.no_grad():
                ref = _bg.bias_gelu(**inputs)
            for tile in tiles:
                for cap in caps:
                    use(tile, cap)
                    with torch.no_grad():
                        ok = torch.equal(_bg.bias_gelu(**inputs), ref)
                        us = kernel_time_us(lambda: _bg.bias_gelu(**inputs), [])
                    pct = 100 * fwd_bytes / (us * 1e-6) / _H200_COPY_BW
                    rows.append({"act": approx, "tile": tile, "maxnreg": cap, "us": us, "pct": pct, "ok": ok})
                    print(f"bias_gelu {approx:4s} fwd tile={tile:5d} maxnreg={cap} {us:7.1f} us {pct:5.1f}% "
                          f"{'' if ok else 'MISMATCH'}", flush=True)
            inputs = ref = None
            torch.cuda.empty_cache()
    finally:
        use(*defaults)
    return rows


def sweep_glu_tiles(tiles=(1024, 2048, 4096, 8192)) -> list[dict]:
    """GPU kernel time (torch.profiler, as sweep_bias_gelu) of kprof's SwiGLU and GeGLU(tanh)
    fwd and fwd+bwd at the issue's 8192x11008 over the streaming tile (`glu.GLU_TILE`: elements
    per program; 8 warps from 4096 up, else 4), each checked against the default tile.
    GeGLU's target is torch.compile's time in the same run, so compile's is measured beside it.
    `python -m benchmarks.cases.glu glu_tiles`."""
    from benchmarks.cases.norms import kernel_time_us

    default = _glu.GLU_TILE

    def use(tile):
        _glu.GLU_TILE = tile

    rows = []
    try:
        for name, fn, eager, approx in (("swiglu", _glu.swiglu, _eager_swiglu, None),
                                        ("geglu_tanh", _glu.geglu, _eager_geglu, "tanh")):
            inputs = _glu_inputs(approx)("cuda", torch.bfloat16)
            leaves = [inputs["gate"], inputs["up"]]
            dy = torch.randn_like(inputs["gate"])
            use(default)
            ref = torch.autograd.grad(fn(**inputs), leaves, dy)
            compiled = torch.compile(eager)
            for mode, step in (("fwd", lambda f: f(**inputs)), ("fwd+bwd", lambda f: torch.autograd.backward(f(**inputs), dy))):
                us = kernel_time_us(lambda: step(compiled), leaves if mode != "fwd" else [])
                rows.append({"kernel": name, "impl": "torch.compile", "mode": mode, "tile": None, "us": us, "ok": True})
                print(f"{name:10s} {mode:7s} torch.compile {us:7.1f} us", flush=True)
            for tile in tiles:
                use(tile)
                got = torch.autograd.grad(fn(**inputs), leaves, dy)
                ok = all(torch.equal(a, b) for a, b in zip(got, ref))  # elementwise: the tile changes no value
                for mode, step in (("fwd", lambda f: f(**inputs)), ("fwd+bwd", lambda f: torch.autograd.backward(f(**inputs), dy))):
                    us = kernel_time_us(lambda: step(fn), leaves if mode != "fwd" else [])
                    rows.append({"kernel": name, "impl": "kprof", "mode": mode, "tile": tile, "us": us, "ok": ok})
                    print(f"{name:10s} {mode:7s} kprof tile={tile:5d} {us:7.1f} us {'' if ok else 'MISMATCH'}", flush=True)
            inputs = leaves = dy = ref = compiled = None
            torch.cuda.empty_cache()
    finally:
        use(default)
    return rows


if __name__ == "__main__":
    import sys

    what = sys.argv[1:] or ["bias_gelu"]
    if "bias_gelu" in what:
        sweep_bias_gelu()
    if "bias_gelu_fwd" in what:
        sweep_bias_gelu_fwd()
    if "glu_tiles" in what:
        sweep_glu_tiles()
