"""docs/cpp_api.md against the C++ headers, so the hand-written reference cannot drift from them.

Each `### ` entry of the page names one or more classes as `fusible::<ns>::<Class>` and its header
as `Header: csrc/...`. For every entry: the header exists and is public (reached from
csrc/fusible.h), it opens the class's namespace and defines the class, and every line of the
entry's ```cpp blocks is a declaration found in that header (whitespace and comments ignored).
Every csrc/ path the page mentions exists."""

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"
PAGE = REPO / "docs" / "cpp_api.md"


def _squeeze(text):
    """Text without // comments and without any whitespace."""
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"\s+", "", text)


def _public_headers():
    """Every header csrc/fusible.h includes, directly or through another of ours."""
    seen, todo = set(), ["fusible.h"]
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        for inc in re.findall(r'^#include "([^"]+)"', (CSRC / rel).read_text(), re.M):
            if (CSRC / inc).is_file():
                todo.append(inc)
    return {"csrc/" + rel for rel in seen}


def _entries():
    """(heading, class names, header, declaration lines) per `### ` entry of the page."""
    text = PAGE.read_text()
    out = []
    for section in re.split(r"^### ", text, flags=re.M)[1:]:
        heading = section.split("\n", 1)[0]
        names = re.findall(r"`(fusible::[A-Za-z0-9_:]+)`", heading)
        header = re.search(r"^Header: `([^`]+)`", section, re.M)
        decls = [
            line.strip()
            for block in re.findall(r"```cpp\n(.*?)```", section, re.S)
            for line in block.splitlines()
            if line.strip()
        ]
        out.append((heading, names, header.group(1) if header else None, decls))
    return out


ENTRIES = _entries()


def test_the_page_documents_the_main_classes():
    names = {n for _, entry_names, _, _ in ENTRIES for n in entry_names}
    for required in (
        "fusible::fuser::OperationFuser",
        "fusible::fuser::Sequential",
        "fusible::ops::BasicOperation",
        "fusible::ops::FusedOperation",
        "fusible::ops::OperationContext",
        "fusible::ops::Linear",
        "fusible::ops::Fp8AutocastGuard",
    ):
        assert required in names
    assert len(names) >= 50, "the page lost most of its entries"


@pytest.mark.parametrize("entry", ENTRIES, ids=[e[0][:60] for e in ENTRIES])
def test_entry_matches_its_header(entry):
    heading, names, header, decls = entry
    assert names, f"entry {heading!r} names no fusible:: class"
    assert header is not None, f"entry {heading!r} has no 'Header: `csrc/...`' line"
    path = REPO / header
    assert path.is_file(), f"{heading}: header {header} does not exist"
    assert header in _public_headers(), f"{heading}: {header} is not reached from csrc/fusible.h"
    text = path.read_text()
    for name in names:
        namespace, cls = name.rsplit("::", 1)
        assert re.search(
            rf"^namespace {re.escape(namespace)} {{", text, re.M
        ), f"{name}: {header} does not open namespace {namespace}"
        defines = rf"\b(class|struct|enum class)\s+{cls}\b|FUSIBLE_\w+_CLASS\(\s*{cls}\b"
        assert re.search(defines, text), f"{name}: not defined in {header}"
    squeezed = _squeeze(text)
    for decl in decls:
        assert _squeeze(decl).rstrip(";") in squeezed, f"{heading}: not in {header}: {decl}"


def test_every_csrc_path_on_the_page_exists():
    paths = set(re.findall(r"`(csrc/[^`\s]*)`", PAGE.read_text()))
    assert paths
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, f"docs/cpp_api.md names paths that do not exist: {missing}"


def test_a_wrong_declaration_would_fail():
    # The check itself: a signature that differs from the header's is not found.
    text = (CSRC / "ops" / "basic" / "dropout.h").read_text()
    assert _squeeze("explicit Dropout(double p);").rstrip(";") in _squeeze(text)
    assert _squeeze("explicit Dropout(float p);").rstrip(";") not in _squeeze(text)
