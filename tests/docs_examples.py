"""The Python examples of docs/*.md, for the tests that run them.

Each ```python block in docs/ is preceded by ``<!-- docs-test: tests/FILE.py::TEST -->``
naming the test that runs it as written (with only hosts and ports put in);
tests/test_docs_examples.py fails on a block without one, or naming a test that does
not exist, so an example cannot be added unrun.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MARKED = re.compile(r"<!-- docs-test: (\S+?)::(\w+) -->\n```python\n(.*?)```", re.S)


def marked(doc: str) -> list[tuple[str, str, str]]:
    """(test file, test name, code) of each marked Python block of ``docs/<doc>``."""
    text = (DOCS / doc).read_text(encoding="utf-8")
    return [(m[1], m[2], m[3]) for m in MARKED.finditer(text)]


def examples(doc: str, test: str) -> list[str]:
    """The code of the blocks of ``docs/<doc>`` that name ``test``, in order."""
    found = [code for _, name, code in marked(doc) if name == test]
    assert found, f"docs/{doc} has no example marked for {test}"
    return found
