"""Every Python example in docs/ names the test that runs it (tests/docs_examples.py),
and that test exists."""

from __future__ import annotations

import ast
import re

import pytest
from docs_examples import DOCS, ROOT, marked

DOCS_FILES = sorted(p.name for p in DOCS.glob("*.md"))
RESULTS_FILES = sorted(p.name for p in (ROOT / "benchmarks" / "results").glob("*.md"))


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


# a tracker only this project's engineers see ("issue 20", "section 6's additions");
# an upstream project's issue or a specification's section, named as such, is fine
INTERNAL = re.compile(
    r"(?<!openvino )\bissues? ?#?\d+|\bissue\d+|(?<!MQTT v5 )\bsections? \d+", re.I
)


@pytest.mark.parametrize(
    "doc",
    [
        "README.md",
        "benchmarks/README.md",
        *(f"docs/{name}" for name in DOCS_FILES),
        *(f"benchmarks/results/{name}" for name in RESULTS_FILES),
    ],
)
def test_the_docs_name_no_internal_tracker(doc: str) -> None:
    text = (ROOT / doc).read_text(encoding="utf-8")
    found = [m.group(0) for m in INTERNAL.finditer(text)]
    assert not found, f"{doc} speaks of {found}: say what is meant instead"
