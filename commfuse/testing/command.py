"""``commfuse conformance``: run the conformance suite against a backend and write a report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from commfuse.cli import command

TIERS = ("transport", "schedules", "ops", "determinism", "overlap", "capture", "robustness")


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", required=True, help="backend under test: a registered name or module:factory")
    p.add_argument("--world-size", "-n", type=int, default=2, help="ranks to launch (default 2)")
    p.add_argument("--capabilities", default=None, help="module:Class of the backend's Capabilities subclass")
    p.add_argument("--report", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--tier", action="append", choices=TIERS, help="run only this tier (repeatable)")
    p.add_argument("-k", dest="keyword", default=None, help="pytest -k expression to select cases")
    p.add_argument("--verbose", "-v", action="store_true", help="name every test as pytest runs it (pytest -v)")


@command("conformance", "run the conformance suite against a backend (correct, deadlock-free, overlapping)",
         _arguments)
def _conformance(args: argparse.Namespace) -> int:
    try:
        import pytest
    except ImportError:
        print("commfuse conformance needs pytest: pip install 'commfuse[test]'", file=sys.stderr)
        return 2
    from commfuse.testing import suite  # noqa: F401 - fails early if the suite cannot import

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
