"""Benchmark cases: RMSNorm (Llama and Gemma casting), fused residual add + RMSNorm, LayerNorm.

Shape from the issue: 16384 tokens x 4096 hidden, bf16 (128 MiB per activation tensor, past
the H200's 60 MB L2). Floors at the measured 4.27 TB/s copy bandwidth (bytes from the specs'
cost models):
- RMSNorm:   fwd 268 MB -> 63 us; fwd+bwd 671 MB -> 157 us. Targets 70 / 200 us (issue;
  Liger 0.6 measured 70 / 680, torch.compile 132 / 739).
- LayerNorm: fwd 268 MB -> 63 us; fwd+bwd 671 MB -> 157 us. Targets 70 / 200 us (issue).
- add + RMSNorm: fwd 537 MB -> 126 us; fwd+bwd 1.07 GB -> 252 us. No target in the issue.
- Gemma RMSNorm: same bytes as Llama's. No target in the issue.

Eager peers are the formulations users run today: transformers' LlamaRMSNorm and GemmaRMSNorm
forward bodies, the decoder layer's `hidden = residual + hidden` followed by the norm, and
F.layer_norm (nn.LayerNorm). eps as in the models' configs: Llama-2/3 rms_norm_eps 1e-5,
Gemma 1e-6, nn.LayerNorm's default 1e-5.
Liger (0.6.x) peers run with in_place=False: in place, Liger writes dx into the incoming dy,
which the harness reuses across repeats.

Reproduces (H200): the norm rows of the top README's kernel table (bench_kernels.py), and
    python -m benchmarks.cases.norms ln_bwd   normsweep-h200-20261130T0349-ln-bwd.txt in benchmarks/results/
                                              (LayerNorm fwd+bwd 219.9 -> 184.5 us, the README's "What moved")
    python -m benchmarks.cases.norms          the backward block/warps sweep quoted in kernels/rms_norm.py
                                              (8192 elements x 8 warps x 2 programs/SM 181.5 us, 2026-11-29)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.cases import Case
from kprof.kernels import layer_norm as _ln
from kprof.kernels import rms_norm as _rms

_M, _N = 16384, 4096
_PROBLEM = {"n_rows": _M, "n_cols": _N, "dtype": torch.bfloat16}


def _act(device, dtype):
    return torch.randn(_M, _N, device=device, dtype=dtype, requires_grad=True)


def _weight(device, dtype, center: float):
    return (torch.randn(_N, device=device) * 0.1 + center).to(dtype).requires_grad_()


def _llama_inputs(device, dtype):
    return {"x": _act(device, dtype), "weight": _weight(device, dtype, 1.0), "eps": 1e-5}


def _gemma_inputs(device, dtype):
    # Gemma stores the scale minus one (zeros at init); the norm multiplies by 1 + weight.
    return {"x": _act(device, dtype), "weight": _weight(device, dtype, 0.0), "eps": 1e-6, "offset": 1.0, "casting": "gemma"}


def _add_inputs(device, dtype):
    return {"x": _act(device, dtype), "residual": _act(device, dtype), "weight": _weight(device, dtype, 1.0), "eps": 1e-5}


def _ln_inputs(device, dtype):
    return {
        "x": _act(device, dtype),
        "weight": _weight(device, dtype, 1.0),
        "bias": _weight(device, dtype, 0.0),
        "eps": 1e-5,
    }


def _eager_llama_rms_norm(x, weight, eps):
    # transformers' LlamaRMSNorm.forward
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def _eager_gemma_rms_norm(x, weight, eps, offset, casting):
    # transformers' GemmaRMSNorm.forward (offset is Gemma's literal 1.0)
    h = x.float()
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = out * (offset + weight.float())
    return out.type_as(x)


def _eager_add_rms_norm(x, residual, weight, eps):
    # LlamaDecoderLayer: `hidden_states = residual + hidden_states`, then post_attention_layernorm
    s = residual + x
    return _eager_llama_rms_norm(s, weight, eps), s


def _eager_layer_norm(x, weight, bias, eps):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _liger_rms_norm():
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return lambda x, weight, eps: LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False)


def _liger_gemma_rms_norm():
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return lambda x, weight, eps, offset, casting: LigerRMSNormFunction.apply(x, weight, eps, offset, casting, False)


def _liger_add_rms_norm():
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

    # Liger's S = X + R, returns (Y, S): the same contract as kprof's rms_norm_add.
    return lambda x, residual, weight, eps: LigerFusedAddRMSNormFunction.apply(
        x, residual, weight, eps, 0.0, "llama", False
    )


def _liger_layer_norm():
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    return lambda x, weight, bias, eps: LigerLayerNormFunction.apply(x, weight, bias, eps)


CASES: list[Case] = [
    Case(
        kernel="rms_norm",
        label=f"RMSNorm (Llama) {_M}x{_N}",
        make_inputs=_llama_inputs,
        kprof=_rms.rms_norm,
        eager=_eager_llama_rms_norm,
        liger=_liger_rms_norm,
        problem=_PROBLEM,
        targets_us={"fwd": 70, "fwdbwd": 200},  # issue; floors 63 / 157 us
    ),
    Case(
        kernel="rms_norm",
        label=f"RMSNorm (Gemma) {_M}x{_N}",
        make_inputs=_gemma_inputs,
        kprof=_rms.rms_norm,
        eager=_eager_gemma_rms_norm,
        liger=_liger_gemma_rms_norm,
        problem={**_PROBLEM, "casting": "gemma"},
        targets_us={},  # no target in the issue; same bytes as Llama's
    ),
    Case(
        kernel="rms_norm_add",
        label=f"add + RMSNorm {_M}x{_N}",
        make_inputs=_add_inputs,
        kprof=_rms.rms_norm_add,
        eager=_eager_add_rms_norm,
        liger=_liger_add_rms_norm,
        problem=_PROBLEM,
        targets_us={},  # no target in the issue; floors 126 / 252 us
    ),
    Case(
        kernel="layer_norm",
        label=f"LayerNorm {_M}x{_N}",
        make_inputs=_ln_inputs,
        kprof=_ln.layer_norm,
        eager=_eager_layer_norm,
        liger=_liger_layer_norm,
        problem=_PROBLEM,
        targets_us={"fwd": 70, "fwdbwd": 200},  # issue; floors 63 / 157 us
    ),
]


# --- launch-config sweep for the norm kernels (run on the GPU; not part of CASES) -------------


def kernel_time_us(step, leaves, iters: int = 20) -> float:
    """Summed GPU kernel time of one call of `step` (torch.profiler, median-free mean over `iters`
    calls after 3 warm-ups): the device work alone, without the host's launch gaps. (A CUDA-graph
    replay was the first choice; capturing this backward failed on the H200, 2026-11-29.)"""
    return kernel_times_us(step, leaves, iters)[0]


def kernel_times_us(step, leaves, iters: int = 20) -> tuple[float, dict[str, float]]:
    """kernel_time_us, and the GPU time per call of each kernel name (us) behind the sum."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        for t in leaves:
            t.grad = None
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            for t in leaves:
                t.grad = None
            step()
        torch.cuda.synchronize()
    per_name: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name] = per_name.get(e.name, 0.0) + e.device_time / iters
    for t in leaves:
        t.grad = None
    return sum(per_name.values()), per_name


def sweep_norm_configs() -> list[dict]:
    """GPU kernel time (torch.profiler, host overhead excluded) of kprof's RMSNorm and LayerNorm at the
    issue's shape over the launch knobs of kernels/rms_norm.py (shared by layer_norm): elements per
    block and warps for the forward; elements per block, warps and programs per SM for the
    persistent backward. `python -m benchmarks.cases.norms`. Each config is checked against the
    default one first. Rows sorted by time per (norm, pass); the first is what RowConfig should pick.
    """
    import itertools

    mods = {"rms_norm": (_rms.rms_norm, _llama_inputs), "layer_norm": (_ln.layer_norm, _ln_inputs)}
    defaults = (_rms.FWD_BLOCK_ELEMS, {"rms_norm": _rms.BWD_BLOCK_ELEMS, "layer_norm": _ln.BWD_BLOCK_ELEMS},
                _rms.BWD_PROGRAMS_PER_SM, _rms.num_warps, (_rms.BWD_MAX_WARPS, _ln.BWD_MAX_WARPS))

    def configure(fwd_elems, bwd_elems, per_sm, warps):
        """bwd_elems: one int for both norms, or the defaults' per-norm dict; warps None = auto."""
        per_norm = bwd_elems if isinstance(bwd_elems, dict) else {"rms_norm": bwd_elems, "layer_norm": bwd_elems}
        _rms.FWD_BLOCK_ELEMS, _rms.BWD_PROGRAMS_PER_SM = fwd_elems, per_sm
        _rms.BWD_BLOCK_ELEMS, _ln.BWD_BLOCK_ELEMS = per_norm["rms_norm"], per_norm["layer_norm"]
        _rms.num_warps = (lambda elems, **kw: warps) if warps else defaults[3]  # RowConfig's pick
        # A swept warp count lifts the backward's cap; "auto" keeps each norm's default cap.
        _rms.BWD_MAX_WARPS, _ln.BWD_MAX_WARPS = (16, 16) if warps else defaults[4]
        _rms.RowConfig.forward.cache_clear()
        _ln._forward_config.cache_clear()  # built on RowConfig.forward
        _rms.RowConfig.backward.cache_clear()

    rows = []
    try:
        for name, (fn, make) in mods.items():
            inputs = make("cuda", torch.bfloat16)
            x, leaves = inputs["x"], [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.requires_grad]
            dy = torch.randn_like(x)
            configure(*defaults[:3], None)
            ref_y = fn(**inputs)  # the default launch config is the reference
            ref = torch.autograd.grad(ref_y, leaves, dy)
            ref_y = ref_y.detach()
            # The forward was swept on 2026-11-29 (71-80 us at every setting, the default 71.7): bwd only.
            # ptxas (Triton 3.9, sm_90a) registers per thread of the RMSNorm backward at 4096 columns:
            # 1 row x 16 warps 81 with fp64 dw partials, 58 with fp32 (two 512-thread programs fit an
            # SM: 50% occupancy instead of ncu's 25%); 2 rows x 16 warps 115 / 114; 1 row x 8 warps
            # 118 / 147. LayerNorm's: 103 / 100, 128 / 108, 239 / 194.
            # 21:37 UTC sweep: fp32 partials beat fp64 at every setting (the fp64 variant is
            # gone, docs/kernels.md), 16 warps lost everywhere: 4 warps and 3 programs/SM added.
            grid = [("bwd", defaults[0], e, p, w)
                    for e, p, w in itertools.product((4096, 8192), (2, 3, 4), (None, 4, 8))]
            for mode, fe, be, p, w in grid:
                configure(fe, be, p, w)
                try:
                    y = fn(**inputs)
                    got = torch.autograd.grad(y, leaves, dy)
                    # Another reduction tree changes low bits, never more than bf16 rounding.
                    ok = all(bool((a.float() - b.float()).abs().max() <= 1e-2 * b.float().abs().max())
                             for a, b in zip((y, *got), (ref_y, *ref)))
                    us = kernel_time_us((lambda: fn(**inputs)) if mode == "fwd"
                                        else (lambda: torch.autograd.backward(fn(**inputs), dy)), leaves)
                except Exception as e:  # noqa: BLE001 - a config that fails to compile is a result
                    ok, us = False, float("nan")
                    print(f"{name} {mode} {fe} {be} {p} {w}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                r = {"norm": name, "mode": mode if mode == "fwd" else "fwd+bwd", "fwd_elems": fe, "bwd_elems": be,
                     "per_sm": p, "warps": w or "auto", "us": us, "ok": ok}
                rows.append(r)
                print(f"{name:10s} {r['mode']:7s} bwd_elems={be:6d} per_sm={p} warps={str(w or 'auto'):4s} "
                      f"{us:8.1f} us {'' if ok else 'MISMATCH'}", flush=True)
            inputs = x = leaves = dy = ref = ref_y = None  # free before the next norm's tensors
            torch.cuda.empty_cache()
    finally:
        configure(*defaults[:3], None)
    for name in mods:
        for mode in ("fwd+bwd",):
            best = sorted((r for r in rows if r["norm"] == name and r["mode"] == mode and r["ok"]), key=lambda r: r["us"])[:3]
            print(f"best {name} {mode}: " + "; ".join(f"{b['us']:.1f} us ({b})" for b in best), flush=True)
    return rows


# --- LayerNorm backward variants (run on the GPU; `python -m benchmarks.cases.norms ln_bwd`) ---

# name -> knob settings on top of the module defaults: {(module, attribute): value}. Registers
# per thread of the backward (ptxas sm_90a, bf16, weight and bias, mean pair; an SM holds 64K):
# 2 x 4096 at 4 warps 255 (prefetch 255 + 320 B spill), at 8 warps 166 (206), at 16 warps 99
# (118); 1 x 4096 at 4 warps 205 (249), at 8 warps 108 (162; 124 without spill under maxnreg
# 128). The 2026-11-30 03:49 run (`normsweep-h200-20261130T0349-ln-bwd.txt`) also timed the
# variants whose switches are gone (prefetch, fp64 partials, torch's second stage; figures in
# docs/kernels.md); the winner, 8 warps capped at 128 (184.5 us), is the default.
_NOCAP, _W4 = {(_ln, "BWD_MAXNREG"): None}, {(_ln, "BWD_MAX_WARPS"): 4}
LN_BWD_VARIANTS: dict[str, dict] = {
    "default (2 x 4096, 8 warps, maxnreg 128, sum kernel)": {},
    "2 x 4096, 4 warps, uncapped (before 03:49)": {**_W4, **_NOCAP},
    "default, sum tile 64 rows (loops)": {(_rms, "PARTIALS_MAX_BLOCK_P"): 64},
}
RMS_BWD_VARIANTS: dict[str, dict] = {
    "default (fp32 partials, sum kernel)": {},
}


def _set_knobs(knobs: dict) -> dict:
    """Apply {(module, attribute): value}; returns the previous values (for _set_knobs again)."""
    old = {k: getattr(*k) for k in knobs}
    for (mod, attr), v in knobs.items():
        setattr(mod, attr, v)
    _rms.RowConfig.backward.cache_clear()
    return old


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: 0 for identical tensors, ~4e-3 for one bf16 rounding."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def sweep_ln_bwd(iters: int = 20, graph_calls: int = 8) -> list[dict]:
    """LayerNorm (weight and bias) and RMSNorm (llama) fwd+bwd at 16384 x 4096 bf16 for each
    backward variant in LN_BWD_VARIANTS / RMS_BWD_VARIANTS (kernels/layer_norm.py, rms_norm.py
    knobs). Per variant, first the check: max |err| / max |ref| of y, dx, dweight[, dbias] vs the
    fp32 reference (autograd on the upcast inputs) and vs the default variant; a variant past 2e-2
    of the reference or 1e-2 of the default (one bf16 rounding is <= 4e-3) is reported WRONG and
    not timed. Then the GPU kernel
    time summed from torch.profiler (host gaps excluded) with its per-kernel split, and the
    CUDA-graph replay time per call (`graph_calls` fwd+bwd calls back to back in one graph,
    alternating two input sets, as bench_kernels' graphn_us). ~60-90 s on an H200, mostly compiles."""
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.cases.norms ln_bwd: needs a CUDA GPU (torch.cuda.is_available() is False); "
                         "nothing was timed. Run it on the H200.")
    import time

    import triton

    from benchmarks.bench_kernels import graph_time_us

    t0 = time.perf_counter()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"{_M}x{_N} bf16 fwd+bwd; errors: max|err|/max|ref| of y, dx, dweight[, dbias]", flush=True)
    torch.manual_seed(0)
    rows = []
    for norm, fn, make, variants in (("layer_norm", _ln.layer_norm, _ln_inputs, LN_BWD_VARIANTS),
                                     ("rms_norm", _rms.rms_norm, _llama_inputs, RMS_BWD_VARIANTS)):
        inputs, inputs2 = make("cuda", torch.bfloat16), make("cuda", torch.bfloat16)
        leaves = [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.requires_grad]
        leaves2 = [v for v in inputs2.values() if isinstance(v, torch.Tensor) and v.requires_grad]
        dy, dy2 = torch.randn_like(inputs["x"]), torch.randn_like(inputs2["x"])
        # fp32 reference: the same function's PyTorch reference on upcast leaves
        ref_fn = _ln.layer_norm_reference if norm == "layer_norm" else _rms.rms_norm_reference
        up = {k: (v.detach().float().requires_grad_() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        ref_y = ref_fn(**up)
        ref = [ref_y.detach(), *torch.autograd.grad(ref_y, [v for v in up.values() if isinstance(v, torch.Tensor)], dy.float())]
        del up, ref_y
        default = None
        names = list(variants)
        names.insert(0, names.pop(next(i for i, n in enumerate(names) if n.startswith("default ("))))  # its outputs first
        for name in names:
            old = _set_knobs(variants[name])
            try:
                y = fn(**inputs)
                got = [y.detach(), *torch.autograd.grad(y, leaves, dy)]
                del y
                default = default or got
                err_ref = [_max_rel(a, b) for a, b in zip(got, ref)]
                err_def = [_max_rel(a, b) for a, b in zip(got, default)]
                ok = max(err_ref) <= 2e-2 and max(err_def) <= 1e-2
                us = graph_us = float("nan")
                split = {}
                if ok:
                    us, split = kernel_times_us(lambda: torch.autograd.backward(fn(**inputs), dy), leaves, iters)
                    try:
                        graph_us = graph_time_us([lambda: torch.autograd.backward(fn(**inputs), dy),
                                                  lambda: torch.autograd.backward(fn(**inputs2), dy2)],
                                                 leaves + leaves2, graph_calls)[0]  # (median, spread)
                    except Exception as e:  # noqa: BLE001 - a failed capture is a result
                        print(f"  {norm} {name}: graph capture failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
                        torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a variant that fails to compile or run is a result
                print(f"  {norm} {name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                ok, err_ref, err_def, us, graph_us, split = False, [], [], float("nan"), float("nan"), {}
            finally:
                _set_knobs(old)
                for t in leaves + leaves2:
                    t.grad = None
            r = {"norm": norm, "variant": name, "ok": ok, "kernel_us": us, "graph_us": graph_us,
                 "err_vs_ref": err_ref, "err_vs_default": err_def, "kernels": split}
            rows.append(r)
            errs = " ".join(f"{e:.1e}" for e in err_ref)
            errd = " ".join(f"{e:.1e}" for e in err_def)
            print(f"{norm:10s} {name:50s} kernels {us:7.1f} us  graph {graph_us:7.1f} us  "
                  f"err vs fp32 ref [{errs}] vs default [{errd}]{'' if ok else '  WRONG: not timed'}", flush=True)
            if split:
                print("    " + "; ".join(f"{k[:40]} {v:.1f}" for k, v in sorted(split.items(), key=lambda kv: -kv[1])),
                      flush=True)
        del inputs, inputs2, leaves, leaves2, dy, dy2, ref, default
        torch.cuda.empty_cache()
    for norm in ("layer_norm", "rms_norm"):
        done = sorted((r for r in rows if r["norm"] == norm and r["ok"] and r["graph_us"] == r["graph_us"]),
                      key=lambda r: r["graph_us"])
        print(f"best {norm} by graph replay: " + "; ".join(f"{r['variant']} {r['graph_us']:.1f} us" for r in done[:3]))
    print(f"# sweep took {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["ln_bwd"]:
        sweep_ln_bwd()
    elif sys.argv[1:]:
        raise SystemExit("usage: python -m benchmarks.cases.norms [ln_bwd]")
    else:
        sweep_norm_configs()
