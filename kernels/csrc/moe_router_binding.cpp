// Torch binding of moe_router.cu: checks, allocation, the current stream. Compiled by the host
// compiler (kprof.kernels.cuda_jit); the kernels themselves include no torch header.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

extern "C" cudaError_t kprof_moe_router_fwd(int dtype, const void* logits, long long stride, int n_tokens,
                                            int n_experts, int k, int sigmoid, int renorm, float* weights,
                                            int* indices, int* counts, int* offsets, cudaStream_t stream);
extern "C" cudaError_t kprof_moe_router_bwd(int dtype, const void* logits, long long stride, const float* weights,
                                            const int* indices, const float* dweights, int n_tokens, int n_experts,
                                            int k, int sigmoid, int renorm, void* dlogits, cudaStream_t stream);

static int dtype_code(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat: return 0;
    case torch::kHalf: return 1;
    case torch::kBFloat16: return 2;
    default: TORCH_CHECK(false, "moe_router: logits must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

static void check_logits(const torch::Tensor& logits, int64_t k) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.stride(1) == 1,
              "moe_router: logits must be a 2-D CUDA tensor with unit column stride");
  TORCH_CHECK(k >= 1 && k <= 32 && k <= logits.size(1), "moe_router: need 1 <= k <= min(32, n_experts), got k=", k);
  TORCH_CHECK(logits.size(0) < (1LL << 31) / 32, "moe_router: too many tokens for int32 offsets");
}

// (weights [T, k] fp32, indices [T, k] int32, counts [E] int32, offsets [E] int32 inclusive ends)
std::vector<torch::Tensor> router_fwd(torch::Tensor logits, int64_t k, bool sigmoid, bool renorm) {
  check_logits(logits, k);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t t = logits.size(0), e = logits.size(1);
  auto i32 = logits.options().dtype(torch::kInt);
  auto weights = torch::empty({t, k}, logits.options().dtype(torch::kFloat));
  auto indices = torch::empty({t, k}, i32);
  auto counts = torch::zeros({e + 1}, i32);  // [E] is the kernel's last-block ticket
  auto offsets = torch::zeros({e}, i32);
  if (t > 0) {
    auto rc = kprof_moe_router_fwd(dtype_code(logits), logits.data_ptr(), logits.stride(0), (int)t, (int)e, (int)k,
                                   sigmoid, renorm, weights.data_ptr<float>(), indices.data_ptr<int>(),
                                   counts.data_ptr<int>(), offsets.data_ptr<int>(),
                                   c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(rc == cudaSuccess, "moe_router forward launch: ", cudaGetErrorString(rc));
  }
  return {weights, indices, counts.narrow(0, 0, e), offsets};
}

torch::Tensor router_bwd(torch::Tensor logits, torch::Tensor weights, torch::Tensor indices, torch::Tensor dweights,
                         bool sigmoid, bool renorm) {
  const int64_t k = weights.size(1);
  check_logits(logits, k);
  TORCH_CHECK(weights.is_contiguous() && indices.is_contiguous() && dweights.is_contiguous() &&
                  dweights.scalar_type() == torch::kFloat && indices.scalar_type() == torch::kInt,
              "moe_router backward: contiguous fp32 weights/dweights and int32 indices expected");
  const c10::cuda::CUDAGuard guard(logits.device());
  auto dlogits = torch::empty({logits.size(0), logits.size(1)}, logits.options());
  if (logits.size(0) > 0) {
    auto rc = kprof_moe_router_bwd(dtype_code(logits), logits.data_ptr(), logits.stride(0), weights.data_ptr<float>(),
                                   indices.data_ptr<int>(), dweights.data_ptr<float>(), (int)logits.size(0),
                                   (int)logits.size(1), (int)k, sigmoid, renorm, dlogits.data_ptr(),
                                   c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(rc == cudaSuccess, "moe_router backward launch: ", cudaGetErrorString(rc));
  }
  return dlogits;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("router_fwd", &router_fwd, "MoE router forward (kprof)");
  m.def("router_bwd", &router_bwd, "MoE router backward (kprof)");
}
