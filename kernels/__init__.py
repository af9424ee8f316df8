"""kprof's fused kernel library (shipped as `kprof.kernels`).

Each kernel is one module: Triton kernels, launchers, autograd.Function, torch.library custom
op, public function, nn.Module drop-in and a pure-PyTorch reference, plus one `KernelSpec` in
`kprof.kernels.registry`.
"""

from kprof.kernels.registry import REGISTRY, Cost, KernelSpec, TensorMeta, get, register

__all__ = ["REGISTRY", "Cost", "KernelSpec", "TensorMeta", "get", "register"]
