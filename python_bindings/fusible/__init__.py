"""fusible: TransformerEngine-style fusible operations, implemented in C++ on LibTorch.

Importing the package loads libfusible, which registers the kernel-level ops as torch.ops.fusible.*.
"""
import torch  # noqa: F401  (libtorch must be loaded before libfusible)

from . import _C
from . import ops

cuda_built: bool = _C.cuda_built

__all__ = ["cuda_built", "ops"]
