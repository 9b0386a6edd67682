"""The ``commfuse`` command.

Subcommands register themselves in ``COMMANDS``: a name, a one-line help, a
function that adds its arguments and one that runs it. Later parts of the
library (backends, bench, conformance, simulate) add theirs the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from commfuse import __version__
from commfuse.errors import CommfuseError, CommfuseValueError

Command = tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
COMMANDS: list[Command] = []


def command(name: str, help: str, arguments: Callable[[argparse.ArgumentParser], None]):
    def register(run: Callable[[argparse.Namespace], int]):
        COMMANDS.append((name, help, arguments, run))
        return run

    return register


# -- optional dependencies -------------------------------------------------

#: The extras of ``pyproject.toml`` (``[project.optional-dependencies]``) that parts of the command need, and the
#: modules each installs that those parts import. ``pip install .`` alone gives every other subcommand.
EXTRAS = {
    "test": ("pytest",),  # the conformance suite is a pytest plugin
    "bench": ("matplotlib",),  # bench --plot's Gantt chart
}


class MissingExtraError(CommfuseError, RuntimeError):
    """A part of the command needs a package that is not installed; the message says how to install it."""


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that does not import, or a finder that refuses the name
        return False


def missing_extra(extra: str, what: str) -> str | None:
    """None when every module of ``extra`` can be imported, else the sentence that says ``what`` (``"--plot"``,
    ``"commfuse conformance"``) needs the missing ones and how to install them."""
    absent = [m for m in EXTRAS[extra] if not _importable(m)]
    if not absent:
        return None
    return (f"{what} needs {' and '.join(absent)}, which {'is' if len(absent) == 1 else 'are'} not installed: "
            f"install commfuse's {extra!r} extra with `pip install '.[{extra}]'` in a clone of the commfuse "
            f"repository (or `pip install {' '.join(absent)}`)")


def require_extra(extra: str, what: str) -> None:
    """Raise :class:`MissingExtraError` (see :func:`missing_extra`) unless ``extra`` is installed. Called where the
    arguments are read, before any work."""
    why = missing_extra(extra, what)
    if why:
        raise MissingExtraError(why)


@dataclasses.dataclass(frozen=True)
class OptionalCommand:
    """A subcommand whose module cannot even be imported without an extra (the conformance suite is a pytest
    plugin). Without the extra, ``commfuse --help`` still lists it, and running it says what to install."""

    name: str
    help: str
    extra: str


#: Subcommand modules that need an extra to import, by module name; the module registers itself with this
#: record's name and help.
OPTIONAL_COMMANDS = {
    "commfuse.testing.command": OptionalCommand(
        "conformance", "run the conformance suite against a backend (correct, deadlock-free, overlapping)", "test"),
}


class _Unavailable:
    """The ``run`` of a subcommand whose extra is missing: it takes any arguments and refuses with the hint."""

    def __init__(self, spec: OptionalCommand) -> None:
        self.spec = spec
        self.why = missing_extra(spec.extra, f"commfuse {spec.name}") or ""

    def arguments(self, p: argparse.ArgumentParser) -> None:
        p.description = f"{self.spec.help}. Not available here: {self.why}."

    def __call__(self, args: argparse.Namespace) -> int:
        raise MissingExtraError(self.why)


# -- argument types and output paths, for every subcommand -----------------

#: The most ranks a command launches as processes on this one machine (``bench -n``, ``conformance -n``):
#: each is a Python process with torch loaded (a few hundred MB), so more would exhaust a large host's memory
#: before a transfer ran. Larger worlds run one process per device under torchrun.
MAX_LAUNCHED_RANKS = 64


#: The most digits an integer argument may have (``int()`` itself refuses more than 4300).
_MAX_DIGITS = 1000


def integer(low: int, high: int | None = None, *, why: str = "") -> Callable[[str], int]:
    """An argparse ``type``: an integer from ``low`` to ``high`` (no upper bound when None), in ASCII digits.

    argparse names the option beside the message: ``argument --batch/-b: expected an integer >= 1, got '0'``.
    ``why`` says where the upper bound comes from.
    """
    def parse(text: str) -> int:
        shown = f"from {low} to {high}" if high is not None else f">= {low}"
        stripped = text.strip()
        body = stripped[1:] if stripped[:1] in "+-" else stripped
        if not (body.isascii() and body.isdigit()):
            raise argparse.ArgumentTypeError(f"expected an integer {shown}, got {text!r}")
        if len(body) > _MAX_DIGITS:
            raise argparse.ArgumentTypeError(f"expected an integer {shown} of at most {_MAX_DIGITS} digits, got "
                                             f"{len(body)} digits")
        value = int(stripped)
        if value < low or (high is not None and value > high):
            reason = why if high is not None and value > high else ""
            raise argparse.ArgumentTypeError(f"expected an integer {shown}{reason}, got {text!r}")
        return value

    parse.__name__ = "integer"
    return parse


def seconds(low: float, high: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number of seconds from ``low`` to ``high``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"expected seconds from {low:g} to {high:g}, got {text!r}")
        return value

    parse.__name__ = "seconds"
    return parse


def _first_existing(path: Path) -> tuple[Path, list[Path]]:
    """The nearest of ``path`` and its parents that exists, and the missing ones below it, top first."""
    missing = []
    while not os.path.lexists(path) and path.parent != path:
        missing.append(path)
        path = path.parent
    return path, missing[::-1]


def check_output_file(option: str, path: str | os.PathLike) -> None:
    """Refuse, naming ``option`` and ``path``, an output file that could not be written; leave nothing behind.

    Called before any work, so that a run never ends in a traceback over where its output goes: the path
    must not be a folder, nothing above it may be a file, and this user must be able to create or
    overwrite it. Missing folders are created to find out, and removed again with the probe file.
    """
    p = Path(path)
    shown = f"{option} {os.fspath(path)}"
    if p.is_dir():
        raise CommfuseValueError(f"{shown}: is a folder; give the path of a file in it")
    _probe(shown, p)


def check_outputs(args: argparse.Namespace, *dests: str) -> None:
    """:func:`check_output_file` for each of ``dests`` given in ``args`` (as ``--dest``), but ``-`` (stdout)."""
    for dest in dests:
        path = getattr(args, dest, None)
        if path and path != "-":
            check_output_file(f"--{dest.replace('_', '-')}", path)


def check_output_dir(option: str, path: str | os.PathLike) -> None:
    """Refuse, naming ``option`` and ``path``, an output folder that could not be written; leave nothing
    behind (see :func:`check_output_file`)."""
    p = Path(path)
    shown = f"{option} {os.fspath(path)}"
    if os.path.lexists(p) and not p.is_dir():
        raise CommfuseValueError(f"{shown}: is a file, not a folder")
    _probe(shown, p / ".commfuse-write-probe")


def _probe(shown: str, p: Path) -> None:
    """Open ``p`` for appending if it exists (which changes nothing), else create it and the folders above it
    that are missing, and remove all of that again; an error names ``shown`` and why it failed."""
    top, missing = _first_existing(p)
    if missing and not top.is_dir():
        raise CommfuseValueError(f"{shown}: {top} is a file, not a folder, so nothing can be written under it")
    made: list[Path] = []
    try:
        if not missing:
            with open(p, "ab"):
                pass
            return
        for folder in missing[:-1]:
            folder.mkdir()
            made.append(folder)
        try:
            with open(p, "xb"):
                pass
            made.append(p)
        except FileExistsError:  # made by someone else meanwhile: writable all the same
            pass
    except OSError as e:
        raise CommfuseValueError(f"{shown}: cannot be written ({e.strerror or e})") from None
    finally:
        for created in reversed(made):
            try:
                created.rmdir() if created.is_dir() else created.unlink()
            except OSError:  # something else wrote there meanwhile: theirs now
                pass


# -- commfuse schedule -----------------------------------------------------


#: The largest schedule ``schedule show`` renders. Its table has a column per rank and about world size x
#: parts rows: 64 ranks at 16 parts is ~2 MB of text in under a second, 1024 ranks at one part already 37 MB
#: and seconds, 100000 ranks minutes. Bigger schedules: ``commfuse.schedule.build(...)`` in Python, then
#: ``.steps(rank)`` for the ranks you want (or ``render`` on the whole, if you mean it).
SHOW_MAX_WORLD_SIZE = 64
SHOW_MAX_PARTS = 16
SHOW_MAX_CHUNKS = 64


def _schedule_arguments(p: argparse.ArgumentParser) -> None:
    from commfuse.schedule import Algorithm, Collective

    bigger = " (bigger: commfuse.schedule.build in Python)"
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION", help="what to do")
    show = sub.add_parser("show", help="print the step table of one schedule")
    show.add_argument("collective", choices=[c.value for c in Collective],
                      help="the collective to decompose: %(choices)s")
    show.add_argument("--world-size", "-n", type=integer(1, SHOW_MAX_WORLD_SIZE, why=bigger), required=True,
                      help=f"number of ranks, 1 to {SHOW_MAX_WORLD_SIZE} (a column each; for more, "
                      "commfuse.schedule.build in Python)")
    show.add_argument("--algorithm", "-a", default="ring", choices=[a.value for a in Algorithm],
                      help="ring (CommFuse's hops), bidirectional (half of each slice each way round), sliced "
                      "(whole collectives on chunks) or vanilla (one collective, then the compute); default ring")
    show.add_argument("--parts", type=integer(1, SHOW_MAX_PARTS, why=bigger), default=1,
                      help=f"slices per shard (ring algorithms; the paper's m), 1 to {SHOW_MAX_PARTS}")
    show.add_argument("--chunks", type=integer(1, SHOW_MAX_CHUNKS, why=bigger), default=1,
                      help=f"collectives the data is sliced into (sliced), 1 to {SHOW_MAX_CHUNKS}")
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
    if os.path.lexists(args.dir) and not args.dir.is_dir():
        raise CommfuseValueError(f"--dir {args.dir}: is a file, not a folder")
    if not args.check:
        check_output_dir("--dir", args.dir)
        for entry in _catalog.entries():  # what the catalog's files would collide with
            for n in _catalog.WORLD_SIZES:
                path = entry.path(args.dir, n)
                if path.is_dir() or (os.path.lexists(path.parent) and not path.parent.is_dir()):
                    what = path if path.is_dir() else path.parent
                    raise CommfuseValueError(f"--dir {args.dir}: {what} is a {'folder' if path.is_dir() else 'file'} "
                                             f"where the catalog needs a {'file' if path.is_dir() else 'folder'}")
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
#: They must import only argparse-level things at module level (torch lazily);
#: those that need an extra to import at all are in :data:`OPTIONAL_COMMANDS`.
COMMAND_MODULES = ("commfuse.bench.command", "commfuse.bench.simulate", "commfuse.testing.command", "commfuse.traces")


def _load_commands() -> None:
    import importlib

    for name in COMMAND_MODULES:
        spec = OPTIONAL_COMMANDS.get(name)
        if spec is not None and missing_extra(spec.extra, spec.name):
            if not any(c[0] == spec.name for c in COMMANDS):
                stub = _Unavailable(spec)
                COMMANDS.append((spec.name, f"{spec.help} (needs the {spec.extra!r} extra)", stub.arguments, stub))
            continue
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
    args, unknown = p.parse_known_args(argv)
    if unknown and not isinstance(getattr(args, "run", None), _Unavailable):  # that one refuses whatever it is given
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "run", None):
        p.print_help()
        return 2
    try:
        return args.run(args)
    except CommfuseError as e:
        print(f"commfuse: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    # ``python -m commfuse.cli`` runs this file as ``__main__``, a second copy of the module: the subcommand
    # modules register into ``commfuse.cli.COMMANDS``, so the command must be that module's
    from commfuse.cli import main as _main

    sys.exit(_main())
