"""A private import namespace for each Python model instance.

Triton runs one stub process per model instance with the version folder on its
``sys.path``, so a ``model.py`` imports the helpers beside it (``import utils``,
``from utils import f``) and two models' ``utils.py`` never meet. In one process a
plain ``sys.path`` entry cannot do that: ``sys.modules["utils"]`` would hold the
first model's helper for every later model, and a hot swap to a version with a
changed ``utils.py`` would keep running the old code.

So each instance's version folder becomes a package of its own,
``appliance_python_model_<n>``, and its files its submodules: ``model.py`` runs as
``appliance_python_model_<n>.model``. Code in those files imports through a
``__import__`` of its own (the modules' ``__builtins__``), which sends a top-level
name found in the folder (``utils`` for ``utils.py`` or a ``utils/`` package) to
the private package and every other name to the normal import system; relative
imports (``from . import utils``) work as well. Nothing is put on ``sys.path``.
:meth:`Namespace.close` forgets the modules again (a swapped-out version leaves
nothing behind in ``sys.modules``). Source files are compiled as read, without
bytecode caches: nothing is written into the model repository.

Not redirected: ``importlib.import_module("utils")`` and other imports by string
that bypass ``__import__``; model code that needs one uses the private name
(``__package__ + ".utils"``).
"""

from __future__ import annotations

import builtins
import importlib.machinery
import importlib.util
import itertools
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

PREFIX = "appliance_python_model_"
_COUNTER = itertools.count(1)
# names a model folder cannot take over: the process's own modules
_RESERVED = frozenset(sys.builtin_module_names) | {"triton_python_backend_utils", "__pycache__"}

Importer = Callable[..., ModuleType]


class _Loader(importlib.machinery.SourceFileLoader):
    """Runs a model folder's source file with the namespace's ``__import__``."""

    def __init__(self, fullname: str, path: str, namespace_builtins: dict[str, Any]) -> None:
        super().__init__(fullname, path)
        self._builtins = namespace_builtins

    def get_code(self, fullname: str) -> Any:
        # compiled from the source every time: no bytecode is read (a file changed in
        # the same second as its cached copy would run stale) or written into the
        # model repository (a read-only or verified folder stays as installed)
        return self.source_to_code(self.get_data(self.path), self.path)

    def exec_module(self, module: ModuleType) -> None:
        module.__dict__["__builtins__"] = self._builtins
        super().exec_module(module)


class _Finder:
    """On ``sys.meta_path``: finds the submodules of every open namespace (and only
    those) in its folder, loading source files with :class:`_Loader`."""

    def __init__(self) -> None:
        self.open: dict[str, dict[str, Any]] = {}  # package name -> its builtins

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        top = fullname.partition(".")[0]
        namespace_builtins = self.open.get(top)
        if namespace_builtins is None or fullname == top or path is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec  # a namespace folder, bytecode or an extension module: as found
        assert spec.origin is not None  # a source file has one
        return importlib.util.spec_from_file_location(
            fullname,
            spec.origin,
            loader=_Loader(fullname, spec.origin, namespace_builtins),
            submodule_search_locations=spec.submodule_search_locations,
        )


_FINDER = _Finder()
_INSTALL = threading.Lock()


def _local_names(folder: Path) -> frozenset[str]:
    """Top-level module names the folder provides, as ``sys.path[0]`` would: source,
    bytecode and extension files, packages, and folders without ``__init__.py``
    (namespace packages) only where no other module of that name exists."""
    suffixes = importlib.machinery.all_suffixes()
    names: set[str] = set()
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_dir():
                if not entry.name.isidentifier():
                    continue
                package = os.path.isfile(os.path.join(entry.path, "__init__.py"))
                if package or importlib.machinery.PathFinder.find_spec(entry.name) is None:
                    names.add(entry.name)
                continue
            for suffix in suffixes:
                stem = entry.name[: -len(suffix)]
                if entry.name.endswith(suffix) and stem.isidentifier():
                    names.add(stem)
    return frozenset(names - _RESERVED)


def _importer(package: str, local: frozenset[str]) -> Importer:
    real = builtins.__import__

    def __import__(  # it stands in for the builtin of that name
        name: str,
        globals: dict[str, Any] | None = None,  # the builtin's signature
        locals: dict[str, Any] | None = None,
        fromlist: Sequence[str] | None = (),
        level: int = 0,
    ) -> ModuleType:
        if level == 0:
            top = name.partition(".")[0]
            if top in local:
                module = real(f"{package}.{name}", globals, locals, fromlist, 0)
                # ``import utils.x`` binds ``utils``; ``from utils import f`` wants utils
                return module if fromlist else sys.modules[f"{package}.{top}"]
        return real(name, globals, locals, fromlist, level)

    return __import__


class Namespace:
    """One instance's private package over its version folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.package = f"{PREFIX}{next(_COUNTER)}"
        self.builtins = dict(builtins.__dict__)
        self.builtins["__import__"] = _importer(self.package, _local_names(folder))
        root = ModuleType(self.package, f"the private namespace of {folder}")
        root.__path__ = [str(folder)]
        root.__package__ = self.package
        root.__spec__ = importlib.machinery.ModuleSpec(self.package, None, is_package=True)
        root.__spec__.submodule_search_locations = [str(folder)]
        with _INSTALL:
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
            _FINDER.open[self.package] = self.builtins
            sys.modules[self.package] = root

    def load(self, path: Path) -> ModuleType:
        """Import ``path`` (a file in the folder, e.g. ``model.py``) as a submodule."""
        name = f"{self.package}.{path.stem}"
        loader = _Loader(name, str(path), self.builtins)
        spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
        assert spec is not None  # a loader was given
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        return module

    def close(self) -> None:
        """Forget the namespace's modules (their objects live on while referenced)."""
        with _INSTALL:
            _FINDER.open.pop(self.package, None)
            prefix = self.package + "."
            for name in list(sys.modules):  # a copy: other threads may import meanwhile
                if name == self.package or name.startswith(prefix):
                    sys.modules.pop(name, None)
