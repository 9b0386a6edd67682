"""The ``commfuse`` command.

Subcommands register themselves in ``COMMANDS``: a name, a one-line help, a
function that adds its arguments and one that runs it. Later parts of the
library (backends, bench, conformance, simulate) add theirs the same way.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from commfuse import __version__
from commfuse.errors import CommfuseError

Command = tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
COMMANDS: list[Command] = []


def command(name: str, help: str, arguments: Callable[[argparse.ArgumentParser], None]):
    def register(run: Callable[[argparse.Namespace], int]):
        COMMANDS.append((name, help, arguments, run))
        return run

    return register


# -- commfuse schedule -----------------------------------------------------


def _schedule_arguments(p: argparse.ArgumentParser) -> None:
    from commfuse.schedule import Algorithm, Collective

    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION", help="what to do")
    show = sub.add_parser("show", help="print the step table of one schedule")
    show.add_argument("collective", choices=[c.value for c in Collective],
                      help="the collective to decompose: %(choices)s")
    show.add_argument("--world-size", "-n", type=int, required=True, help="number of ranks")
    show.add_argument("--algorithm", "-a", default="ring", choices=[a.value for a in Algorithm],
                      help="ring (CommFuse's hops), bidirectional (half of each slice each way round), sliced "
                      "(whole collectives on chunks) or vanilla (one collective, then the compute); default ring")
    show.add_argument("--parts", type=int, default=1, help="slices per shard (ring algorithms; the paper's m)")
    show.add_argument("--chunks", type=int, default=1, help="collectives the data is sliced into (sliced)")
    dump = sub.add_parser("dump", help="regenerate the schedules/ catalog from the builders")
    dump.add_argument("--dir", type=Path, default=Path("schedules"), help="catalog folder (default: ./schedules)")
    dump.add_argument("--check", action="store_true", help="only report files that differ; exit 1 if any")


@command("schedule", "show schedules and regenerate the schedules/ catalog", _schedule_arguments)
def _schedule(args: argparse.Namespace) -> int:
    from commfuse.schedule import _catalog, build, render

    if args.action == "show":
        s = build(args.collective, args.world_size, algorithm=args.algorithm, parts=args.parts, chunks=args.chunks)
        sys.stdout.write(render(s))
        return 0
    if args.check:
        stale = _catalog.check(args.dir)
        for rel in stale:
            print(f"differs from the builder: {args.dir / rel}")
        print(f"{len(_catalog.files()) - len(stale)} of {len(_catalog.files())} catalog files match")
        return 1 if stale else 0
    changed = _catalog.dump(args.dir)
    print(f"wrote {len(changed)} of {len(_catalog.files())} files under {args.dir}")
    return 0


# -- commfuse backends -----------------------------------------------------


def _backends_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")


@command("backends", "list the backends found (built-in and plugins) and whether each runs here", _backends_arguments)
def _backends(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from commfuse import backends

    rows = []
    for s in backends.specs():
        avail = backends.availability(s.name)
        row = {
            "name": s.name,
            "distribution": s.distribution,
            "device_types": list(s.device_types),
            "available": avail.ok,
            "reason": avail.reason,
            "fix": avail.fix,
            "detail": avail.detail,
            "priority": s.priority,
            "description": s.description,
            "install_hint": s.install_hint,
            "capabilities": dataclasses.asdict(s.capabilities),
        }
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = [("NAME", "DISTRIBUTION", "DEVICES", "AVAILABLE", "DETAILS")]
    for r in rows:
        details = r["detail"] if r["available"] else r["reason"] + (f" (fix: {r['fix']})" if r["fix"] else "")
        table.append(
            (r["name"], r["distribution"], ",".join(r["device_types"]), "yes" if r["available"] else "no", details)
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    return 0


# -- entry point -----------------------------------------------------------

#: Modules that register further subcommands with ``@command`` when imported.
#: They must import only argparse-level things at module level (torch lazily).
COMMAND_MODULES = ("commfuse.bench.command", "commfuse.sim.command", "commfuse.testing.command")


def _load_commands() -> None:
    import importlib

    for name in COMMAND_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is None or not name.startswith(e.name):  # a missing dependency inside it is a real error
                raise


def parser() -> argparse.ArgumentParser:
    _load_commands()
    p = argparse.ArgumentParser(
        prog="commfuse",
        description="Communication-computation overlap by decomposing collectives into ring steps.",
    )
    p.add_argument("--version", action="version", version=f"commfuse {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", help="the subcommand to run (COMMAND --help for its own)")
    for name, help, arguments, run in COMMANDS:
        sp = sub.add_parser(name, help=help, description=help)
        arguments(sp)
        sp.set_defaults(run=run)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if not getattr(args, "run", None):
        p.print_help()
        return 2
    try:
        return args.run(args)
    except CommfuseError as e:
        print(f"commfuse: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
