"""Python models' own import namespaces: helpers beside ``model.py`` are private to
each model version, as Triton's one stub process per model keeps them (unit level here;
end to end through a server in ``test_python_backend.py``)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from appliance.backends.python_imports import Namespace


def _files(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return folder


MODEL = """
import json
import utils
from utils import scale
import lib.sub
from lib.sub import NAME as SUB_NAME
from . import utils as relative_utils

def lazy():
    import utils
    return utils
"""


def test_two_folders_with_the_same_helper_names_stay_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    spaces = []
    for n, factor in ((1, 2), (2, 30)):
        folder = _files(
            tmp_path / f"m{n}",
            {
                "model.py": MODEL,
                "utils.py": f"FACTOR = {factor}\ndef scale(x):\n    return x * FACTOR\n",
                "lib/__init__.py": "",
                "lib/sub.py": f"NAME = 'sub{n}'\n",
            },
        )
        spaces.append(Namespace(folder))
    try:
        one, two = (space.load(space.folder / "model.py") for space in spaces)
        assert (one.scale(1), two.scale(1)) == (2, 30)
        assert one.utils is not two.utils and one.utils.FACTOR == 2
        assert one.relative_utils is one.utils and one.lazy() is one.utils  # one module
        assert two.lazy() is two.utils  # imports inside functions too
        assert (one.SUB_NAME, two.lib.sub.NAME) == ("sub1", "sub2")
        assert one.json is sys.modules["json"]  # everything else: the normal imports
        for name in ("utils", "lib", "lib.sub", "model"):
            assert name not in sys.modules  # nothing under the helpers' own names
        assert one.__name__ == f"{spaces[0].package}.model"
        assert sys.modules[f"{spaces[1].package}.utils"] is two.utils
        assert not list(spaces[0].folder.glob("**/__pycache__"))  # no bytecode written
    finally:
        for space in spaces:
            space.close()
    for space in spaces:
        assert not [m for m in sys.modules if m.partition(".")[0] == space.package]


def test_a_new_namespace_over_changed_files_runs_the_new_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    folder = _files(tmp_path / "m", {"model.py": "import utils\n", "utils.py": "V = 1\n"})
    first = Namespace(folder)
    old = first.load(folder / "model.py")
    (folder / "utils.py").write_text("V = 2\n")  # same size, same second: no stale bytecode
    second = Namespace(folder)
    try:
        assert (old.utils.V, second.load(folder / "model.py").utils.V) == (1, 2)
    finally:
        first.close()
        second.close()


def test_names_the_folder_cannot_take_over(tmp_path: Path) -> None:
    folder = _files(
        tmp_path / "m",
        {
            # a built-in module and a data folder named like an installed package stay
            # the process's; a data folder with a fresh name is a namespace package
            "model.py": "import sys\nimport numpy\nimport mydata_21b.table as table\n",
            "sys.py": "raise RuntimeError('shadowed sys')\n",
            "numpy/weights.txt": "not a module\n",
            "mydata_21b/table.py": "ROWS = 3\n",
        },
    )
    space = Namespace(folder)
    try:
        module = space.load(folder / "model.py")
        assert module.sys is sys and module.numpy is sys.modules["numpy"]
        assert module.table.ROWS == 3 and "mydata_21b" not in sys.modules
    finally:
        space.close()


def test_a_failing_import_leaves_nothing_behind(tmp_path: Path) -> None:
    folder = _files(tmp_path / "m", {"model.py": "import utils\n", "utils.py": "1/0\n"})
    space = Namespace(folder)
    with pytest.raises(ZeroDivisionError):
        space.load(folder / "model.py")
    space.close()
    assert not [m for m in sys.modules if m.partition(".")[0] == space.package]
