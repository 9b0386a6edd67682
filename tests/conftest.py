"""Shared test settings: a bounded hypothesis profile so the suite stays quick on 2 cores."""

import os
import signal
import tempfile
from importlib.metadata import PackageNotFoundError, version
from importlib.util import find_spec
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "commfuse", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("commfuse")

# Tests make ranks fail on purpose, and a failing rank dumps its flight recorder: into a folder of the run's own,
# never the working tree (the ranks that commfuse.launch spawns inherit it). A test that reads dumps sets its own.
os.environ.setdefault("COMMFUSE_TRACE_DIR", tempfile.mkdtemp(prefix="commfuse-test-traces-"))

# Launched ranks fork from a server that has imported torch and commfuse's layers (commfuse.launch.START_ENV):
# 0.2 s a launch instead of 2 to 3 s, over the suite's hundreds of launches. test_launch_gloo and
# test_cli_processes run both ways. The server imports transformers too, where it is installed: the HF-style,
# MoE-model and mask cases import it in every rank (commfuse.launch.PRELOAD_ENV).
os.environ.setdefault("COMMFUSE_LAUNCH_START", "forkserver")
if find_spec("transformers") is not None:
    os.environ.setdefault("COMMFUSE_LAUNCH_PRELOAD", "transformers")



def _installed(distribution: str) -> bool:
    try:
        version(distribution)  # the installed distribution, not a folder of the same name on sys.path
        return True
    except PackageNotFoundError:
        return False


# tests/torchtitan_stage run in their own environment, where torchtitan is installed (ci/test_torchtitan.sh); the
# main suite's environment has no torchtitan, and commfuse does not require it
collect_ignore = [] if _installed("torchtitan") else ["torchtitan_stage"]


# tests/transformers_stage is a stage of its own (ci/test_transformers.sh, whole transformers models): collected
# when the run is asked for it by its path, not in a run of the whole suite
_TRANSFORMERS_STAGE = Path(__file__).parent / "transformers_stage"


def pytest_ignore_collect(collection_path, config):
    if collection_path != _TRANSFORMERS_STAGE:
        return None
    asked = [Path(arg.split("::")[0]).resolve() for arg in config.args]
    return not any(path == _TRANSFORMERS_STAGE or _TRANSFORMERS_STAGE in path.parents for path in asked)


@pytest.fixture
def sigint_handled():
    """Python's own Ctrl-C handler for the test's duration, for tests that send SIGINT: a process started with
    SIGINT ignored keeps it ignored (a shell's background job, a pytest-xdist worker), and so do the processes
    it starts, so there the signal would reach no Python at all. Restored after."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
