"""commfuse's conformance suite, shipped in the wheel: prove a backend correct, deadlock-free and overlapping.

Two ways to run it:

* inside a vendor's test run: ``pytest -p commfuse.testing --commfuse-backend NAME
  [--commfuse-world-size N] [--commfuse-report FILE.json]`` over a test module
  that subclasses :class:`commfuse.testing.suite.ConformanceSuite`;
* standalone: ``commfuse conformance --backend NAME [--world-size N] [--report FILE.json]``.

A vendor writes one fixtures file (a ``conftest.py`` with
``pytest_plugins = ["commfuse.testing"]`` and, if it wants, fixtures that
override ``commfuse_backend_name`` / ``commfuse_capabilities``) and one
capabilities file (a subclass of :class:`Capabilities`). Tests skip by
capability, never by a backend's name. The suite launches its own ranks (or,
under ``torchrun``, runs on the ranks it was started on).

This module is the pytest plugin: options, fixtures, case generation and the
JSON report.
"""

from __future__ import annotations

import json
import time

import pytest

from commfuse.testing.capabilities import Capabilities

__all__ = ["MIN_WORLD_SIZE", "Capabilities"]

#: The least world size the suite runs at. A world of one rank sends nothing (every op resolves to no call at
#: world size 1, the transport tier's ring shifts go to the rank itself), so the transport, schedule, ops
#: and overlap tiers would pass without a transfer; and at world size 0 no rank is launched and every test
#: passes on no results at all. Two ranks exercise every path; the robustness cases that need more say so
#: and skip (``mismatch-promptness`` needs 4).
MIN_WORLD_SIZE = 2

_REPORT: list[dict] = []


def pytest_addoption(parser) -> None:
    group = parser.getgroup("commfuse", "commfuse conformance suite")
    group.addoption("--commfuse-backend", default="gloo",
                    help="backend under test: a registered name or module:factory (default gloo)")
    group.addoption("--commfuse-world-size", type=int, default=2, help="ranks to launch (default 2)")
    group.addoption("--commfuse-capabilities", default=None,
                    help="module:Class of the backend's Capabilities subclass (default: the defaults)")
    group.addoption("--commfuse-report", default=None, help="write a JSON report of every test here")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "commfuse_tier(name): a conformance test whose cases come from that tier")
    n = config.getoption("--commfuse-world-size", default=MIN_WORLD_SIZE)
    if n < MIN_WORLD_SIZE:
        raise pytest.UsageError(f"--commfuse-world-size {n}: the conformance suite needs at least {MIN_WORLD_SIZE} "
                                "ranks (one rank sends nothing, so the tiers would pass without testing a transfer)")


@pytest.fixture(scope="session")
def commfuse_backend_name(pytestconfig) -> str:
    return pytestconfig.getoption("--commfuse-backend")


@pytest.fixture(scope="session")
def commfuse_world_size(pytestconfig) -> int:
    return pytestconfig.getoption("--commfuse-world-size")


@pytest.fixture(scope="session")
def commfuse_capabilities(pytestconfig) -> Capabilities:
    return Capabilities.load(pytestconfig.getoption("--commfuse-capabilities"))


def pytest_generate_tests(metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("commfuse_tier")
    if marker is None or "commfuse_case" not in metafunc.fixturenames:
        return
    from commfuse.testing.suite import cases

    n = metafunc.config.getoption("--commfuse-world-size")
    names = cases(marker.args[0], n)
    metafunc.parametrize("commfuse_case", names, ids=names)


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        reason = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = report.longrepr[2]
        elif report.failed:
            reason = str(report.longrepr)[-2000:]
        _REPORT.append({
            "test": report.nodeid,
            "outcome": report.outcome,
            "reason": reason,
            "figures": {k: v for k, v in report.user_properties},
            "seconds": round(report.duration, 3),
        })


def pytest_sessionfinish(session, exitstatus) -> None:
    path = session.config.getoption("--commfuse-report", default=None)
    if not path:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    counts: dict[str, int] = {}
    for entry in _REPORT:
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    caps = session.config.getoption("--commfuse-capabilities")
    with open(path, "w") as f:
        json.dump({
            "backend": session.config.getoption("--commfuse-backend"),
            "world_size": session.config.getoption("--commfuse-world-size"),
            "capabilities": Capabilities.load(caps).as_dict(),
            "summary": counts,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "tests": _REPORT,
        }, f, indent=1)
