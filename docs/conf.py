"""Sphinx configuration: MyST Markdown pages, and the API reference read by autodoc from the
fusible package installed in the environment that runs Sphinx (scripts/docs.sh uses .venv)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The version is written once, in the package's _version.py; read it without importing fusible.
_VERSION_FILE = ROOT / "python_bindings" / "fusible" / "_version.py"
release = re.search(
    r"""^__version__\s*=\s*["']([^"']+)["']""", _VERSION_FILE.read_text(), re.MULTILINE
).group(1)
version = ".".join(release.split(".")[:2])

project = "fusible"
author = "the fusible authors"
copyright = "the fusible authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# MyST: `#`-links to headings down to level 3, e.g. [channels](concepts.md#named-channels).
myst_heading_anchors = 3

# autodoc: the class docstring holds the constructor's arguments; members in source order.
autoclass_content = "class"
autodoc_member_order = "bysource"
autodoc_typehints = "none"
# Overrides without a docstring of their own (extra_repr, train, ...) stay out of the reference
# instead of showing torch.nn.Module's text.
autodoc_inherit_docstrings = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_title = f"fusible {release}"
