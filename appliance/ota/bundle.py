"""Model bundles: one reproducible, inspectable, safely extractable file per version.

A bundle is a gzip-compressed tar holding, in this order, ``manifest.json`` (see
:mod:`appliance.ota.manifest`), the model's config file as it was built, and the version
folder's files under ``model/``. Building is reproducible: members sorted, mtime
0, uid/gid 0 with empty owner names, fixed modes, gzip with no name and mtime 0,
so the same input gives the same bytes (and the same TUF hash).

Reading never executes anything: :func:`inspect` parses the manifest and checks
every member against it; :func:`extract` writes only regular files, refuses
absolute paths, ``..``, links, device files, members the manifest does not list
or larger than it says, and verifies each file's sha256 as it is written, into a
fresh staging folder the caller renames into place.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import platform
import shutil
import tarfile
import tempfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from appliance.config.reader import CONFIG_FILES
from appliance.ota import OtaError, release
from appliance.ota.manifest import MAX_MANIFEST_BYTES, FileEntry, Manifest, parse, safe_path
from appliance.ota.rollout import check_name

MODEL_PREFIX = "model/"
_CHUNK = 1 << 20
DEFAULT_MAX_BYTES = 4 << 30  # what `bundle inspect` reads at most; the agent's default too
# a member's extended header (a PAX header, a GNU long name or link) holds a path and a
# few numbers: anything beyond this is refused before it is read
MAX_HEADER_BYTES = 64 << 10
_EXTENDED = (
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
)


def _member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _entries(folder: Path) -> list[tuple[FileEntry, Path]]:
    """Each regular file below ``folder`` with its manifest entry, sorted by path."""
    entries: list[tuple[FileEntry, Path]] = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for f in sorted(files):
            path = Path(root) / f
            if path.is_symlink() or not path.is_file():
                raise OtaError(f"{path}: only regular files can be bundled (no links)")
            rel = safe_path(path.relative_to(folder).as_posix())
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            entries.append((FileEntry(rel, digest, path.stat().st_size), path))
    if not entries:
        raise OtaError(f"{folder} holds no files")
    return sorted(entries, key=lambda e: e[0].path)


def version_folder(model_dir: Path, version: int) -> Path:
    """``model_dir/<version>``; OtaError naming whichever of the two is missing."""
    if not model_dir.is_dir():
        raise OtaError(f"{model_dir}: no such model folder (expected <model>/<version>/)")
    version_dir = model_dir / str(version)
    if not version_dir.is_dir():
        raise OtaError(f"{version_dir} is not a folder: expected <model>/<version>/")
    return version_dir


def build(
    model_dir: Path,
    version: int,
    out: Path,
    min_appliance_version: str = "0.1.0",
    platforms: tuple[str, ...] = ("x86_64", "aarch64"),
    devices: tuple[str, ...] = ("cpu",),
    memory_bytes: int = 0,
    self_test: list[dict[str, Any]] | None = None,
    shadow: dict[str, Any] | None = None,
    seal_to: tuple[str, ...] = (),
) -> Manifest:
    """Bundle ``model_dir/<version>`` and the model's config into ``out``.
    ``shadow``: a shadow probation policy (:mod:`appliance.ota.shadow`); ``seal_to``: public
    key lines the model files are sealed to (:mod:`appliance.ota.sealing`; the bundle is then
    not reproducible: each build draws a new content key)."""
    name = check_name(model_dir.name, "model name")
    version_dir = version_folder(model_dir, version)
    config_name, config_data, where = _config_file(model_dir, version_dir)
    parsed = release.read_config(name, config_name, config_data, where)
    plain = _entries(version_dir)
    backend = release.backend_of(parsed, [e.path for e, _ in plain])
    with tempfile.TemporaryDirectory(prefix="appliance-seal-") as tmp:
        sealed_to: tuple[str, ...] = ()
        entries = plain
        if seal_to:
            from appliance.ota import sealing  # the fleet side of sealing only

            sealed_to = sealing.seal_version(version_dir, Path(tmp), backend, seal_to)
            entries = _entries(Path(tmp))
        manifest = Manifest(
            name,
            version,
            backend,
            config_name,
            tuple(e for e, _ in entries),
            min_appliance_version,
            platforms,
            devices,
            memory_bytes or sum(e.size for e, _ in plain),
            tuple(self_test or ()),
            shadow,
            sealed_to,
        )
        manifest = parse(manifest.dumps())  # what devices will check, checked here first
        release.check_bundle(manifest, config_data)
        tmp_out = out.with_name(f".{out.name}.tmp")
        with writer(tmp_out, manifest.dumps(), config_name, config_data) as add:
            for entry, path in entries:
                with open(path, "rb") as content:
                    add(entry, content)
        os.replace(tmp_out, out)
    return manifest


def _config_file(model_dir: Path, version_dir: Path) -> tuple[str, bytes, str]:
    """The config the bundle ships (its file name, bytes, where it came from): the
    folder's config file, or for a folder without one, the config the server would
    complete from the model file (as Triton's config.pbtxt), so that the device serves
    exactly what was tested here."""
    configs = [model_dir / n for n in CONFIG_FILES if (model_dir / n).is_file()]
    if len(configs) > 1:
        raise OtaError(f"{model_dir}: found {' and '.join(p.name for p in configs)}: "
                       "keep exactly one config file")  # fmt: skip
    if configs:
        config = configs[0]
        name = "config.pbtxt" if config.suffix == ".pbtxt" else "config.yaml"
        return name, config.read_bytes(), str(config)
    from appliance.config.model_config import ModelConfig
    from appliance.config.server_config import ServerConfig
    from appliance.config.triton_config import dict_to_pbtxt, to_triton_json
    from appliance.core.loader import completed_config
    from appliance.errors import ApplianceError

    bare = ModelConfig(name=model_dir.name, source=str(model_dir))
    try:
        completed = completed_config(bare, version_dir, ServerConfig())
    except ApplianceError as exc:
        raise OtaError(f"{model_dir} has no config file and cannot be completed: {exc}") from None
    text = dict_to_pbtxt(to_triton_json(completed))
    model_file = f"{version_dir.name}/{completed.default_model_filename}"
    where = f"{model_dir}/config.pbtxt (completed from {model_file})"
    return "config.pbtxt", text.encode(), where


@contextlib.contextmanager
def writer(
    out: Path, manifest: bytes, config_name: str, config: bytes
) -> Iterator[Callable[[FileEntry, IO[bytes]], None]]:
    """Write a bundle to ``out``: the manifest and config, then each model file the
    caller adds (``add(entry, content)``, in the manifest's order), reproducibly."""
    with (
        open(out, "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        tar.addfile(_member("manifest.json", len(manifest)), io.BytesIO(manifest))
        tar.addfile(_member(config_name, len(config)), io.BytesIO(config))

        def add(entry: FileEntry, content: IO[bytes]) -> None:
            tar.addfile(_member(MODEL_PREFIX + entry.path, entry.size), content)

        yield add


def _check_member(info: tarfile.TarInfo) -> str:
    if not info.isreg():
        kind = "link" if info.issym() or info.islnk() else "device/special file or folder"
        raise OtaError(f"bundle member {info.name!r} is a {kind}: only regular files allowed")
    return safe_path(info.name)


class _HeaderTooLarge(tarfile.TarError):
    pass


class _BoundedInfo(tarfile.TarInfo):
    """A member header whose extended parts (GNU long names and links, PAX headers)
    are refused beyond :data:`MAX_HEADER_BYTES` before tarfile reads them: their
    declared size would otherwise be read into memory whole."""

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _EXTENDED and self.size > MAX_HEADER_BYTES:
            raise _HeaderTooLarge(
                f"a member header declares {self.size} bytes of extended header "
                f"(GNU long name or PAX), above the limit of {MAX_HEADER_BYTES}"
            )
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise _HeaderTooLarge("a member is a GNU sparse file: only regular files allowed")
        member: tarfile.TarInfo = super()._proc_member(tar)  # type: ignore[misc]
        return member


def _members(fileobj: IO[bytes], max_bytes: int) -> Iterator[tuple[tarfile.TarInfo, IO[bytes]]]:
    """Stream the archive's members (no seeking, so a member cannot be read twice);
    OtaError for anything malformed."""
    try:
        with tarfile.open(fileobj=fileobj, mode="r|gz", tarinfo=_BoundedInfo) as tar:
            total = 0
            for info in tar:
                total += info.size
                if total > max_bytes:
                    raise OtaError(f"bundle holds more than {max_bytes} bytes (limit)")
                reader = tar.extractfile(info) if info.isreg() else None
                yield info, reader if reader is not None else io.BytesIO()
    except _HeaderTooLarge as exc:
        raise OtaError(f"bundle refused: {exc}") from None
    except (tarfile.TarError, EOFError, OSError, gzip.BadGzipFile, zlib.error) as exc:
        raise OtaError(f"bundle is not a valid gzip tar archive: {exc}") from None


def _read_manifest(info: tarfile.TarInfo, reader: IO[bytes]) -> Manifest:
    if info.name != "manifest.json":
        raise OtaError("bundle: the first member must be manifest.json")
    _check_member(info)
    if info.size > MAX_MANIFEST_BYTES:
        raise OtaError("bundle: manifest.json is larger than 1 MiB")
    return parse(reader.read())


def _walk(path: Path, max_bytes: int, sink: Path | None) -> tuple[Manifest, bytes]:
    """Check every member against the manifest; write the files below ``sink`` when
    given. Returns the manifest and the config file's bytes."""
    manifest: Manifest | None = None
    config = b""
    seen: set[str] = set()
    with open(path, "rb") as f:
        for info, reader in _members(f, max_bytes):
            if manifest is None:
                manifest = _read_manifest(info, reader)
                expected = {MODEL_PREFIX + e.path: e for e in manifest.files}
                continue
            name = _check_member(info)
            if name in seen:
                raise OtaError(f"bundle member {name!r} appears twice")
            seen.add(name)
            if name == manifest.config_file:
                if info.size > MAX_MANIFEST_BYTES:
                    raise OtaError(f"bundle: {name} is larger than 1 MiB")
                config = reader.read()
                continue
            entry = expected.get(name)
            if entry is None:
                raise OtaError(f"bundle member {name!r} is not listed in the manifest")
            if info.size != entry.size:
                raise OtaError(
                    f"bundle member {name!r}: {info.size} bytes, the manifest says {entry.size}"
                )
            _copy_verified(reader, entry, sink / entry.path if sink else None)
    if manifest is None:
        raise OtaError("bundle is empty")
    missing = sorted(set(expected) - seen)
    if missing:
        raise OtaError(f"bundle lacks member(s) the manifest lists: {missing}")
    if not config:
        raise OtaError(f"bundle lacks its config file {manifest.config_file}")
    return manifest, config


def _copy_verified(reader: IO[bytes], entry: FileEntry, dest: Path | None) -> None:
    digest = hashlib.sha256()
    out = None
    if dest is not None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        out = os.fdopen(os.open(dest, flags, 0o644), "wb")
    try:
        remaining = entry.size
        while remaining:
            chunk = reader.read(min(_CHUNK, remaining))
            if not chunk:
                raise OtaError(f"bundle member {entry.path!r} is truncated")
            remaining -= len(chunk)
            digest.update(chunk)
            if out is not None:
                out.write(chunk)
        if out is not None:
            out.flush()
            os.fsync(out.fileno())
    finally:
        if out is not None:
            out.close()
    if digest.hexdigest() != entry.sha256:
        raise OtaError(f"bundle member {entry.path!r}: sha256 does not match the manifest")


def inspect(path: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> Manifest:
    """The manifest, after checking every member against it (reading at most
    ``max_bytes`` of content). Writes and runs nothing."""
    return _walk(path, max_bytes, None)[0]


def read(path: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[Manifest, bytes]:
    """:func:`inspect`, and the config file's bytes."""
    return _walk(path, max_bytes, None)


def first_manifest(path: Path) -> Manifest:
    """The manifest alone (the first member), of a bundle verified before."""
    with open(path, "rb") as f:
        for info, reader in _members(f, MAX_MANIFEST_BYTES):
            return _read_manifest(info, reader)
    raise OtaError("bundle is empty")


def extract(path: Path, staging: Path, max_bytes: int) -> tuple[Manifest, bytes]:
    """Extract the model files into ``staging`` (which must not exist yet); returns the
    manifest and the config bytes. On any refusal the staging folder is removed."""
    staging.mkdir(parents=True)
    try:
        return _walk(path, max_bytes, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def machine() -> str:
    """This machine's platform name as manifests spell it."""
    arch = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(arch, arch)


def describe(manifest: Manifest) -> str:
    """A human-readable summary for ``appliance bundle inspect``."""
    return json.dumps(manifest.to_json(), indent=2)
