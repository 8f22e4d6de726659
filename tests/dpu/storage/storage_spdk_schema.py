"""Validate JSON-RPC requests against SPDK's own schema (schema/schema.yaml in SPDK).

The schema is read at test time from `<repo>/../shared/vendor/spdk/schema.yaml` (SPDK
commit 3230130e, 26.09 development line); it is reference data and is not copied into
this repository. Its structure: top-level `enums`, `objects`, `arrays`, `bitmasks`,
`methods`; each method has `params`, each param a `name`, `type`, optional `required`,
`class` (for enum/object/array/bitmask types) and `deprecated`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[3]
SCHEMA_PATH = REPO_ROOT.parent / "shared" / "vendor" / "spdk" / "schema.yaml"

_INT_RANGES = {
    "uint8": (0, 2**8 - 1), "uint16": (0, 2**16 - 1), "uint32": (0, 2**32 - 1),
    "uint64": (0, 2**64 - 1), "int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1),
}
_UUID_RE = re.compile(r"^[0-9a-fA-F]{8}-([0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}$")


class SpdkSchema:
    def __init__(self, path: Path = SCHEMA_PATH) -> None:
        data = yaml.safe_load(path.read_text())
        self.methods: dict[str, dict[str, Any]] = {m["name"]: m for m in data["methods"]}
        self.objects: dict[str, list[dict[str, Any]]] = {
            o["name"]: o.get("fields") or [] for o in data.get("objects") or []}
        self.enums: dict[str, set[str]] = {
            e["name"]: {f["name"] for f in e.get("fields") or []} for e in data.get("enums") or []}
        self.arrays: dict[str, dict[str, Any]] = {a["name"]: a for a in data.get("arrays") or []}
        self.bitmasks: dict[str, dict[str, Any]] = {
            b["name"]: b for b in data.get("bitmasks") or []}

    def problems(self, method: str, params: dict[str, Any] | None) -> list[str]:
        """Everything wrong with one request; empty when it matches the schema."""
        spec = self.methods.get(method)
        if spec is None:
            return [f"{method}: no such method in SPDK's schema"]
        return self._fields(method, spec.get("params") or [], params or {})

    def _fields(self, where: str, fields: list[dict[str, Any]],
                values: dict[str, Any]) -> list[str]:
        out: list[str] = []
        by_name = {f["name"]: f for f in fields}
        for name in values:
            if name not in by_name:
                out.append(f"{where}.{name}: unknown parameter (known: {sorted(by_name)})")
        for name, f in by_name.items():
            if f.get("required") and name not in values:
                out.append(f"{where}.{name}: required parameter missing")
            if name in values:
                if f.get("deprecated"):
                    out.append(f"{where}.{name}: parameter is deprecated in SPDK")
                out.extend(self._type(f"{where}.{name}", f, values[name]))
        return out

    def _type(self, where: str, f: dict[str, Any], value: Any) -> list[str]:
        kind, cls = f.get("type") or f.get("item_type"), f.get("class")
        if kind == "string":
            return [] if isinstance(value, str) else [f"{where}: expected string, got {value!r}"]
        if kind == "boolean":
            return [] if isinstance(value, bool) else [f"{where}: expected boolean, got {value!r}"]
        if kind in _INT_RANGES:
            low, high = _INT_RANGES[kind]
            ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
            return [] if ok else [f"{where}: expected {kind}, got {value!r}"]
        if kind == "uuid":
            ok = isinstance(value, str) and _UUID_RE.match(value) is not None
            return [] if ok else [f"{where}: expected uuid, got {value!r}"]
        if kind == "enum":
            names = self.enums.get(cls or "")
            if names is None:
                return [f"{where}: schema enum class {cls!r} not found"]
            if value in names:
                return []
            return [f"{where}: {value!r} not in enum {cls} {sorted(names)}"]
        if kind == "object":
            if cls not in self.objects:
                return [f"{where}: schema object class {cls!r} not found"]
            if not isinstance(value, dict):
                return [f"{where}: expected object {cls}, got {value!r}"]
            return self._fields(where, self.objects[cls], value)
        if kind == "array":
            array = self.arrays.get(cls or "")
            if array is None:
                return [f"{where}: schema array class {cls!r} not found"]
            if not isinstance(value, list) or len(value) > array.get("max_count", len(value)):
                return [f"{where}: expected array {cls} (max {array.get('max_count')})"]
            return [p for i, item in enumerate(value)
                    for p in self._type(f"{where}[{i}]", array, item)]
        if kind == "bitmask":
            mask = self.bitmasks.get(cls or "")
            if mask is None:
                return [f"{where}: schema bitmask class {cls!r} not found"]
            names = self.enums.get(mask["enum"], set())
            ok = isinstance(value, list) and all(v in names for v in value)
            return [] if ok else [f"{where}: expected list of {mask['enum']} names, got {value!r}"]
        return [f"{where}: schema type {kind!r} not understood by this validator"]
