"""No test passes by not raising: every test function of the suite checks something: an
``assert``, ``pytest.raises``/``warns``/``fail`` or ``pytest.skip`` (saying why) in its own
body, or a call to a helper of the suite that does (one level: a function defined in
``tests/`` whose body holds one of those). A test whose body only calls the code under
test, with nothing to say what it should have done, fails here naming it (issue 31)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CHECKS = ("raises", "warns", "fail", "skip", "importorskip")


def _checks_itself(fn: ast.AST) -> bool:
    for n in ast.walk(fn):
        if isinstance(n, ast.Assert):
            return True
        if isinstance(n, ast.Raise) and n.exc is not None and "AssertionError" in \
                ast.unparse(n.exc):
            return True
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and \
                n.value.id == "pytest" and n.attr in CHECKS:
            return True
    return False


def _called(fn: ast.AST) -> set[str]:
    """Names a function calls (the last part of a dotted name), passes on (a callable
    handed to a helper), or uses as a decorator."""
    out: set[str] = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
    return out


def _functions() -> dict[Path, list[ast.FunctionDef | ast.AsyncFunctionDef]]:
    out = {}
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        out[path] = [n for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return out


def test_every_test_function_checks_something() -> None:
    functions = _functions()
    checking = {f.name for fns in functions.values() for f in fns if _checks_itself(f)}
    # Checking helpers may call further helpers: close the set over calls (a fixed point).
    helpers = {f.name: f for fns in functions.values() for f in fns
               if not f.name.startswith("test")}
    grew = True
    while grew:
        grew = False
        for name, f in helpers.items():
            if name not in checking and _called(f) & checking:
                checking.add(name)
                grew = True
    silent = [f"{path.relative_to(TESTS.parent)}:{f.lineno} {f.name}"
              for path, fns in functions.items() for f in fns
              if f.name.startswith("test_") and path.name.startswith("test_")
              and not _checks_itself(f) and not _called(f) & checking]
    assert silent == [], (
        "tests that check nothing (they pass as long as nothing raises): assert what the "
        "call should have done, or use pytest.raises:\n" + "\n".join(silent))


def test_a_silent_test_is_found() -> None:
    src = ("def helper(x):\n    assert x\n"
           "def test_calls_only(svc):\n    svc.put(1)\n"
           "def test_via_helper():\n    helper(1)\n")
    tree = ast.parse(src)
    fns = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    checking = {n for n, f in fns.items() if _checks_itself(f)}
    assert checking == {"helper"}
    assert [n for n, f in fns.items() if n.startswith("test_")
            and not _called(f) & checking] == ["test_calls_only"]
