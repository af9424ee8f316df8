"""kprof: profile PyTorch training steps on the roofline, suggest fused kernels, patch them in.

Library entry points: `kprof.patch(model, rules=...) -> PatchReport` (with `.unpatch()`), the
kernels in `kprof.kernels`, the rules in `kprof.rules`. The CLI is `kprof` / `python -m kprof`.
"""

from kprof.errors import KprofError
from kprof.patch import PatchReport, patch  # noqa: E402  (the function shadows the submodule name on purpose)

__version__ = "0.1.0"
__all__ = ["KprofError", "PatchReport", "patch", "__version__"]
