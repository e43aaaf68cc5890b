"""te.ops' `ops.fused` module: the fused operations the built-in fusions make."""

from . import builtin_fusions
from .builtin_fusions import *  # noqa: F403

__all__ = list(builtin_fusions.__all__)
