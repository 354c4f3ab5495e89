"""Reading a model's config from its folder: ``config.yaml`` (or ``.yml``) or Triton's
``config.pbtxt``, into the one validator of :mod:`appliance.config.model_config`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from appliance.config.fields import ConfigError
from appliance.config.model_config import ModelConfig, parse_model_config
from appliance.config.triton_config import pbtxt_to_dict

CONFIG_FILES = ("config.yaml", "config.yml", "config.pbtxt")


def load_model_config(model_dir: Path) -> ModelConfig:
    """Read ``model_dir/config.yaml`` (or .yml) or Triton's ``config.pbtxt``; no file
    means everything is auto-completed. Two config files are an error: which one
    counts would be a guess."""
    found = [model_dir / n for n in CONFIG_FILES if (model_dir / n).is_file()]
    if len(found) > 1:
        raise ConfigError(
            str(model_dir),
            "",
            f"found {' and '.join(p.name for p in found)}: keep exactly one config file",
        )
    if not found:
        return ModelConfig(name=model_dir.name, source=str(model_dir))
    path = found[0]
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), "", f"not UTF-8 text: {exc}") from None
    except OSError as exc:
        raise ConfigError(str(path), "", f"cannot read: {exc.strerror}") from None
    return with_labels(parse_config_text(text, path.name, model_dir.name, str(path)), model_dir)


def parse_config_text(text: str, filename: str, model: str, source: str) -> ModelConfig:
    """Validate the text of a model's config file (``filename`` says its form: YAML, or
    Triton's pbtxt). The one reading of a config: the server's, and the OTA tools'
    for a bundle's config before it is built, published or installed. ConfigError for
    anything wrong, including YAML nested beyond Python's recursion limit."""
    try:
        if filename.endswith(".pbtxt"):
            return parse_model_config(pbtxt_to_dict(text, source), model, source)
        import yaml  # loaded only when a model's config is YAML

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(source, "", f"not valid YAML: {exc}") from None
        return parse_model_config(data, model, source)
    except RecursionError:
        raise ConfigError(source, "", "nested too deeply to be a model config") from None


_MAX_LABELS_BYTES = 16 * 2**20


def with_labels(config: ModelConfig, model_dir: Path) -> ModelConfig:
    """Read each output's ``label_filename`` (one label a line) from the model folder."""
    outputs = []
    for t in config.outputs:
        if t.label_filename:
            path = model_dir / t.label_filename
            where = f"output '{t.name}'.label_filename"
            try:
                if path.is_symlink() or path.stat().st_size > _MAX_LABELS_BYTES:
                    raise ConfigError(config.source, where, "expected a regular file under 16 MiB")
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(config.source, where, f"cannot read {path}: {exc}") from None
            t = replace(t, labels=tuple(text.splitlines()))
        outputs.append(t)
    return replace(config, outputs=tuple(outputs))
