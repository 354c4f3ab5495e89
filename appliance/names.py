"""What a model name, a version and a file name may be, and where model files may come from.

Every name that arrives from outside (an HTTP path, a gRPC field, an MQTT topic, an
ensemble step, a load request's ``config``, a file name a config names) passes
through here before it touches the file system or the routing table. One rule,
one place:

- A **model name** is one path component, as Triton defines it: 1 to
  :data:`MAX_NAME_BYTES` bytes of UTF-8; no ``/``, ``\\``, NUL or other control or
  invisible format characters; not starting with a dot (``.``, ``..`` and hidden
  staging folders included); no leading or trailing white space; and no character
  whose Unicode compatibility form (NFKC) would bring any of these back (a
  fullwidth solidus U+FF0F or a two-dot leader U+2025), nor a slash look-alike
  such as the division slash U+2215.
- A **file name** a config names (``default_model_filename``, a warm-up
  ``input_data_file``, ``label_filename``) follows the same rule: it names a file
  in its folder, never a path.
- A **version** is a decimal number of ASCII digits, 1 to 2**63 - 1 (Triton's
  int64), or empty for "the newest ready version".
- A model folder, version folder or model file is used only when, after every
  symbolic link is followed, it still lies inside the model repository, unless
  the operator set ``allow_symlinked_models`` (links placed by whoever can write
  the repository are then trusted; names from requests are still one component).
"""

from __future__ import annotations

import functools
import unicodedata
from pathlib import Path

from appliance.errors import invalid, not_found

MAX_NAME_BYTES = 255  # a file name on Linux (NAME_MAX)
MAX_VERSION = 2**63 - 1
# control, format (zero-width, bidi overrides), surrogate, private-use, unassigned;
# line and paragraph separators
_BAD_CATEGORIES = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"}
# slashes that NFKC leaves alone but a reader of a log or a listing takes for one
_LOOKALIKE_SEPARATORS = set("\u2044\u2215\u2216\u29f5\u29f8\u29f9")


def name_problem(name: object) -> str:
    """Why ``name`` is not one safe path component ("" when it is)."""
    if not isinstance(name, str):
        return f"expected a string, got {type(name).__name__}"
    return _str_problem(name)


# every request names its model: the per-character checks run once per distinct name
# (bounded, so a flood of made-up names cannot grow it)
@functools.lru_cache(maxsize=4096)
def _str_problem(name: str) -> str:
    if not name:
        return "it is empty"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return f"it is longer than {MAX_NAME_BYTES} bytes"
    for form in (name, unicodedata.normalize("NFKC", name)):
        if "/" in form or "\\" in form:
            return "it contains a path separator ('/' or '\\')"
        if form.startswith("."):
            return "it starts with a dot"
        if ".." in form:
            return "it contains '..'"
    if _LOOKALIKE_SEPARATORS & set(name):
        return "it contains a character that looks like a path separator"
    if any(unicodedata.category(c) in _BAD_CATEGORIES for c in name):
        return "it contains a control or invisible character"
    if name != name.strip():
        return "it starts or ends with white space"
    return ""


def is_name(name: object) -> bool:
    return not name_problem(name)


def check_model_name(name: object) -> str:
    """``name`` when it is a valid model name; INVALID_ARG saying why not."""
    problem = name_problem(name)
    if problem:
        raise invalid(
            f"invalid model name {_shown(name)}: {problem} (a model name is one folder name "
            f"of the model repository)"
        )
    assert isinstance(name, str)
    return name


def version_problem(version: object) -> str:
    """Why ``version`` is not a version number ("" when it is, or is empty)."""
    if not isinstance(version, str):
        return f"expected a string, got {type(version).__name__}"
    if not version:
        return ""
    # isascii: str.isdigit also accepts digits such as '²' that int() rejects
    if not (version.isascii() and version.isdigit()):
        return "expected a decimal number"
    if len(version) > 19 or not 1 <= int(version) <= MAX_VERSION:
        return f"expected a number from 1 to {MAX_VERSION}"
    return ""


def check_version(version: object) -> str:
    """``version`` when it is a version number or empty; INVALID_ARG otherwise."""
    problem = version_problem(version)
    if problem:
        # Triton's words, which clients test for, then ours
        raise invalid(
            f"failed to get model version from specified version string {_shown(version)} "
            f"(details: invalid model version: {problem}), version should be an integral "
            "value > 0"
        )
    assert isinstance(version, str)
    return version


# (name, version) pairs that passed both checks: every request names its model, and
# the hot path then costs one dict lookup (bounded: cleared when full, so a flood of
# made-up names cannot grow it; refused pairs are never kept)
_GOOD_PAIRS: dict[tuple[str, str], None] = {}
_GOOD_PAIRS_MAX = 4096


def check_model_and_version(name: object, version: object) -> tuple[str, str]:
    """(``name``, ``version``) when both are valid (:func:`check_model_name`,
    :func:`check_version`); INVALID_ARG naming the first that is not."""
    if type(name) is str and type(version) is str and (name, version) in _GOOD_PAIRS:
        return name, version
    pair = check_model_name(name), check_version(version)
    if len(_GOOD_PAIRS) >= _GOOD_PAIRS_MAX:
        _GOOD_PAIRS.clear()
    _GOOD_PAIRS[pair] = None
    return pair


def version_folder(name: str) -> int | None:
    """The version a folder name stands for; None when it is not a version number."""
    return int(name) if name and not version_problem(name) else None


def inside(root: Path, path: Path) -> bool:
    """True when ``path``, every link followed, lies inside ``root`` (also resolved)."""
    try:
        return path.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):  # a symlink loop
        return False


def confine(root: Path, path: Path, allow_links: bool, what: str) -> Path:
    """``path`` when it may be used: inside ``root`` once links are followed, or
    ``allow_links``. INVALID_ARG naming ``what`` otherwise (blocking: a stat)."""
    if allow_links or inside(root, path):
        return path
    raise invalid(
        f"{what} is a symbolic link that leads outside the model repository; refused "
        f"(set allow_symlinked_models: true in the server config to trust such links)"
    )


def model_dir(repository: Path, name: object, allow_links: bool) -> Path:
    """The folder of model ``name``: INVALID_ARG for a name that is not one safe
    component or a folder that leads outside, NOT_FOUND when there is none."""
    checked = check_model_name(name)
    path = repository / checked
    if not path.is_dir():
        raise not_found(f"model '{checked}' is not in the model repository")
    return confine(repository, path, allow_links, f"the folder of model '{checked}'")


def _shown(value: object) -> str:
    """A value quoted for a message, cut short: never echo megabytes back."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
