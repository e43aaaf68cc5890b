"""te.ops' `ops.linear` module: the composite Linear."""

from ._basic import Linear

__all__ = ["Linear"]
