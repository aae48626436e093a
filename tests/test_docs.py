"""The documents point at real things: every `file.py::name` in README.md's concern map is a file
that defines that function, class or method, each of the 15 concerns has code and a test, and every
lab switch the map and docs/LAB.md mention exists."""
from __future__ import annotations

import ast
import re

from conftest import ROOT
from loop.lab import SWITCHES

REF = re.compile(r"`([\w/]+\.py)::([\w.]+)`")
CONCERNS = ["data loading", "forward/backward/step", "mixed precision (AMP)", "gradient accumulation",
            "gradient clipping", "LR schedule", "checkpointing", "resumption", "validation and EMA",
            "metrics", "determinism", "NaN/Inf and OOM handling", "multi-GPU",
            "early stopping and best checkpoint", "run metadata"]


def concern_map() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## The concern map", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and "::" in line]


def defined_names(path) -> set[str]:
    """Top-level functions and classes, and Class.method, of a Python file."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{n.name}" for n in node.body if isinstance(n, ast.FunctionDef)}
    return names


def test_every_concern_has_a_row_with_code_and_a_test():
    rows = concern_map()
    assert [r.split("|")[1].strip().strip("*") for r in rows] == CONCERNS
    for row in rows:
        refs = REF.findall(row)
        assert any(not f.startswith("tests/") for f, _ in refs), row
        assert any(f.startswith("tests/") for f, _ in refs), row


def test_every_file_function_and_test_named_exists():
    refs = [ref for row in concern_map() for ref in REF.findall(row)]
    assert len(refs) >= 45
    for file, name in refs:
        path = ROOT / file
        assert path.is_file(), file
        assert name in defined_names(path), f"{file} defines no {name}"


def test_the_lab_switches_named_in_the_docs_exist():
    for doc in ("README.md", "docs/LAB.md"):
        named = set(re.findall(r"lab\.break=([a-z_]+)", (ROOT / doc).read_text()))
        assert named and named <= set(SWITCHES), (doc, named - set(SWITCHES))
    assert set(re.findall(r"lab\.break=([a-z_]+)", (ROOT / "docs/LAB.md").read_text())) == set(SWITCHES)


def test_the_readme_is_short_and_its_links_lead_somewhere():
    # A newcomer reads it in ten minutes: the details are in docs/, one file per concern.
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 15_000
    links = re.findall(r"\]\(([^)#]+)\)", readme)
    assert links and all((ROOT / link).is_file() for link in links), links
    assert {p.name for p in (ROOT / "docs").glob("*.md")} <= {link.split("/")[-1] for link in links}
