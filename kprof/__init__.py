"""kprof: profile PyTorch training steps on the roofline, suggest fused kernels, patch them in."""

from kprof.errors import KprofError

__version__ = "0.1.0"
__all__ = ["KprofError", "__version__"]
