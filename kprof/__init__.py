"""kprof: profile PyTorch training steps on the roofline, suggest fused kernels, patch them in.

Library entry points: `kprof.patch(model, rules=...) -> PatchReport` (with `.unpatch()`), the
kernels in `kprof.kernels`, the rules in `kprof.rules`. The CLI is `kprof` / `python -m kprof`.
"""

from kprof.errors import KprofError
from kprof.patching.install import PatchReport, patch
from kprof.version import __version__

__all__ = ["KprofError", "PatchReport", "patch", "__version__"]
