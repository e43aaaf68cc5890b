"""fusible: TransformerEngine-style fusible operations, implemented in C++ on LibTorch.

Importing the package loads libfusible, which registers the kernel-level ops as torch.ops.fusible.*.
"""

import ctypes
import os as _os

import torch  # noqa: F401  (libtorch must be loaded before libfusible)

# Python loads extensions with RTLD_LOCAL, so libstdc++ may not be in the global symbol scope; then
# the std:: template instances that some compilers (GCC 13) emit weakly into libfusible bind to
# libfusible's own copies, whose locale ids do not match the runtime's, and iostream formatting
# (every error message) crashes. Making libstdc++ global first binds them to the one runtime copy.
ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)

from . import _C, _inductor_fallbacks, functional, ops, recipe  # noqa: E402  (after the above)
from ._version import __version__  # noqa: E402
from .activation_checkpoint import checkpoint  # noqa: E402
from .quantization import (  # noqa: E402
    autocast,
    fp8_available,
    fp8_block_scaling_available,
    quantized_model_init,
)

cuda_built: bool = _C.cuda_built
#: Where CMake finds the C++ package of an installed fusible (find_package(fusible)), as
#: torch.utils.cmake_prefix_path is torch's; it exists in an installed wheel, not in a build tree.
cmake_prefix_path: str = _os.path.join(_os.path.dirname(__file__), "share", "cmake")
_inductor_fallbacks.install()

__all__ = [
    "__version__",
    "autocast",
    "checkpoint",
    "cmake_prefix_path",
    "cuda_built",
    "fp8_available",
    "fp8_block_scaling_available",
    "functional",
    "ops",
    "quantized_model_init",
    "recipe",
]
