"""fusible: TransformerEngine-style fusible operations, implemented in C++ on LibTorch.

Importing the package loads libfusible, which registers the kernel-level ops as torch.ops.fusible.*.
"""

import ctypes

import torch  # noqa: F401  (libtorch must be loaded before libfusible)

# Python loads extensions with RTLD_LOCAL, so libstdc++ may not be in the global symbol scope; then
# the std:: template instances that some compilers (GCC 13) emit weakly into libfusible bind to
# libfusible's own copies, whose locale ids do not match the runtime's, and iostream formatting
# (every error message) crashes. Making libstdc++ global first binds them to the one runtime copy.
ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)

from . import _C, _inductor_fallbacks, functional, ops, recipe  # noqa: E402  (after the above)
from ._version import __version__  # noqa: E402
from .quantization import autocast, fp8_available, quantized_model_init  # noqa: E402

cuda_built: bool = _C.cuda_built
_inductor_fallbacks.install()

__all__ = [
    "__version__",
    "autocast",
    "cuda_built",
    "fp8_available",
    "functional",
    "ops",
    "quantized_model_init",
    "recipe",
]
