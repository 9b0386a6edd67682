"""commfuse.integrations without the framework it integrates: torchtitan is optional, and its absence is named."""

from __future__ import annotations

import importlib
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version

import pytest


def _installed(distribution: str) -> bool:
    try:
        version(distribution)
        return True
    except PackageNotFoundError:
        return False


@pytest.mark.skipif(_installed("torchtitan"),
                    reason="this environment has torchtitan; tests/torchtitan_stage cover the integration there")
def test_the_torchtitan_integration_without_torchtitan_says_what_to_install():
    sys.modules.pop("commfuse.integrations.torchtitan", None)
    with pytest.raises(ImportError, match=r"needs torchtitan's model code \(tested with torchtitan 0\.3\.0\)"):
        importlib.import_module("commfuse.integrations.torchtitan")


def test_importing_commfuse_imports_no_integration():
    # each integration is imported only by whoever asks for it: commfuse itself never pulls a framework in
    out = subprocess.run([sys.executable, "-c", "import sys, commfuse, commfuse.integrations; "
                          "print(sorted(m for m in sys.modules if m.startswith(('commfuse.integrations.', 'torchtitan'))))"],
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.skipif(_installed("torchtitan"), reason="this environment has torchtitan; the workload runs there")
def test_the_torchtitan_bench_workload_without_torchtitan_says_how_to_get_it():
    import torch

    from commfuse.bench import command, workloads
    from commfuse.cli import parser
    from commfuse.errors import CommfuseValueError

    config = command.config_from_args(parser().parse_args(["bench", "-w", "torchtitan", "--preset", "tiny"]))
    with pytest.raises(CommfuseValueError, match=r"workload torchtitan needs torchtitan .*ci/setup_torchtitan\.sh"):
        workloads.make("torchtitan", config, 0, 1, torch.device("cpu"))
    assert "torchtitan" not in command.config_from_args(parser().parse_args(["bench", "-w", "all"])).workloads
