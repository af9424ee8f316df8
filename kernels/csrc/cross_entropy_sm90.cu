// Fused cross-entropy (loss + gradient in one pass) for sm_90: one row per thread-block cluster,
// every logit read from DRAM once.
//
// Why CUDA C++ and not Triton: a row of 128256 bf16 logits is 256 KB, more than one SM's
// registers, so kprof's Triton kernel reads each row twice (pass 1 logsumexp, pass 2 gradient)
// and counts on the second read hitting L2; on the H200 that kernel measures 1.26-1.29 ms against
// a 0.98 ms floor (read 2.1 GB + write 2.1 GB at 4.27 TB/s). Splitting a row across Triton
// programs that meet through global memory was measured slower (1.56 ms: a chain of dependent
// round trips per segment, see CEConfig). Hopper's clusters give a cheaper meeting point: the
// CTAs of a cluster hold one row between them (CTA r its r-th contiguous slice) and swap their
// partial (max, sum exp, sum, target logit) through distributed shared memory: st.async into
// every CTA's slot, counted on the receiver's mbarrier, one exchange per row, no fence.
//
// Per row, per CTA: wait for the slice's bulk copy (cp.async.bulk, issued a row ahead into the
// other of two shared-memory buffers, so the DRAM reads of the next row overlap this one), thread
// max -> CTA max (__syncthreads), exp(z - max) into registers and thread sums -> CTA partial
// (__syncthreads), exchange, combine, gradient from the registers, streaming stores.
//
// Measured on the H200 (2026-11-30 05:59, bf16 8192 x 128256, graph time): a first form kept both
// row slices in registers (ld.global a row ahead) and took two exps per logit: 1.14 ms at best
// (cluster 4 x 512 threads) against the Triton kernel's 1.26 ms in the same run; counted from
// MUFU.EX2's 16 per clock per SM (not measured), the exps were ~2 us of its ~4.2 us per row.
// Holding exp(z - max) for the gradient needs the registers the prefetched row took, hence the
// row in shared memory: 1.107-1.115 ms (06:05, 06:11), plus the shapes `plan` picks by V.
//
// Math and semantics follow kprof.kernels.cross_entropy's Triton kernel line by line (softcap,
// label smoothing relative to the max, z-loss, grad scale, ignore_index rows -> zero gradient).
//
// Compile-time parameters, prepended as #defines by cross_entropy_sm90.py:
//   DT           0 fp32, 1 fp16, 2 bf16 (logits and gradient)
//   CLUSTER      CTAs per cluster (a row is split CLUSTER ways)
//   THREADS      threads per CTA
//   NV           16-byte vectors per thread per row (exp values held: NV * VEC fp32 registers)
//   NBUF         row slices in shared memory (the current row + NBUF - 1 in flight)
//   MIN_BLOCKS   __launch_bounds__ minimum CTAs per SM
//   HAS_SMOOTHING, HAS_Z_LOSS, HAS_SOFTCAP, COMPUTE_GRAD   0 or 1
// Dynamic shared memory: NBUF x ceil(V / VEC / CLUSTER) x 16 bytes (the launcher sets it).
// No headers: NVRTC compiles it as is (conversions and memory ops are inline PTX).

#if DT == 0
#define VEC 4
#define ES 4
#else
#define VEC 8
#define ES 2
#endif
#define NWARPS (THREADS / 32)
#define LOG2E 1.4426950408889634f
#define NEG_INF (-__int_as_float(0x7f800000))

typedef unsigned int u32;
typedef unsigned long long u64;

struct alignas(16) V4 {  // 16-byte aligned: the bulk copy's dynamic shared memory target
  u32 x, y, z, w;
};

__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Streaming (evict-first) 16-byte store: the gradient is not read again by this kernel.
__device__ __forceinline__ void st_cs(char* p, V4 v) {
  asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// 16 bytes of the input dtype -> VEC fp32 values. bf16 -> fp32 is the bits moved to the top half.
__device__ __forceinline__ void unpack(const V4& w, float* f) {
#if DT == 0
  f[0] = __uint_as_float(w.x);
  f[1] = __uint_as_float(w.y);
  f[2] = __uint_as_float(w.z);
  f[3] = __uint_as_float(w.w);
#else
  const u32 a[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#if DT == 2
    f[2 * k] = __uint_as_float(a[k] << 16);  // the lower address holds the low half
    f[2 * k + 1] = __uint_as_float(a[k] & 0xffff0000u);
#else
    float lo, hi;
    asm("{ .reg .f16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }" : "=f"(lo), "=f"(hi) : "r"(a[k]));
    f[2 * k] = lo;
    f[2 * k + 1] = hi;
#endif
  }
#endif
}

// VEC fp32 values -> 16 bytes of the input dtype, rounded to nearest even.
__device__ __forceinline__ V4 pack(const float* g) {
  V4 v;
#if DT == 0
  v.x = __float_as_uint(g[0]);
  v.y = __float_as_uint(g[1]);
  v.z = __float_as_uint(g[2]);
  v.w = __float_as_uint(g[3]);
#else
  u32 a[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    // cvt.rn.{bf16x2,f16x2}.f32 d, hi, lo: the first source goes to the upper half.
#if DT == 2
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(a[k]) : "f"(g[2 * k + 1]), "f"(g[2 * k]));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(a[k]) : "f"(g[2 * k + 1]), "f"(g[2 * k]));
#endif
  }
  v.x = a[0];
  v.y = a[1];
  v.z = a[2];
  v.w = a[3];
#endif
  return v;
}

// tanh as the Triton kernel builds it: (1 - e) / (1 + e), e = exp(-2|u|), and the odd Taylor
// series to u^5 below |u| = 1/16 where 1 - e cancels.
__device__ __forceinline__ float tanh_k(float u) {
  const float au = fabsf(u);
  const float e = ex2_ftz(-2.0f * LOG2E * au);
  const float big = __fdividef(1.0f - e, 1.0f + e);
  const float u2 = au * au;
  const float small = au * (1.0f - u2 * (0.3333333333333333f - u2 * 0.13333333333333333f));
  const float t = au < 0.0625f ? small : big;
  return u < 0.0f ? -t : t;
}

// Logit after the softcap (z), and t = tanh(x / cap) for the softcap's gradient.
__device__ __forceinline__ float prep(float x, float cap, float inv_cap, float& t) {
#if HAS_SOFTCAP
  t = tanh_k(x * inv_cap);
  return cap * t;
#else
  t = 0.0f;
  return x;
#endif
}

__device__ __forceinline__ u32 cluster_ctarank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ u32 cluster_id_x() {
  u32 r;
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
  return r;
}

__device__ __forceinline__ u32 n_clusters_x() {
  u32 r;
  asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
  return r;
}

// All threads of all CTAs of the cluster. Only at the start and the end: its release half
// compiles to MEMBAR.ALL.GPU (cuobjdump, sm_90, CUDA 13.0), which would wait for every load and
// store in flight, the next row's prefetch included, once per row.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u64 s;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(s) : "l"((u64)p));
  return (u32)s;
}

__device__ __forceinline__ u32 map_to_rank(u32 addr, u32 rank) {
  u32 r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}

// The per-row exchange: st.async stores 16 bytes into CTA `rank`'s copy of `slot` and counts
// them on that CTA's mbarrier (complete_tx); the receiver waits on its own mbarrier until all
// CLUSTER partials have landed. No fence and no cluster barrier per row.
__device__ __forceinline__ void send_f4(const float* slot, const u64* bar, u32 rank, float a, float b, float c, float d) {
  const u32 rs = map_to_rank(smem_addr(slot), rank);
  const u32 rb = map_to_rank(smem_addr(bar), rank);
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
               ::"r"(rs), "f"(a), "f"(b), "f"(c), "f"(d), "r"(rb) : "memory");
}

__device__ __forceinline__ void mbar_init(const u64* bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// This CTA's one arrival on `bar` for the phase, announcing `bytes` of st.async to come. The
// remote stores may land before it: the tx-count goes negative meanwhile, and the phase cannot
// complete without this arrival.
__device__ __forceinline__ void mbar_arrive_expect(const u64* bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(const u64* bar, u32 parity) {
  const u32 a = smem_addr(bar);
  u32 done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done) : "r"(a), "r"(parity) : "memory");
  }
}

// One bulk copy (the TMA engine, no registers, one instruction) of `bytes` from global memory
// into this CTA's shared memory, counted on `bar` (which this thread arms with the byte count).
__device__ __forceinline__ void bulk_load(void* dst, const char* src, u32 bytes, const u64* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS, MIN_BLOCKS)
kprof_ce_sm90(const char* logits,      // [n_rows, n_cols], row stride stride_l elements, 16-byte aligned rows
              int stride_l,
              const long long* __restrict__ target,  // [n_rows] int64
              char* grad,              // [n_rows, n_cols], row stride stride_g; may be logits (in place)
              int stride_g,
              float* __restrict__ loss,             // [n_rows] fp32 per-row loss (0 for ignored rows)
              const float* __restrict__ scale,      // fp32 gradient scale: one value (scale_stride 0) or one per row
              int scale_stride,
              int n_rows,
              int n_cols,              // a multiple of VEC
              long long ignore_index,
              float label_smoothing,
              float z_loss,
              float softcap) {
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int rank = (int)cluster_ctarank();
  const int nvec = n_cols / VEC;
  const int per_cta = (nvec + CLUSTER - 1) / CLUSTER;  // host: per_cta <= NV * THREADS
  const int vbeg = rank * per_cta;
  const int vend = min(vbeg + per_cta, nvec);
  const u32 slice_bytes = (u32)max(0, vend - vbeg) * 16u;
  const float inv_cap = HAS_SOFTCAP ? 1.0f / softcap : 0.0f;
  (void)inv_cap;
  (void)z_loss;
  (void)label_smoothing;
  (void)grad;
  (void)stride_g;

  // NBUF row slices of this CTA (dynamic shared memory, NBUF x per_cta x 16 bytes): the current
  // row, and the cluster's next NBUF - 1 rows arriving by bulk copy meanwhile.
  extern __shared__ V4 rowbuf[];
  __shared__ float red_m[NWARPS];
  __shared__ float red_s[3][NWARPS];
  // part[b][r] = CTA r's (max, sum exp, sum (z - max), target logit) for an exchange; two
  // buffers so the next exchange's stores cannot land on a slot this CTA still reads.
  __shared__ alignas(16) float part[2][CLUSTER][4];
  __shared__ alignas(8) u64 xbar[2];  // xbar[b] completes when part[b] holds all CLUSTER partials
  __shared__ alignas(8) u64 lbar[NBUF];  // lbar[b] completes when rowbuf slice b has landed

  const int step = (int)n_clusters_x();
  int row = (int)cluster_id_x();
  if (tid == 0) {
    mbar_init(&xbar[0], 1);
    mbar_init(&xbar[1], 1);
#pragma unroll
    for (int b = 0; b < NBUF; ++b) mbar_init(&lbar[b], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_sync();  // every CTA has started and initialized its mbarriers before the first st.async
  if (tid == 0 && slice_bytes > 0) {
#pragma unroll
    for (int b = 0; b < NBUF - 1; ++b) {
      const int r = row + b * step;
      if (r < n_rows) bulk_load(rowbuf + b * per_cta, logits + ((long long)r * stride_l + (long long)vbeg * VEC) * ES, slice_bytes, &lbar[b]);
    }
  }
  long long y = 0;
  float sc = 0.0f;  // the row's gradient scale (loaded a row ahead: a load after the exchange
                    // would put one DRAM round trip per row on the critical path)
  if (row < n_rows) {
    y = target[row];
    sc = scale[(long long)row * scale_stride];
  }
  int xchg = 0;  // exchanges so far: buffer xchg & 1, its use count xchg >> 1 gives the parity
  int lb = 0;         // this row's slice buffer (rows cycle through the NBUF buffers)
  u32 lpar = 0;       // and the parity of that buffer's mbarrier phase for it

  for (; row < n_rows; row += step) {
    // ---- the cluster's row NBUF - 1 ahead: one bulk copy into the buffer the previous row used.
    // All threads finished reading it before that row's second __syncthreads (an ignored row:
    // before its one __syncthreads), which thread 0 has passed.
    const int pb = lb == 0 ? NBUF - 1 : lb - 1;
    const int frow = row + (NBUF - 1) * step;
    if (tid == 0 && slice_bytes > 0 && frow < n_rows) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic reads before async-proxy writes
      bulk_load(rowbuf + pb * per_cta, logits + ((long long)frow * stride_l + (long long)vbeg * VEC) * ES, slice_bytes, &lbar[pb]);
    }
    const int nrow = row + step;  // targets and scales: one row ahead is enough (8 bytes)
    long long y_next = 0;
    float sc_next = 0.0f;
    if (nrow < n_rows) {
      y_next = target[nrow];
      sc_next = scale[(long long)nrow * scale_stride];
    }
    const V4* cur = rowbuf + lb * per_cta;
#if COMPUTE_GRAD
    char* g_row = grad + (long long)row * stride_g * ES;
#endif

    if (y == ignore_index) {  // uniform across the cluster: every CTA skips the exchange
      if (rank == 0 && tid == 0) loss[row] = 0.0f;
#if COMPUTE_GRAD
      const V4 zero = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int v = vbeg + j * THREADS + tid;
        if (v < vend) st_cs(g_row + (long long)v * 16, zero);
      }
#endif
      if (slice_bytes > 0) mbar_wait(&lbar[lb], lpar);  // its buffer is reused NBUF rows on
      __syncthreads();
    } else {
      if (slice_bytes > 0) mbar_wait(&lbar[lb], lpar);
      // ---- CTA max
      float m = NEG_INF;
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int v = vbeg + j * THREADS + tid;
        if (v < vend) {
          float f[VEC];
          unpack(cur[j * THREADS + tid], f);
#pragma unroll
          for (int q = 0; q < VEC; ++q) {
            float t;
            m = fmaxf(m, prep(f[q], softcap, inv_cap, t));
          }
        }
      }
      m = warp_max(m);
      if (lane == 0) red_m[warp] = m;
      __syncthreads();
      float mc = NEG_INF;
#pragma unroll
      for (int w = 0; w < NWARPS; ++w) mc = fmaxf(mc, red_m[w]);
      // d relative to the max (0 when the slice is all -inf, not nan); s relative to the max
      // itself, as the Triton kernel keeps it.
      const float mc_sub = mc == NEG_INF ? 0.0f : mc;

      // ---- CTA sums: d = sum exp(z - max), s = sum (z - max), and the target's logit. Without
      // the softcap, exp(z - max) stays in registers for the gradient: one exp per logit instead
      // of two (counted, not measured: MUFU.EX2 runs at 16 per clock per SM, so two per logit
      // are ~2 us of the first form's 4.2 us per row; one exp took 1.14 -> 1.11 ms).
      const int vy = (int)(y / VEC);
      const int ky = (int)(y % VEC);
      float d = 0.0f, s = 0.0f, zy = 0.0f;
#if !HAS_SOFTCAP
      float e[NV][VEC];
#endif
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int v = vbeg + j * THREADS + tid;
        if (v < vend) {
          float f[VEC];
          unpack(cur[j * THREADS + tid], f);
#pragma unroll
          for (int q = 0; q < VEC; ++q) {
            float t;
            const float z = prep(f[q], softcap, inv_cap, t);
            const float ez = ex2_ftz((z - mc_sub) * LOG2E);
            d += ez;
#if !HAS_SOFTCAP
            e[j][q] = ez;
#endif
#if HAS_SMOOTHING
            s += z - mc;
#endif
            f[q] = z;
          }
          if (v == vy) {  // one compare per vector; the select per column runs in one thread a row
#pragma unroll
            for (int q = 0; q < VEC; ++q)
              if (q == ky) zy = f[q];
          }
        }
      }
      d = warp_sum(d);
#if HAS_SMOOTHING
      s = warp_sum(s);
#endif
      zy = warp_sum(zy);
      if (lane == 0) {
        red_s[0][warp] = d;
        red_s[1][warp] = s;
        red_s[2][warp] = zy;
      }
      __syncthreads();
      const int phase = xchg & 1;
      if (tid == 0) mbar_arrive_expect(&xbar[phase], CLUSTER * 16);
      if (tid < CLUSTER) {  // thread r sends this CTA's partial to CTA r
        float dc = 0.0f, s_c = 0.0f, zc = 0.0f;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
          dc += red_s[0][w];
          s_c += red_s[1][w];
          zc += red_s[2][w];
        }
        send_f4(&part[phase][rank][0], &xbar[phase], (u32)tid, mc, dc, s_c, zc);
      }
      mbar_wait(&xbar[phase], (u32)(xchg >> 1) & 1u);

      // ---- combine the CLUSTER partials (every thread, from its own CTA's copy)
      float M = NEG_INF;
#pragma unroll
      for (int r = 0; r < CLUSTER; ++r) M = fmaxf(M, part[phase][r][0]);
      const float M_sub = M == NEG_INF ? 0.0f : M;
      float D = 0.0f, S = 0.0f, ZY = 0.0f;
#pragma unroll
      for (int r = 0; r < CLUSTER; ++r) {
        const float mr = part[phase][r][0];
        D += part[phase][r][1] * ex2_ftz((mr - M_sub) * LOG2E);  // an all -inf slice: 0 * 0
#if HAS_SMOOTHING
        const int nr = max(0, min(per_cta, nvec - r * per_cta)) * VEC;
        if (nr > 0) S += part[phase][r][2] + (float)nr * (mr - M);
#endif
        ZY += part[phase][r][3];
      }
      ++xchg;
      (void)S;
      const float log_d = logf(D);
      const float lse = M + log_d;
#if HAS_SMOOTHING
      float row_loss = log_d + (1.0f - label_smoothing) * (M - ZY) - (label_smoothing / (float)n_cols) * S;
#else
      float row_loss = log_d + (M - ZY);
#endif
#if HAS_Z_LOSS
      row_loss += z_loss * lse * lse;
#endif
      if (rank == 0 && tid == 0) loss[row] = row_loss;
      (void)lse;

#if COMPUTE_GRAD
      // ---- gradient: softmax * (1 + 2 z lse) - eps / V - (1 - eps) [j == y], times the scale,
      // through the softcap's 1 - t^2; softmax = exp(z - M) / D as in the Triton kernel, here
      // exp(z - mc) * exp(mc - M) (mc = -inf: the slice's e are 0 and so is the factor).
      float p_coef = sc / D;
#if HAS_Z_LOSS
      p_coef *= 1.0f + 2.0f * z_loss * lse;
#endif
#if !HAS_SOFTCAP
      const float e_coef = p_coef * ex2_ftz((mc - M) * LOG2E);
#endif
      const float smooth_g = HAS_SMOOTHING ? sc * (label_smoothing / (float)n_cols) : 0.0f;
      const float target_g = sc * (1.0f - label_smoothing);
      (void)smooth_g;
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int v = vbeg + j * THREADS + tid;
        if (v < vend) {
          float g[VEC];
#if HAS_SOFTCAP
          float f[VEC];
          unpack(cur[j * THREADS + tid], f);
#endif
#pragma unroll
          for (int q = 0; q < VEC; ++q) {
#if HAS_SOFTCAP
            float t;
            const float z = prep(f[q], softcap, inv_cap, t);
            float gq = ex2_ftz((z - M) * LOG2E) * p_coef;
            f[q] = t;
#else
            float gq = e[j][q] * e_coef;
#endif
#if HAS_SMOOTHING
            gq -= smooth_g;
#endif
            g[q] = gq;
          }
          if (v == vy) {
#pragma unroll
            for (int q = 0; q < VEC; ++q)
              if (q == ky) g[q] -= target_g;
          }
#if HAS_SOFTCAP
#pragma unroll
          for (int q = 0; q < VEC; ++q) g[q] *= 1.0f - f[q] * f[q];
#endif
          st_cs(g_row + (long long)v * 16, pack(g));
        }
      }
#endif
    }
    y = y_next;
    sc = sc_next;
    if (++lb == NBUF) {
      lb = 0;
      lpar ^= 1u;
    }
  }
  cluster_sync();  // no CTA exits while a partial addressed to it may be in flight
}
