"""Every Python example in docs/ names the test that runs it (tests/docs_examples.py),
and that test exists."""

from __future__ import annotations

import ast

import pytest
from docs_examples import DOCS, ROOT, marked

DOCS_FILES = sorted(p.name for p in DOCS.glob("*.md"))


@pytest.mark.parametrize("doc", DOCS_FILES)
def test_every_python_example_names_the_test_that_runs_it(doc: str) -> None:
    text = (DOCS / doc).read_text(encoding="utf-8")
    blocks = marked(doc)
    assert text.count("```python\n") == len(blocks), f"docs/{doc}: a Python example is unmarked"
    for file, name, _ in blocks:
        path = ROOT / file
        assert path.is_file(), f"docs/{doc} names {file}, which does not exist"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        tests = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in tests, f"docs/{doc} names {file}::{name}, which does not exist"
