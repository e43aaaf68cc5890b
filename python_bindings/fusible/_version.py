"""fusible's version: the one place it is written (the wheel's metadata and the CMake package read
it here)."""

__version__ = "0.1.0"
