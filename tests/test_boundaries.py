"""Package boundaries, checked on the source (AST), next to ``lint-imports``.

1. The import direction between the four packages (what the import-linter contracts in
   pyproject.toml say, checked here too so a plain ``pytest`` run catches it):
   ``ctxmem`` imports neither ``ctxmem_dpu`` nor ``ctxmem_tools``; ``ctxmem_common``
   imports none of the others; ``ctxmem_dpu`` imports neither ``ctxmem`` nor the tools;
   ``ctxmem_dpu.transport`` and ``ctxmem_dpu.pod`` use the store only through its package
   (``from ctxmem_dpu.store import BlockStore``), never one of its private modules.
2. No module uses a private name (``_x``) of a module in another package or subpackage:
   ``from pkg.mod import _x``, ``import pkg.mod as m; m._x``, ``from pkg import mod;
   mod._x``. Inside one package (modules that are siblings) privates may be shared: the
   package is the unit that hides them. The allow-list below names every exception.

Both checks are shown to fail on synthetic sources (the ``*_is_caught`` tests).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = {
    "shared": "ctxmem_common", "dpu": "ctxmem_dpu", "host": "ctxmem", "tools": "ctxmem_tools",
}
FIRST_PARTY = set(SOURCE_ROOTS.values())

# Top-level package -> the first-party packages it must not import.
FORBIDDEN: dict[str, set[str]] = {
    "ctxmem": {"ctxmem_dpu", "ctxmem_tools"},
    "ctxmem_common": {"ctxmem", "ctxmem_dpu", "ctxmem_tools"},
    "ctxmem_dpu": {"ctxmem", "ctxmem_tools"},
    "ctxmem_tools": {"ctxmem_dpu"},  # the tools run the service as a program only
}

# Subpackage -> the package whose modules it may only reach through the package itself.
PRIVATE_MODULES_OF: dict[str, str] = {
    "ctxmem_dpu.transport": "ctxmem_dpu.store",
    "ctxmem_dpu.pod": "ctxmem_dpu.store",
}

# (importing module, "target.module:_name") pairs allowed to cross a package boundary.
# Each entry says why it must stay; the aim is an empty list.
ALLOWED_PRIVATE: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: {self.what}"


def _modules() -> Iterator[tuple[str, Path]]:
    for root, package in SOURCE_ROOTS.items():
        for path in sorted((ROOT / root / package).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            rel = path.relative_to(ROOT / root).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join(parts), path


def _package_of(module: str, is_package: bool) -> str:
    """The package a module belongs to (a package's ``__init__`` belongs to itself)."""
    return module if is_package else module.rpartition(".")[0]


MODULES: dict[str, bool] = {m: p.name == "__init__.py" for m, p in _modules()}  # -> is package


def _owner_package(target: str) -> str:
    """The package owning ``target`` (``pkg.mod`` or ``pkg.mod.Class...``): the package of
    the longest prefix that is a module of the project."""
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in MODULES:
            return _package_of(prefix, MODULES[prefix])
    return target.rpartition(".")[0]


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _package_of(module, is_package).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def check_source(module: str, source: str, *, is_package: bool = False) -> list[Violation]:
    """Every boundary violation in ``source``, the text of module ``module``."""
    tree = ast.parse(source)
    top = module.split(".")[0]
    out: list[Violation] = []
    aliases: dict[str, str] = {}  # local name -> first-party module it refers to

    sealed = [pkg for src, pkg in PRIVATE_MODULES_OF.items()
              if module == src or module.startswith(src + ".")]

    def forbidden(target: str, line: int) -> None:
        if target.split(".")[0] in FORBIDDEN.get(top, set()):
            out.append(Violation(module, line, f"{top} must not import {target}"))
        for pkg in sealed:
            if target.startswith(pkg + "."):
                out.append(Violation(module, line, f"{module} must not import {target}, "
                                                   f"private to {pkg}"))

    def private(target_module: str, name: str, line: int) -> None:
        if not name.startswith("_") or name.startswith("__"):
            return
        if _owner_package(target_module) == _package_of(module, is_package):
            return  # siblings in one package (or a package and its own modules)
        if (module, f"{target_module}:{name}") in ALLOWED_PRIVATE:
            return
        out.append(Violation(module, line, f"uses private {target_module}.{name}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in FIRST_PARTY:
                    forbidden(a.name, node.lineno)
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        aliases[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node)
            if target.split(".")[0] not in FIRST_PARTY:
                continue
            forbidden(target, node.lineno)
            for a in node.names:
                private(target, a.name, node.lineno)
                if f"{target}.{a.name}" in MODULES:  # ``from pkg import mod``
                    forbidden(f"{target}.{a.name}", node.lineno)
                # ``from pkg import mod`` binds a module; ``from mod import name`` a name.
                aliases[a.asname or a.name] = f"{target}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            chain: list[str] = []
            base: ast.expr = node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                target = ".".join([aliases[base.id], *reversed(chain)])
                private(target, node.attr, node.lineno)
    return out


def test_no_package_boundary_is_crossed() -> None:
    problems: list[Violation] = []
    for module, path in _modules():
        problems += check_source(module, path.read_text(), is_package=path.name == "__init__.py")
    assert not problems, "\n".join(map(str, problems))


def test_allow_list_has_no_stale_entries() -> None:
    """An allowed reach that no longer happens must leave the list."""
    used: set[tuple[str, str]] = set()
    saved = set(ALLOWED_PRIVATE)
    ALLOWED_PRIVATE.clear()
    try:
        for module, path in _modules():
            for v in check_source(module, path.read_text(), is_package=path.name == "__init__.py"):
                if v.what.startswith("uses private "):
                    target = v.what.removeprefix("uses private ")
                    mod, _, name = target.rpartition(".")
                    used.add((module, f"{mod}:{name}"))
    finally:
        ALLOWED_PRIVATE.update(saved)
    assert saved <= used, f"stale allow-list entries: {sorted(saved - used)}"


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("ctxmem.client", "import ctxmem_dpu.store\n", "ctxmem must not import ctxmem_dpu.store"),
        ("ctxmem.client", "from ctxmem_tools import chaos\n", "must not import ctxmem_tools"),
        ("ctxmem_common.keys", "from ctxmem.client import Client\n", "must not import ctxmem"),
        ("ctxmem_dpu.app", "import ctxmem\n", "ctxmem_dpu must not import ctxmem"),
        ("ctxmem_tools.demo", "from ctxmem_dpu.store import BlockStore\n", "must not import"),
        ("ctxmem_tools.chaos.driver", "from ctxmem.client import _Session\n",
         "uses private ctxmem.client._Session"),
        ("ctxmem_tools.chaos.driver",
         "from ctxmem import client as c\ndef f(x):\n    return c._rpc_error(x)\n",
         "uses private ctxmem.client._rpc_error"),
        ("ctxmem_tools.demo", "import ctxmem.kvtransfer as kt\nkt._stage((1,), None, False)\n",
         "uses private ctxmem.kvtransfer._stage"),
        ("ctxmem_dpu.app", "import ctxmem_dpu.tiers.flash\nctxmem_dpu.tiers.flash._x = 1\n",
         "uses private ctxmem_dpu.tiers.flash._x"),
        ("ctxmem_dpu.tiers.flash", "from ..store import _Block\n",
         "uses private ctxmem_dpu.store._Block"),
        ("ctxmem_dpu.transport.shm", "from ctxmem_dpu.store.room import Room\n",
         "must not import ctxmem_dpu.store.room, private to ctxmem_dpu.store"),
        ("ctxmem_dpu.pod.shared_flash", "from ctxmem_dpu.store import quotas\n",
         "must not import ctxmem_dpu.store.quotas, private to ctxmem_dpu.store"),
        ("ctxmem_dpu.pod.node", "import ctxmem_dpu.store.sessions as s\n",
         "must not import ctxmem_dpu.store.sessions, private to ctxmem_dpu.store"),
    ],
)
def test_a_violation_is_caught(module: str, source: str, expected: str) -> None:
    problems = check_source(module, source)
    assert any(expected in str(p) for p in problems), problems


@pytest.mark.parametrize(
    ("module", "source"),
    [
        # siblings in one package share privates
        ("ctxmem.namespace", "from ctxmem.client import _Session\n"),
        ("ctxmem_tools.chaos.campaign", "from . import driver\ndriver._x\n"),
        # a package's __init__ and its own modules
        ("ctxmem_tools.chaos", "from ctxmem_tools.chaos.driver import _y\n"),
        # dunders and public names are fine; so is anything of a third-party module
        ("ctxmem_tools.demo", "import ctxmem\nprint(ctxmem.__version__)\nimport os\nos._exit(0)\n"),
        # the store's package (its facade) is open to the transports and the pod
        ("ctxmem_dpu.pod.node", "from ctxmem_dpu.store import BlockStore, COUNTERS\n"),
        ("ctxmem_dpu.app", "from ctxmem_dpu.store.room import Room\n"),
        # private attributes of objects (not modules) are the object's business
        ("ctxmem_tools.demo", "from ctxmem.client import Client\nClient()._lock\n"),
    ],
)
def test_allowed_uses_are_not_flagged(module: str, source: str) -> None:
    is_package = module == "ctxmem_tools.chaos"
    assert check_source(module, source, is_package=is_package) == []
