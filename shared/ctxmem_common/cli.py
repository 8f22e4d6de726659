"""The ``ctxmem`` command: a dispatcher over subcommands registered as entry points.

Subcommands live with the code they drive (``serve`` in the service, ``demo`` and
``bench`` in the shim) and are found through the ``ctxmem.commands`` entry-point group,
so this package imports neither side. Each entry point is ``f(argv: list[str]) -> int``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib.metadata import entry_points

Command = Callable[[list[str]], int]


def _commands() -> dict[str, Callable[[], Command]]:
    """Name -> loader; a command's module is imported only when that command runs."""
    return {ep.name: ep.load for ep in entry_points(group="ctxmem.commands")}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    commands = _commands()
    if not args or args[0] in ("-h", "--help"):
        names = ", ".join(sorted(commands)) or "(none installed: pip install -e .)"
        print(f"usage: ctxmem COMMAND [ARGS...]\ncommands: {names}\n"
              "run 'ctxmem COMMAND --help' for a command's options")
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in commands:
        print(f"ctxmem: unknown command {name!r}; commands: {', '.join(sorted(commands))}",
              file=sys.stderr)
        return 2
    command = commands[name]()
    return int(command(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
