"""From a TOML/YAML file and dotted overrides to validated config sections: the trainer's and `harts rl`'s.

    doc = read_config_file("examples/train_tiny_fsdp.toml")          # {section: {field: value}}
    doc = with_overrides(doc, {"objective.clip_high": "0.28"})       # dotted fields, strings coerced
    cfg = config_from_dict(doc, where="--config examples/train_tiny_fsdp.toml")   # TrainerConfig
    kw = sections_from_dict(doc, {"run": RunSection, ...})           # the one loader of both

Values are coerced to the field types (`"0.28"` -> 0.28, `"a,b"` -> a list, `"none"` -> None,
`"on"` -> True), so a file and a command line give the same config. Errors are `ConfigError`s
naming the dotted field; unknown sections and fields are errors (docs/design/training-loop.md).
"""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path

from trainer.config.schema import SECTIONS, ConfigError, TrainerConfig

__all__ = ["read_config_file", "with_overrides", "config_from_dict", "sections_from_dict", "to_dict"]


def read_config_file(path: str | Path) -> dict:
    """The nested dict of a .toml, .yaml or .yml file.

    Raises:
        ConfigError: missing file, another extension, a parse error, not a table at the top.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: expected a TOML or YAML file, got no such file")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            import tomllib

            doc = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            doc = yaml.safe_load(text) or {}
        else:
            raise ConfigError(f"--config {path}: expected a .toml, .yaml or .yml file, got {path.suffix or 'no extension'!r}")
    except ConfigError:
        raise
    except Exception as exc:  # tomllib.TOMLDecodeError, yaml.YAMLError
        raise ConfigError(f"--config {path}: expected valid {path.suffix[1:].upper()}, got {type(exc).__name__}: "
                          f"{' '.join(str(exc).split())}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"--config {path}: expected a table of sections at the top, got {type(doc).__name__}")
    return doc


def with_overrides(doc: dict, overrides: dict[str, object]) -> dict:
    """A copy of `doc` with `{"section.field": value}` set (later sources win)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in doc.items()}
    for dest, value in overrides.items():
        section, name = dest.split(".", 1)
        if not isinstance(out.setdefault(section, {}), dict):
            raise ConfigError(f"config: {section}: expected a table of fields, got {type(out[section]).__name__}")
        out[section][name] = value
    return out


def config_from_dict(doc: dict, *, where: str = "config") -> TrainerConfig:
    """Build from a nested dict ({section: {field: value}}); values are coerced to the field types.

    Raises:
        ConfigError: an unknown section or field, a value of the wrong type, a failed validation.
    """
    return TrainerConfig(**sections_from_dict(doc, SECTIONS, where=where))


def sections_from_dict(doc: dict, sections: dict[str, type], *, where: str = "config") -> dict:
    """Section name -> its dataclass built from `doc`'s table of that name (the sections `doc` has;
    values coerced to the field types): the one loader of the trainer's and `harts rl`'s files.

    Raises:
        ConfigError: an unknown section or field, a value of the wrong type, a failed validation.
    """
    kw = {}
    for name, value in doc.items():
        if name not in sections:
            raise ConfigError(f"{where}: unknown section {name!r}; expected one of {', '.join(sections)}")
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {name}: expected a table of fields, got {type(value).__name__}")
        kw[name] = _build(sections[name], value, name, where)
    return kw


def to_dict(cfg) -> dict:
    """A config (or section) as plain nested dicts and lists, e.g. for harts.json and the metrics."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = to_dict(v) if dataclasses.is_dataclass(v) else (list(v) if isinstance(v, (list, tuple)) else v)
    return out


def _coerce(value, hint, name: str):
    """`value` (from a file or the command line) as the field type `hint`; ValueError if it is not one."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], name)
    if origin in (list, tuple):
        elem = args[0] if args else str
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"expected a list, got {value!r}")
        return [_coerce(v, elem, name) for v in value]
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"expected a table, got {value!r}")
        return dict(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ValueError(f"expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"expected an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"expected an integer, got {value!r}") from None
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"expected a number, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"expected a number, got {value!r}") from None
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ValueError(f"expected a string, got {value!r}")
        return str(value)
    raise AssertionError(f"{name}: unsupported field type {hint}")


def _build(cls: type, values: dict, section: str, where: str):
    hints = typing.get_type_hints(cls)
    kw = {}
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"{where}: unknown field {section}.{key}; expected one of {', '.join(hints)}")
        try:
            kw[key] = _coerce(value, hints[key], f"{section}.{key}")
        except ValueError as exc:
            raise ConfigError(f"{where}: {section}.{key}: {exc}") from None
    try:
        return cls(**kw)
    except ValueError as exc:
        raise ConfigError(f"{section}.{exc}") from None
