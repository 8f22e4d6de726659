"""The machinery behind the config schema: YAML values built into typed, frozen
dataclasses, strictly (an unknown key, a wrong type or an invalid value is a
:class:`ConfigError` naming the full key path), and the reference table generated from
those dataclasses (``docs/config.md``). The schema itself, the dataclasses and their
cross-field rules, is :mod:`ctxmem_common.config`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, get_args, get_origin

from ctxmem_common.cpuset import CpuList, parse_cpulist
from ctxmem_common.device_settings import (
    KernelOptions,
    SpdkOptions,
    parse_kernel_options,
    parse_spdk_options,
)
from ctxmem_common.errors import ConfigError
from ctxmem_common.units import parse_size

__all__ = ["Size", "build", "reference_rows"]

Size = typing.NewType("Size", int)


def _type_name(tp: Any) -> str:
    if tp is Size:
        return "size (e.g. '64MiB')"
    return getattr(tp, "__name__", str(tp))


# Types whose schema is richer than their fields' types (cross-field rules, patterns):
# built by their own validators, whose ValueErrors name the key path.
_PARSERS: dict[Any, Any] = {
    KernelOptions: parse_kernel_options,
    SpdkOptions: parse_spdk_options,
    CpuList: parse_cpulist,
}


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = get_origin(tp)
    parser = _PARSERS.get(tp)
    if parser is not None:
        try:
            return parser(value, where)
        except ConfigError:
            raise
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if tp is Size:
        try:
            return Size(parse_size(value, where))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if origin is Literal:
        allowed = list(get_args(tp))
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not one of {allowed}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        (item_tp,) = get_args(tp)
        return [_convert(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        _key_tp, val_tp = get_args(tp)
        return {k: _convert(val_tp, v, f"{where}.{k}") for k, v in value.items()}
    if origin in (types.UnionType, typing.Union):
        args = [a for a in get_args(tp) if a is not type(None)]
        if value is None or len(args) != 1:
            return value
        return _convert(args[0], value, where)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where)  # type: ignore[arg-type]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {_type_name(tp)}")  # pragma: no cover


def build(cls: type[Any], raw: Any, where: str) -> Any:
    """``raw`` (parsed YAML) as a ``cls`` dataclass, every field converted to its declared
    type; ``where`` is the key path for error messages (``""`` at the top)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"{prefix}{unknown[0]}: unknown key; allowed keys here are {sorted(fields)}"
        )
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        path = f"{where}.{name}" if where else name
        if name in raw:
            kwargs[name] = _convert(hints[name], raw[name], path)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{path}: required key is missing")
    return cls(**kwargs)


def _type_label(tp: Any) -> str:
    if tp is Size:
        return "size"
    if tp is CpuList:
        return "CPU list ([1, 3] or '2-3,6')"
    typed = [t for t in _PARSERS if t in get_args(tp)]
    if typed:
        return f"mapping ({typed[0].__name__}, see docs/storage.md)"
    if isinstance(tp, type):
        return tp.__name__
    return (str(tp).replace("typing.", "").replace("ctxmem_common.config.", "")
            .replace("ctxmem_common.config_s3.", ""))


def reference_rows(cls: type[Any], prefix: str) -> list[str]:
    """Markdown table rows (key, type, default) for every field of ``cls``, nested
    dataclasses flattened under ``prefix``."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows += reference_rows(tp, f"{prefix}{f.name}.")  # type: ignore[arg-type]
            continue
        if "doc_default" in f.metadata:
            default = f.metadata["doc_default"]
        elif f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "(required)"
        rows.append(f"| `{prefix}{f.name}` | {_type_label(tp)} | `{default}` |")
    return rows
