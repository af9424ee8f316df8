// kprof MoE router: scores (softmax or sigmoid), top-k, optional renormalisation, per-expert
// counts and offsets, in one kernel; and its backward w.r.t. the logits.
//
// Why one kernel: eager routing (softmax -> topk -> sum/div -> bincount or one_hot -> cumsum) is
// 6-9 kernels over [T, E] and [T, k], each a launch and a round trip through memory; the logits
// row of one token is E values (8-256), so one warp holds it and does everything in registers.
//
// One warp per token. Top-k is k rounds of a warp argmax over the RAW logits (softmax and sigmoid
// are monotonic, so they select the same experts); round j takes the best entry strictly below
// round j-1's in the order (value descending, index ascending), so no "taken" set is kept and
// ties go to the lower expert index. NaN logits rank as -inf. Softmax needs max and sum: the max
// is round 0's value, and the sum is one pass over the row (skipped when renormalising, where
// the weights are a softmax over the k chosen logits alone).
//
// Counts: one atomicAdd per (token, slot). Offsets (inclusive ends, int32, what
// torch._grouped_mm takes as `offs`): the last block to finish (a ticket in counts[E], as in
// CUDA's threadFenceReduction sample) scans the counts, so no second launch and no host sync.
//
// This file includes no torch header: the CPU CI compiles it with nvcc for sm_90 alone
// (tests/kernels/test_moe_router.py); the torch binding is moe_router_binding.cpp.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>
#include <stdint.h>

namespace kprof_moe {

constexpr int kWarp = 32;
constexpr int kThreads = 256;  // 8 tokens per block
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float load_logit(float x) { return isnan(x) ? -CUDART_INF_F : x; }

// (v, i) ranks before (w, j): larger value first, then lower index. i < 0 is "none yet".
__device__ __forceinline__ bool before(float v, int i, float w, int j) {
  return j < 0 || (i >= 0 && (v > w || (v == w && i < j)));
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) router_fwd(
    const T* __restrict__ logits, long long row_stride, int n_tokens, int n_experts, int k, int sigmoid,
    int renorm, float* __restrict__ weights, int* __restrict__ indices, int* __restrict__ counts,
    int* __restrict__ offsets) {
  const int lane = threadIdx.x % kWarp;
  const int token = blockIdx.x * (kThreads / kWarp) + threadIdx.x / kWarp;
  if (token < n_tokens) {
    const T* row = logits + token * row_stride;
    float prev_v = CUDART_INF_F;
    int prev_i = -1;
    float my_v = -CUDART_INF_F;  // lane j < k keeps round j's pick
    int my_i = 0;
    for (int j = 0; j < k; ++j) {
      float best_v = -CUDART_INF_F;
      int best_i = -1;
      for (int e = lane; e < n_experts; e += kWarp) {
        const float v = load_logit(to_f(row[e]));
        const bool below_prev = prev_i < 0 || v < prev_v || (v == prev_v && e > prev_i);
        if (below_prev && before(v, e, best_v, best_i)) { best_v = v; best_i = e; }
      }
      for (int o = kWarp / 2; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(kFull, best_v, o);
        const int oi = __shfl_xor_sync(kFull, best_i, o);
        if (before(ov, oi, best_v, best_i)) { best_v = ov; best_i = oi; }
      }
      if (lane == j) { my_v = best_v; my_i = best_i; }
      prev_v = best_v;
      prev_i = best_i;
    }
    const bool mine = lane < k;
    float w;
    if (sigmoid) {
      w = mine ? 1.0f / (1.0f + __expf(-my_v)) : 0.0f;
      if (renorm) w /= warp_sum(w);
    } else {
      const float m = __shfl_sync(kFull, my_v, 0);  // round 0: the row's max
      w = mine ? __expf(my_v - m) : 0.0f;
      float z;
      if (renorm) {
        z = warp_sum(w);
      } else {
        z = 0.0f;
        for (int e = lane; e < n_experts; e += kWarp) z += __expf(load_logit(to_f(row[e])) - m);
        z = warp_sum(z);
      }
      w /= z;
    }
    if (mine) {
      weights[(long long)token * k + lane] = w;
      indices[(long long)token * k + lane] = my_i;
      atomicAdd(&counts[my_i], 1);
    }
  }
  // The last block to finish turns the counts into offsets.
  __shared__ bool last;
  __shared__ int partial[kThreads];
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // this block's counts before its ticket
    last = atomicAdd(&counts[n_experts], 1) == (int)gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int per = (n_experts + kThreads - 1) / kThreads;
  const int lo = min(n_experts, (int)threadIdx.x * per), hi = min(n_experts, lo + per);
  int s = 0;
  for (int e = lo; e < hi; ++e) s += __ldcg(&counts[e]);  // L2, not a stale L1 line
  partial[threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    int run = 0;
    for (int t = 0; t < kThreads; ++t) { const int c = partial[t]; partial[t] = run; run += c; }
  }
  __syncthreads();
  s = partial[threadIdx.x];
  for (int e = lo; e < hi; ++e) { s += __ldcg(&counts[e]); offsets[e] = s; }
}

// d logits from d weights. With p the softmax over all experts and w the returned weights:
//   softmax, renorm:    w = softmax over the k chosen logits; dl_i = w_i (dw_i - sum_j w_j dw_j),
//                       0 elsewhere
//   softmax, no renorm: w_i = p_i; dl_e = p_e (g_e - sum_j w_j dw_j), g_e = dw_i where e = i, else 0
//   sigmoid:            s_i = sigmoid(l_i); no renorm: dl_i = dw_i s_i (1 - s_i);
//                       renorm (w = s / S): dl_i = (dw_i - sum_j w_j dw_j) / S * s_i (1 - s_i)
template <typename T>
__global__ void __launch_bounds__(kThreads) router_bwd(
    const T* __restrict__ logits, long long row_stride, const float* __restrict__ weights,
    const int* __restrict__ indices, const float* __restrict__ dweights, int n_tokens, int n_experts, int k,
    int sigmoid, int renorm, T* __restrict__ dlogits) {
  const int lane = threadIdx.x % kWarp;
  const int token = blockIdx.x * (kThreads / kWarp) + threadIdx.x / kWarp;
  if (token >= n_tokens) return;
  const T* row = logits + token * row_stride;
  T* drow = dlogits + (long long)token * n_experts;
  const bool mine = lane < k;
  const long long at = (long long)token * k + lane;
  const float w = mine ? weights[at] : 0.0f;
  const float dw = mine ? dweights[at] : 0.0f;
  const int i = mine ? indices[at] : 0;
  const float dot = warp_sum(w * dw);
  float dl = 0.0f;
  if (!sigmoid && !renorm) {
    const float m = load_logit(to_f(row[__shfl_sync(kFull, i, 0)]));
    float z = 0.0f;
    for (int e = lane; e < n_experts; e += kWarp) z += __expf(load_logit(to_f(row[e])) - m);
    z = warp_sum(z);
    for (int e = lane; e < n_experts; e += kWarp) drow[e] = from_f<T>(-__expf(load_logit(to_f(row[e])) - m) / z * dot);
    dl = w * (dw - dot);
  } else {
    for (int e = lane; e < n_experts; e += kWarp) drow[e] = from_f<T>(0.0f);
    if (!sigmoid) {
      dl = w * (dw - dot);
    } else {
      const float s = mine ? 1.0f / (1.0f + __expf(-load_logit(to_f(row[i])))) : 0.0f;
      const float ds = renorm ? (dw - dot) / warp_sum(s) : dw;
      dl = ds * s * (1.0f - s);
    }
  }
  __syncwarp();  // orders the row's plain writes before the chosen experts' values
  if (mine) drow[i] = from_f<T>(dl);
}

template <typename T>
cudaError_t launch_fwd(const void* logits, long long stride, int n_tokens, int n_experts, int k, int sigmoid,
                       int renorm, float* weights, int* indices, int* counts, int* offsets, cudaStream_t stream) {
  const int blocks = (n_tokens + kThreads / kWarp - 1) / (kThreads / kWarp);
  router_fwd<T><<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(logits), stride, n_tokens, n_experts, k,
                                                 sigmoid, renorm, weights, indices, counts, offsets);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_bwd(const void* logits, long long stride, const float* weights, const int* indices,
                       const float* dweights, int n_tokens, int n_experts, int k, int sigmoid, int renorm,
                       void* dlogits, cudaStream_t stream) {
  const int blocks = (n_tokens + kThreads / kWarp - 1) / (kThreads / kWarp);
  router_bwd<T><<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(logits), stride, weights, indices, dweights,
                                                 n_tokens, n_experts, k, sigmoid, renorm, static_cast<T*>(dlogits));
  return cudaGetLastError();
}

}  // namespace kprof_moe

// dtype: 0 float32, 1 float16, 2 bfloat16. n_tokens > 0; counts holds n_experts + 1 zeros.
extern "C" cudaError_t kprof_moe_router_fwd(int dtype, const void* logits, long long stride, int n_tokens,
                                            int n_experts, int k, int sigmoid, int renorm, float* weights,
                                            int* indices, int* counts, int* offsets, cudaStream_t stream) {
  using namespace kprof_moe;
  switch (dtype) {
    case 0: return launch_fwd<float>(logits, stride, n_tokens, n_experts, k, sigmoid, renorm, weights, indices, counts, offsets, stream);
    case 1: return launch_fwd<__half>(logits, stride, n_tokens, n_experts, k, sigmoid, renorm, weights, indices, counts, offsets, stream);
    case 2: return launch_fwd<__nv_bfloat16>(logits, stride, n_tokens, n_experts, k, sigmoid, renorm, weights, indices, counts, offsets, stream);
    default: return cudaErrorInvalidValue;
  }
}

extern "C" cudaError_t kprof_moe_router_bwd(int dtype, const void* logits, long long stride, const float* weights,
                                            const int* indices, const float* dweights, int n_tokens, int n_experts,
                                            int k, int sigmoid, int renorm, void* dlogits, cudaStream_t stream) {
  using namespace kprof_moe;
  switch (dtype) {
    case 0: return launch_bwd<float>(logits, stride, weights, indices, dweights, n_tokens, n_experts, k, sigmoid, renorm, dlogits, stream);
    case 1: return launch_bwd<__half>(logits, stride, weights, indices, dweights, n_tokens, n_experts, k, sigmoid, renorm, dlogits, stream);
    case 2: return launch_bwd<__nv_bfloat16>(logits, stride, weights, indices, dweights, n_tokens, n_experts, k, sigmoid, renorm, dlogits, stream);
    default: return cudaErrorInvalidValue;
  }
}
