"""te.ops' `ops.sequential` module."""

from ._containers import Sequential

__all__ = ["Sequential"]
