"""Benchmark cases: cross-entropy over logits, and fused linear (LM head) + cross-entropy.

Shapes and targets from the issue (H200, bf16):
- CE, logits 8192 x 128256 (Llama-3 vocabulary, 8K tokens; 2.1 GB): fwd+bwd <= 1.15 ms with no
  extra memory beyond the gradient. Floor: read logits + write grad = 4.2 GB at 4.27 TB/s =
  0.98 ms. Issue's peers: torch.compile 2.59 ms, Liger 2.14 ms, eager fp32 13.5 ms / 10 GB extra.
- Linear + CE, hidden 8192 x 4096, weight 128256 x 4096: <= torch.compile's 36.1 ms with <= Liger's
  1.06 GB extra memory. Floor: 3 GEMMs x 2 N H V = 25.8 TFLOP at the run's measured bf16 matmul rate.
- CE with Gemma 2's final-logit softcap (30.0) over its 256000 vocabulary, 4096 tokens: no target
  in the issue.

The eager peers are what HF models run today: `ForCausalLMLoss` upcasts the logits
(`logits.float()`) and calls `F.cross_entropy(..., ignore_index=-100)`; Gemma 2 softcaps the bf16
logits in the model (`logits / cap; tanh; * cap`) before that.

kprof computes the gradient in the forward, so its "fwd" timing (inputs require grad) already
includes the backward's work, and its backward is free when grad_output == 1, which is what
`loss.backward()` passes. With any other grad_output the backward scales the stored gradient
(one more read + write of it: ~1 ms for the CE case). For loss cases the meaningful fwd+bwd
number is with grad_output = 1.

Liger notes (0.6.x): LigerCrossEntropyLoss writes the gradient into the logits' buffer (in place,
no opt-out), so after Liger runs the case's `logits` hold gradients; the harness checks and times
Liger last. LigerFusedLinearCrossEntropyLoss takes (weight, hidden, target).

Reproduces (H200): the cases, the cross-entropy and linear + CE rows of the top README's tables
(bench_kernels.py). The sweeps, each the latest file of its kind in benchmarks/results/:
    python -m benchmarks.cases.loss ce                 sweep-ce-h200-20261130T0103.txt (CEConfig.for_problem's pick)
    python -m benchmarks.cases.loss ce_cluster         sweep-ce-cluster-h200-20261130T0611.txt (sm_90 kernel shapes)
    python -m benchmarks.cases.loss ce_cluster_vocabs  sweep-ce-cluster-vocabs-h200-20261130T0722.txt (32000: 0.361 ms,
                                                       50304: 0.500, 256000: 1.096; 151936 declined)
    python -m benchmarks.cases.loss lce_parts lce_profile   sweep-ce-lce-h200-20261130T0733.txt (linear + CE's
                                                       parts per chunk size: grad_W addmm 14.71 ms at 512 rows)
    python -m benchmarks.cases.loss lce                the chunk-size table in kernels/fused_linear_cross_entropy.py
"""

from __future__ import annotations

import dataclasses
import functools

import importlib

import torch
import torch.nn.functional as F

from benchmarks.cases import Case

# The modules (a package-level export named cross_entropy would shadow the submodule attribute).
_ce = importlib.import_module("kprof.kernels.cross_entropy")
_lce = importlib.import_module("kprof.kernels.fused_linear_cross_entropy")

_N, _V = 8192, 128256  # tokens x Llama-3 vocabulary
_H = 4096  # Llama-3-8B hidden size
_GN, _GV, _CAP = 4096, 256000, 30.0  # Gemma 2: vocabulary 256000, final_logit_softcapping 30.0
_IGNORED_EVERY = 32  # ~3% of targets are -100 (padding / prompt tokens), so ignore_index is exercised


def _targets(n: int, v: int, device: str) -> torch.Tensor:
    t = torch.randint(0, v, (n,), device=device)
    t[::_IGNORED_EVERY] = -100
    return t


def _ce_inputs(n: int, v: int):
    def make(device, dtype):
        # logits of a trained LM head are O(1-10); x2 randn keeps the softmax away from uniform
        logits = (torch.randn(n, v, device=device) * 2).to(dtype).requires_grad_()
        return {"logits": logits, "target": _targets(n, v, device)}

    return make


def _softcap_inputs(device, dtype):
    return {**_ce_inputs(_GN, _GV)(device, dtype), "softcap": _CAP}


def _lce_inputs(device, dtype):
    hidden = torch.randn(_N, _H, device=device).to(dtype).requires_grad_()
    # ~unit-variance logits: weight std 1/sqrt(H) (a trained head's logits are O(1-10))
    weight = (torch.randn(_V, _H, device=device) / _H**0.5).to(dtype).requires_grad_()
    return {"hidden": hidden, "weight": weight, "target": _targets(_N, _V, device)}


# --- eager formulations -------------------------------------------------------------------


def _eager_ce(logits, target, softcap=None):
    # transformers' ForCausalLMLoss (after the shift): upcast, then cross-entropy, mean over
    # non-ignored tokens. Gemma 2 softcaps the bf16 logits in the model first.
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), target, ignore_index=-100)


def _eager_lce(hidden, weight, target):
    # LlamaForCausalLM: logits = self.lm_head(hidden_states), then ForCausalLMLoss
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.float(), target, ignore_index=-100)


def _kprof_ce(logits, target, softcap=None):
    return _ce.cross_entropy(logits, target, softcap=softcap)


# --- Liger ----------------------------------------------------------------------------------


def _liger_ce():
    from liger_kernel.transformers import LigerCrossEntropyLoss

    loss = LigerCrossEntropyLoss(ignore_index=-100)
    return lambda logits, target: loss(logits, target)


def _liger_ce_softcap():
    from liger_kernel.transformers import LigerCrossEntropyLoss

    loss = LigerCrossEntropyLoss(ignore_index=-100, softcap=_CAP)
    return lambda logits, target, softcap: loss(logits, target)


def _liger_lce():
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
    return lambda hidden, weight, target: loss(weight, hidden, target)


CASES: list[Case] = [
    Case(
        kernel="cross_entropy",
        label=f"cross-entropy {_N}x{_V}",
        make_inputs=_ce_inputs(_N, _V),
        kprof=_kprof_ce,
        eager=_eager_ce,
        liger=_liger_ce,
        problem={"n_rows": _N, "n_cols": _V, "dtype": torch.bfloat16},
        targets_us={"fwdbwd": 1150},  # issue; floor 0.98 ms (read logits + write grad)
    ),
    Case(
        kernel="cross_entropy",
        label=f"cross-entropy + softcap {_CAP:g} (Gemma 2) {_GN}x{_GV}",
        make_inputs=_softcap_inputs,
        kprof=_kprof_ce,
        eager=_eager_ce,
        liger=_liger_ce_softcap,
        problem={"n_rows": _GN, "n_cols": _GV, "dtype": torch.bfloat16},
        targets_us={},  # no target in the issue; floor 4.2 GB -> 0.98 ms, like the Llama case
    ),
    Case(
        kernel="fused_linear_cross_entropy",
        label=f"linear + cross-entropy {_N}x{_H} @ {_V}x{_H}",
        make_inputs=_lce_inputs,
        kprof=_lce.linear_cross_entropy,
        eager=_eager_lce,
        liger=_liger_lce,
        problem={"n_rows": _N, "hidden": _H, "vocab": _V, "dtype": torch.bfloat16},
        targets_us={"fwdbwd": 36100},  # issue: torch.compile's time; memory target: Liger's 1.06 GB extra
        # The chunk trades memory for speed (kernels/fused_linear_cross_entropy.py, chunk_rows):
        # 256 rows is Liger's memory, 2048 torch.compile's speed; the default is 512.
        kprof_variants={"chunk=256": functools.partial(_lce.linear_cross_entropy, chunk_size=256),
                        "chunk=2048": functools.partial(_lce.linear_cross_entropy, chunk_size=2048)},
        # What the LM-head patch runs in a training step: grad_hidden written over hidden (the
        # final norm's output, which nothing reads after the loss), so the 512-row chunk fits in
        # the memory Liger's separate grad_hidden takes.
        kprof_inplace_variants={"grad_into_hidden": functools.partial(_lce.linear_cross_entropy, grad_into_hidden=True)},
    ),
]


# --- launch-config sweep for the CE kernel (run on the GPU; not part of CASES) ---------------


def _ce_sweep_inputs(n: int, v: int, dtype: torch.dtype, softcap: float):
    """Two input sets (logits, target, grad scale, loss rows, grad) for graph timing, the Triton
    kernel's default config, and its loss and gradient on the first set (the reference each
    swept config is checked against)."""
    dev = torch.device("cuda")
    sets = []
    for _ in range(2):
        logits = (torch.randn(n, v, device=dev) * 2).to(dtype)
        target = _targets(n, v, "cuda")
        sets.append((logits, target, 1.0 / (target != -100).sum().float(), torch.empty(n, device=dev), torch.empty_like(logits)))
    logits, target, scale, _, _ = sets[0]
    loss_ref, grad_ref = torch.empty(n, device=dev), torch.empty_like(logits)
    default = _ce.CEConfig.for_problem(n, v, dtype, dev)
    _ce._ce_fwd_launch(logits, target, grad_ref, loss_ref, scale, -100, 0.0, 0.0, softcap, config=default)
    return sets, default, loss_ref, grad_ref


def sweep_ce_configs(n: int = _N, v: int = _V, dtype: torch.dtype = torch.bfloat16, softcap: float = 0.0,
                     block_bytes=(16384, 32768, 65536), warps=(8, 16, 32), per_sms=(1, 2)) -> list[dict]:
    """Time kprof's fused CE forward (which writes the gradient) over launch configs at one shape,
    after checking each config against the default one. `python -m benchmarks.cases.loss ce [ce_gemma]`.

    The forward alone is the CE case's fwd+bwd with grad_output == 1 (the backward is skipped).
    Timing: two launches back to back in a CUDA graph on two input sets, replay time / 2, median
    of three do_bench medians (bench_kernels.graph_time_us, the kernels table's basis).
    Returns rows sorted by time; the first is what `CEConfig.for_problem` should pick.
    2026-11-29, the first kernel: 64 configs (8-64 KB blocks, 4-32 warps, 1-4 programs per SM);
    4-warp and 8 KB configs were never within 15% of the best, so the grid is the middle.
    """
    from benchmarks.bench_kernels import graph_time_us
    from kprof.kernels.common import assert_close

    dev = torch.device("cuda")
    n_sm = torch.cuda.get_device_properties(dev).multi_processor_count
    sets, default, loss_ref, grad_ref = _ce_sweep_inputs(n, v, dtype, softcap)
    logits = sets[0][0]
    configs = {default}
    for nbytes_block in block_bytes:
        for w in warps:
            for per_sm in per_sms:
                configs.add(_ce.CEConfig(nbytes_block // logits.element_size(), w, per_sm * n_sm, False))
    nbytes = _ce._ce_cost(n, v, dtype)["fwd"].bytes
    rows = []
    for cfg in sorted(configs, key=lambda c: (c.block, c.num_warps, c.n_programs)):
        def step(i, cfg=cfg):
            lg, tg, sc, ls, gr = sets[i]
            _ce._ce_fwd_launch(lg, tg, gr, ls, sc, -100, 0.0, 0.0, softcap, config=cfg)

        try:
            step(0)
            assert_close(sets[0][3], loss_ref, msg="loss")
            assert_close(sets[0][4], grad_ref, msg="grad")
            us, spread = graph_time_us([functools.partial(step, 0), functools.partial(step, 1)], [], calls=2)
        except Exception as e:  # noqa: BLE001 - a config that fails to compile or is wrong is a result
            rows.append({"config": cfg, "us": float("nan"), "note": f"{type(e).__name__}: {e}"[:160]})
            continue
        rows.append({"config": cfg, "us": us, "spread": spread, "tbps": nbytes / (us * 1e-6) / 1e12,
                     "default": cfg == default})
        print(f"  measured block={cfg.block} warps={cfg.num_warps} programs={cfg.n_programs}: {us:.1f} us",
              flush=True)  # as it lands: a run cut by its time limit keeps what it measured
    rows.sort(key=lambda r: (r["us"] != r["us"], r["us"]))
    print(f"CE {n} x {v} {dtype} softcap={softcap}: graph time per call (2 back to back), median of 3 (spread)")
    for r in rows:
        c = r["config"]
        print(f"block={c.block:5d} warps={c.num_warps:2d} programs={c.n_programs:5d} {r['us']:8.1f} us "
              f"({r.get('spread', float('nan')):.1f}) {r.get('tbps', float('nan')):.2f} TB/s "
              f"{'(default)' if r.get('default') else ''}{r.get('note', '')}", flush=True)
    return rows


def sweep_ce_cluster(n: int = _N, v: int = _V, dtype: torch.dtype = torch.bfloat16, softcap: float = 0.0,
                     quick: bool = False) -> list[dict]:
    """Time the sm_90 cluster CE kernel (kprof.kernels.cross_entropy_sm90) over launch shapes at
    one shape, beside the Triton kernel's default config in the same run, after checking each
    against the Triton kernel's output. `python -m benchmarks.cases.loss ce_cluster [ce_cluster_gemma]`.
    Timing as `sweep_ce_configs` (graph time, two launches back to back on two input sets)."""
    from benchmarks.bench_kernels import graph_time_us
    from kprof.kernels import cross_entropy_sm90 as sm90
    from kprof.kernels.common import assert_close

    dev = torch.device("cuda")
    sets, triton_cfg, loss_ref, grad_ref = _ce_sweep_inputs(n, v, dtype, softcap)
    logits = sets[0][0]
    base = sm90.plan(n, v, logits.element_size(), (v, v), (logits.data_ptr(), 0), torch.cuda.get_device_capability(dev))
    if isinstance(base, str):
        print(f"CE cluster sweep {n} x {v} {dtype}: plan declines: {base}", flush=True)
        return []
    vec = 16 // logits.element_size()
    configs = [base]
    shapes = ((4, 512, 1), (8, 512, 1), (8, 256, 2)) if quick else ((4, 512, 1), (8, 512, 1), (8, 256, 2), (8, 256, 1), (4, 1024, 1), (8, 1024, 1))
    for cl, th, mb in shapes:
        per_cta = -(-(v // vec) // cl)
        nv = -(-per_cta // th)
        cfg = sm90.ClusterConfig(cl, th, nv, mb)
        if nv * vec <= 64 and 2 * per_cta * 16 * mb <= 220 * 1024 and cfg not in configs:
            configs.append(cfg)
    if not quick:  # three row buffers (measured slower at 06:12), and fewer clusters than fit
        configs += [dataclasses.replace(base, nbuf=3)] + [dataclasses.replace(base, n_clusters=k) for k in (24, 28)]
    nbytes = _ce._ce_cost(n, v, dtype)["fwd"].bytes
    rows = []

    def triton_step(i):
        lg, tg, sc, ls, gr = sets[i]
        _ce._ce_fwd_launch(lg, tg, gr, ls, sc, -100, 0.0, 0.0, softcap, config=triton_cfg)

    us, spread = graph_time_us([functools.partial(triton_step, 0), functools.partial(triton_step, 1)], [], calls=2)
    rows.append({"name": f"triton {triton_cfg}", "us": us, "spread": spread, "tbps": nbytes / (us * 1e-6) / 1e12})
    print(f"  measured triton default: {us:.1f} us", flush=True)
    for cfg in configs:
        def step(i, cfg=cfg):
            lg, tg, sc, ls, gr = sets[i]
            assert sm90.try_launch(lg, tg, gr, ls, sc, -100, 0.0, 0.0, softcap, config=cfg)

        name = (f"cluster={cfg.cluster} threads={cfg.threads} nv={cfg.nv} min_blocks={cfg.min_blocks} nbuf={cfg.nbuf} "
                f"n_clusters={cfg.n_clusters or 'max'}")
        try:
            sets[0][3].zero_()
            sets[0][4].zero_()
            step(0)
            assert_close(sets[0][3], loss_ref, msg="loss")
            assert_close(sets[0][4], grad_ref, msg="grad")
            us, spread = graph_time_us([functools.partial(step, 0), functools.partial(step, 1)], [], calls=2)
        except Exception as e:  # noqa: BLE001 - a config that fails to build, or is wrong, is a result
            rows.append({"name": name, "us": float("nan"), "note": f"{type(e).__name__}: {e}"[:200]})
            print(f"  {name}: {rows[-1]['note']}", flush=True)
            continue
        key = [k for k in sm90._loaded if k[1] == sm90._defines(cfg, dtype, False, False, softcap > 0, True)]
        maxc = sm90._loaded[key[0]].max_clusters.get(sm90.smem_bytes(cfg, v, logits.element_size()), "?") if key else "?"
        rows.append({"name": name + f" (max resident clusters {maxc})", "us": us, "spread": spread,
                     "tbps": nbytes / (us * 1e-6) / 1e12, "default": cfg == base})
        print(f"  measured {rows[-1]['name']}: {us:.1f} us", flush=True)
    rows.sort(key=lambda r: (r["us"] != r["us"], r["us"]))
    print(f"CE cluster kernel {n} x {v} {dtype} softcap={softcap}: graph time per call (2 back to back), median of 3 (spread)")
    for r in rows:
        print(f"{r['us']:8.1f} us ({r.get('spread', float('nan')):.1f}) {r.get('tbps', float('nan')):.2f} TB/s  {r['name']}"
              f"{' (default)' if r.get('default') else ''}{r.get('note', '')}", flush=True)
    return rows


def sweep_lce_chunks(chunks=(256, 384, 512, 768, 1024, 2048), accum_dtypes=(None, torch.float32)) -> list[dict]:
    """Time kprof's linear + CE forward+backward (grad_output = 1) and its peak extra memory over
    chunk sizes and grad_W accumulation dtypes at the issue's shape. `python -m benchmarks.cases.loss`.

    `chunk_rows` defaults to 512 (1024 with fp32 accumulation) from napkin math; this measures it.
    """
    import triton.testing

    inputs = _lce_inputs("cuda", torch.bfloat16)
    leaves = [inputs["hidden"], inputs["weight"]]
    rows = []
    for acc in accum_dtypes:
        for c in chunks:
            def step():
                _lce.linear_cross_entropy(**inputs, chunk_size=c, accum_dtype=acc).backward()

            for t in leaves:
                t.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - base
            ms = triton.testing.do_bench(step, warmup=3, rep=30, grad_to_none=leaves, return_mode="median")
            rows.append({"chunk": c, "accum": str(acc), "ms": ms, "extra_gb": extra / 1e9})
            print(f"chunk={c:5d} accum={str(acc):14s} {ms:7.2f} ms  extra {extra / 1e9:.2f} GB", flush=True)
    return rows


def sweep_lce_parts(chunks=(256, 512, 1024, 2048), n: int = _N, h: int = _H, v: int = _V) -> list[dict]:
    """Where linear + CE's time goes per chunk size: each of the chunk loop's four steps timed on
    its own (median of do_bench) and multiplied by the number of chunks, bf16, the issue's shape.
    Also grad_h's GEMM ([C, V] @ [V, H]: C x H outputs, only 64 128x256 tiles at C = 512 on 132
    SMs) split over K through a batched GEMM into fp32 partials and summed, the usual fix for a
    GEMM with few output tiles and a long K."""
    import triton.testing

    dev = torch.device("cuda")
    hidden = torch.randn(n, h, device=dev, dtype=torch.bfloat16)
    weight = torch.randn(v, h, device=dev, dtype=torch.bfloat16) * h**-0.5
    target = _targets(n, v, "cuda")
    gw = torch.empty_like(weight)
    scale = 1.0 / (target != -100).sum().float()
    loss = torch.empty(n, device=dev)
    rows = []

    def t(fn):
        return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")

    full = t(lambda: torch.mm(hidden, weight.t()))  # one [N, V] GEMM, the rate the floor uses
    print(f"full-size logits GEMM {full:.3f} ms ({2 * n * h * v / full / 1e9:.0f} TFLOP/s)", flush=True)
    for c in chunks:
        k = n // c
        buf = torch.empty(c, v, device=dev, dtype=torch.bfloat16)
        h_c = hidden[:c]
        torch.mm(h_c, weight.t(), out=buf)
        gh = torch.empty(c, h, device=dev, dtype=torch.bfloat16)
        parts = {
            "logits mm": t(lambda: torch.mm(h_c, weight.t(), out=buf)),
            "CE kernel": t(lambda: _ce._ce_fwd_launch(buf, target[:c], buf, loss[:c], scale, -100, 0.0, 0.0, 0.0,
                                                      check_targets=False)),
            "grad_W addmm": t(lambda: gw.addmm_(buf.t(), h_c)),
            "grad_h mm": t(lambda: torch.mm(buf, weight, out=gh)),
        }
        for s_k in (2, 4, 8):
            if v % s_k == 0:
                part = torch.empty(s_k, c, h, device=dev, dtype=torch.float32)
                b3 = buf.view(c, s_k, v // s_k).transpose(0, 1)
                w3 = weight.view(s_k, v // s_k, h)

                def split_k(b3=b3, w3=w3, part=part):
                    try:  # fp32 partials straight from cuBLAS (aten's out_dtype overload)
                        torch.ops.aten.bmm.dtype_out(b3, w3, torch.float32, out=part)
                        gh.copy_(part.sum(0))
                    except (RuntimeError, AttributeError):
                        gh.copy_(torch.bmm(b3, w3).sum(0, dtype=torch.float32))

                parts[f"grad_h split-K {s_k}"] = t(split_k)
        total = sum(parts[p] for p in ("logits mm", "CE kernel", "grad_W addmm", "grad_h mm")) * k
        line = "  ".join(f"{p} {ms * k:6.2f}" for p, ms in parts.items())
        print(f"chunk={c:5d} x{k:3d}: {line}  | sum {total:.2f} ms", flush=True)
        rows.append({"chunk": c, "n_chunks": k, **{p: ms * k for p, ms in parts.items()}, "sum": total})
    return rows


def profile_lce(chunks=(512, 2048), n: int = _N, h: int = _H, v: int = _V) -> None:
    """Kernel time by kernel name and GPU idle time inside one linear + CE fwd+bwd per chunk size
    (torch.profiler, after warm-up), against its wall time: what the per-part sweep misses."""
    from torch.profiler import ProfilerActivity, profile

    inputs = _lce_inputs("cuda", torch.bfloat16)
    leaves = [inputs["hidden"], inputs["weight"]]
    for c in chunks:
        for into_hidden in (False, True):
            def step():
                for t in leaves:
                    t.grad = None
                _lce.linear_cross_entropy(**inputs, chunk_size=c, grad_into_hidden=into_hidden).backward()

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                step()
            end.record()
            torch.cuda.synchronize()
            wall = start.elapsed_time(end) / 5
            extra = (torch.cuda.max_memory_allocated() - base) / 2**20
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            kern = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                          key=lambda e: e.time_range.start)
            by_name: dict[str, float] = {}
            for e in kern:
                by_name[e.name[:60]] = by_name.get(e.name[:60], 0.0) + e.device_time / 1e3
            busy = sum(by_name.values())
            print(f"chunk={c} grad_into_hidden={into_hidden}: {wall:.2f} ms/step (events, 5 steps), "
                  f"kernels {busy:.2f} ms, peak extra {extra:.1f} MiB (grads kept alive between steps count)", flush=True)
            for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:8]:
                print(f"    {ms:7.2f} ms  {name}", flush=True)
            # Where the GPU sits idle inside the profiled step: the largest gaps between kernels.
            if kern:
                span = (kern[-1].time_range.end - kern[0].time_range.start) / 1e3
                gaps = sorted(((b.time_range.start - a.time_range.end) / 1e3, a.name[:40], b.name[:40])
                              for a, b in zip(kern, kern[1:]))[::-1]
                print(f"    profiled span {span:.2f} ms, idle {sum(g for g, _, _ in gaps):.2f} ms in {len(gaps)} gaps; largest:",
                      flush=True)
                for g, a, b in gaps[:6]:
                    print(f"      {g:6.3f} ms after {a} before {b}", flush=True)


if __name__ == "__main__":
    import sys

    what = sys.argv[1:] or ["ce", "lce_parts", "lce", "lce_profile"]
    if "ce" in what:
        sweep_ce_configs()
    if "ce_gemma" in what:
        sweep_ce_configs(_GN, _GV, softcap=_CAP)
    if "ce_cluster" in what:
        sweep_ce_cluster()
    if "ce_cluster_gemma" in what:
        sweep_ce_cluster(_GN, _GV, softcap=_CAP)
    if "ce_cluster_vocabs" in what:  # does auto's choice (the cluster kernel) pay at other vocabularies?
        for n, v in ((8192, 32000), (8192, 151936), (4096, 256000), (8192, 50304)):
            sweep_ce_cluster(n, v, quick=True)
    if "lce_parts" in what:
        sweep_lce_parts()
    if "lce" in what:
        sweep_lce_chunks()
    if "lce_profile" in what:
        profile_lce()
