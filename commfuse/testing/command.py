"""``commfuse conformance``: run the conformance suite against a backend and write a report.

This module imports pytest (through :mod:`commfuse.testing`, the suite's pytest plugin): ``commfuse.cli`` imports
it only where the ``test`` extra is installed, and otherwise registers a command of the same name that says how
to install it (:data:`commfuse.cli.OPTIONAL_COMMANDS`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from pathlib import Path

from commfuse.cli import MAX_LAUNCHED_RANKS, OPTIONAL_COMMANDS, check_output_file, command, integer
from commfuse.errors import BackendUnavailableError, CommfuseValueError
from commfuse.testing import MIN_WORLD_SIZE

TIERS = ("transport", "schedules", "ops", "determinism", "overlap", "capture", "robustness", "traced")


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", required=True, help="backend under test: a registered name or module:factory")
    p.add_argument("--world-size", "-n", type=integer(MIN_WORLD_SIZE, MAX_LAUNCHED_RANKS), default=2,
                   help=f"ranks to launch, {MIN_WORLD_SIZE} to {MAX_LAUNCHED_RANKS} (default 2; one rank would "
                   "send nothing, so nothing would be tested)")
    p.add_argument("--capabilities", default=None, help="module:Class of the backend's Capabilities subclass")
    p.add_argument("--report", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--tier", action="append", choices=TIERS, help="run only this tier (repeatable)")
    p.add_argument("-k", dest="keyword", default=None, help="pytest -k expression to select cases")
    p.add_argument("--verbose", "-v", action="store_true", help="name every test as pytest runs it (pytest -v)")


def _check_backend(ref: str) -> None:
    """Refuse, before a rank is launched, a backend that is not there: a name that is not installed or cannot
    run here (naming those that can), or a ``module:factory`` that does not import or has no such factory."""
    if ":" in ref:
        _check_reference("--backend", ref, None)
        return
    from commfuse import backends

    try:
        spec = backends.spec(ref)
    except BackendUnavailableError as e:  # names the installed backends, and how to install a known one
        raise BackendUnavailableError(f"--backend {ref}: {e}") from None
    availability = backends.availability(spec.name)
    if not availability.ok:
        fix = f" (fix: {availability.fix})" if availability.fix else ""
        raise BackendUnavailableError(
            f"--backend {ref}: installed, but it cannot run here: {availability.reason}{fix}; backends that can: "
            f"{', '.join(backends.available()) or 'none'}")


def _declared_capabilities(ref: str) -> str | None:
    """For a registered backend whose ranks are one traced program (its record declares ``whole_ops``), the
    capabilities file beside its plugin (``<package>.conformance:Capabilities``), which names its traced runner:
    without it the suite would launch processes that such a backend has no rank in. None otherwise."""
    if ":" in ref:
        return None
    from commfuse import backends

    spec = backends.spec(ref)
    if not spec.capabilities.whole_ops:
        return None
    module = f"{spec.factory.__module__.rpartition('.')[0]}.conformance"
    return f"{module}:Capabilities" if importlib.util.find_spec(module) is not None else None


def _check_reference(option: str, ref: str, default: str | None) -> None:
    """``module:attribute`` imports and names something callable, or an error names ``option`` and ``ref``."""
    module, _, attr = ref.partition(":")
    attr = attr or (default or "")
    if not module or not attr:
        raise CommfuseValueError(f"{option} {ref!r}: expected module:{'Class' if default else 'factory'}")
    try:
        found = getattr(importlib.import_module(module), attr, None)
    except ImportError as e:
        raise CommfuseValueError(f"{option} {ref!r}: module {module!r} does not import ({e})") from None
    if not callable(found):
        raise CommfuseValueError(f"{option} {ref!r}: module {module!r} has no callable {attr!r}")


_SPEC = OPTIONAL_COMMANDS[__name__]


@command(_SPEC.name, _SPEC.help, _arguments)
def _conformance(args: argparse.Namespace) -> int:
    import pytest

    from commfuse.testing import suite  # noqa: F401 - fails early if the suite cannot import

    _check_backend(args.backend)
    if not args.capabilities:
        args.capabilities = _declared_capabilities(args.backend)
    if args.capabilities:
        _check_reference("--capabilities", args.capabilities, "Capabilities")
    if args.report:
        check_output_file("--report", args.report)
    target = str(Path(__file__).with_name("test_conformance_run.py"))
    argv = [target, "-p", "commfuse.testing", "--commfuse-backend", args.backend,
            "--commfuse-world-size", str(args.world_size), "-p", "no:cacheprovider", "-rfEs",
            "-q" if not args.verbose else "-v", "--rootdir", str(Path(target).parent)]
    if args.capabilities:
        argv += ["--commfuse-capabilities", args.capabilities]
    if args.report:
        argv += ["--commfuse-report", str(args.report)]
    selectors = [f"test_{t if t != 'ops' else 'op'}" for t in (args.tier or [])]
    selectors = [s.replace("test_schedules", "test_schedule") for s in selectors]
    expression = " or ".join(selectors)
    if args.keyword:
        expression = f"({expression}) and ({args.keyword})" if expression else args.keyword
    if expression:
        argv += ["-k", expression]
    code = pytest.main(argv)
    if args.report:
        import json

        data = json.loads(args.report.read_text())
        print(f"conformance of {args.backend!r} at world size {args.world_size}: {data['summary']}; "
              f"report: {args.report}")
    return int(code)
