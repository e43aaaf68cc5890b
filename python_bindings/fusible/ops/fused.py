"""Built-in fused operation classes. The built-in fusions (cuBLASLt epilogues) arrive with the CUDA
kernels; until then plans contain basic ops only and this module is empty."""

__all__ = []
