"""Tier (b), real gloo ranks: ``commfuse.launch`` reports what each rank did even when teardown hangs.

The scenario: rank 0 posts an asynchronous all-reduce that rank 1 never
joins, then raises (or returns). Gloo's worker thread stays inside that
collective until the group's timeout (120 s), and ``destroy_process_group``
waits for it; rank 1 meanwhile blocks in a ``recv`` from rank 0, which only
fails once rank 0's process is gone. Before ranks reported ahead of their
teardown, both were killed at launch's deadline and their results lost; and a
rank whose teardown failed part-way (``commfuse.backends.release`` not importable, so
destroy was skipped) kept its group alive, and its interpreter's exit hung.
"""

from __future__ import annotations

import sys
import time

import pytest
import torch
import torch.distributed as dist

import commfuse.launch as launch_module
from commfuse.launch import launch

torch.set_num_threads(1)


def _abandoned_collective(rank: int, world_size: int, how: str) -> str:
    t = torch.ones(16)
    if rank == 1:
        dist.recv(t, 0)  # rank 0 never sends: this returns (raises) only once rank 0's process has exited
        return "rank 1 received"
    dist.all_reduce(t, async_op=True)  # rank 1 never joins: destroy_process_group waits for it
    time.sleep(0.5)  # let gloo's worker thread enter the collective
    if how == "raise, and teardown fails":
        sys.modules["commfuse.backends"] = None  # release cannot be imported: destroy must still be tried
    if how != "return":
        raise ValueError("rank 0 broke in the middle of an op")
    return "rank 0 done"


@pytest.fixture(params=["spawn", "forkserver"])
def start(request, monkeypatch):
    """Both ways ranks start (``commfuse.launch.START_ENV``): a fresh interpreter each, or forked from a server
    that has torch imported (what this suite's conftest picks, to launch quickly)."""
    monkeypatch.setenv(launch_module.START_ENV, request.param)
    return request.param


@pytest.mark.parametrize("how", ["raise", "return", "raise, and teardown fails"])
def test_results_survive_a_teardown_that_would_hang(how, start):
    began = time.monotonic()
    out = launch(_abandoned_collective, 2, how, timeout=120, allow_failures=True)
    took = time.monotonic() - began
    assert took < 60, (took, out)
    if how != "return":
        assert out[0].startswith("FAILED: ") and "ValueError" in out[0], out[0]
        assert "rank 0 broke in the middle of an op" in out[0]
    else:
        assert out[0] == "rank 0 done"
    # rank 1 reports its own error (the peer went away), not launch's deadline
    assert isinstance(out[1], str) and "did not finish" not in out[1], out[1]
    assert "did not finish" not in out[0]


def test_teardown_bound_is_a_few_seconds():
    assert 0 < launch_module.TEARDOWN_S <= 10


def _nccl_env(rank, n):
    import os

    return {k: os.environ.get(k) for k in ("NCCL_HOSTID", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE",
                                           "NCCL_SOCKET_IFNAME")}


def test_each_launched_rank_can_look_like_its_own_nccl_host(monkeypatch, start):
    """Also: a rank sees the launcher's environment as it is at the launch, under a forkserver too, whose server
    started with the environment of an earlier launch."""
    from commfuse.launch import ONE_GPU_ENV

    monkeypatch.delenv("NCCL_HOSTID", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    plain = launch(_nccl_env, 2, timeout=60)
    assert [e["NCCL_HOSTID"] for e in plain] == [None, None]
    monkeypatch.setenv(ONE_GPU_ENV, "1")
    one_gpu = launch(_nccl_env, 3, timeout=60)
    assert [e["NCCL_HOSTID"] for e in one_gpu] == ["commfuse-rank-0", "commfuse-rank-1", "commfuse-rank-2"]
    assert all(e["NCCL_P2P_DISABLE"] == e["NCCL_SHM_DISABLE"] == "1" and e["NCCL_SOCKET_IFNAME"] == "lo"
               for e in one_gpu)


def _started_how(rank, n):
    import multiprocessing
    import os

    ppid = os.getppid()
    with open(f"/proc/{ppid}/cmdline", "rb") as f:
        parent_command = f.read().replace(b"\0", b" ").decode()
    return {"parent is the launcher": ppid == multiprocessing.parent_process().pid,
            "parent is a forkserver": "multiprocessing.forkserver" in parent_command}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the parent's command line in /proc")
def test_the_start_method_is_what_the_environment_says(start):
    out = launch(_started_how, 2, timeout=60)
    spawned = start == "spawn"
    assert all(o["parent is the launcher"] == spawned for o in out), out
    assert all(o["parent is a forkserver"] == (not spawned) for o in out), out


def test_an_unknown_start_method_is_refused_by_name(monkeypatch):
    from commfuse.errors import CommfuseError

    monkeypatch.setenv(launch_module.START_ENV, "fork")
    with pytest.raises(CommfuseError, match="COMMFUSE_LAUNCH_START='fork'.*'spawn'.*'forkserver'"):
        launch(_started_how, 2, timeout=60)


def _pid_then_sleep(rank, n, folder):
    import os
    from pathlib import Path

    Path(folder, f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(4)
    return os.getpid()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="looks processes up with ps")
def test_the_conformance_suites_leftover_check_sees_the_ranks_either_way(start, tmp_path):
    """``commfuse.launch.running_ranks``, with which the conformance suite's robustness tier checks that no rank
    outlives its launch, finds running ranks whether they are this process's children (spawn) or its
    forkserver's, and leaves out the helpers that outlive a launch by design (the forkserver, the resource
    tracker)."""
    import threading

    from commfuse.launch import running_ranks

    got: list = []
    runner = threading.Thread(target=lambda: got.append(launch(_pid_then_sleep, 2, str(tmp_path), timeout=120)))
    runner.start()
    files = [tmp_path / f"rank{r}.pid" for r in range(2)]
    deadline = time.monotonic() + 60
    while not all(f.exists() and f.read_text() for f in files) and time.monotonic() < deadline:
        time.sleep(0.1)
    ranks = {int(f.read_text()) for f in files}
    seen = running_ranks()
    runner.join(120)
    assert got and set(got[0]) == ranks
    assert ranks <= seen, (ranks, seen)
    assert not seen - ranks, f"helpers counted as ranks: {seen - ranks}"
    assert not running_ranks() & ranks


_PRELOAD_SCRIPT = """
import sys

from commfuse.launch import launch

WATCHED = ("torch.distributed.tensor", "commfuse.nn", "commfuse.tp", "xml.dom.minidom")


def body(rank, n):  # what the rank has imported before its body runs: nothing here imports them
    return [m for m in WATCHED if m in sys.modules]


if __name__ == "__main__":
    print(launch(body, 2, timeout=60))
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_forked_ranks_start_with_the_preloaded_modules_imported(method, tmp_path):
    """Under ``forkserver`` the server imports ``FORKSERVER_PRELOAD`` and what ``COMMFUSE_LAUNCH_PRELOAD`` adds
    once, and every rank forked from it starts with them; a spawned rank imports only what its body needs. Run in
    a process of its own: a launcher reads the variable when it starts its server, and this suite's processes
    have started theirs."""
    import ast
    import os
    import subprocess

    script = tmp_path / "preload_check.py"
    script.write_text(_PRELOAD_SCRIPT)
    env = {**os.environ, launch_module.START_ENV: method, launch_module.PRELOAD_ENV: " xml.dom.minidom "}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    got = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    if method == "forkserver":
        assert got == [["torch.distributed.tensor", "commfuse.nn", "commfuse.tp", "xml.dom.minidom"]] * 2, got
    else:
        assert all("xml.dom.minidom" not in g and "commfuse.tp" not in g for g in got), got


@pytest.mark.parametrize(("value", "says"), [("xml..dom", "'xml..dom' is not a dotted name"),
                                             ("json,,xml", "'' is not a dotted name"),
                                             ("json, no_such_package_here.sub", "no package 'no_such_package_here'")])
def test_a_preload_list_that_cannot_be_imported_is_refused_by_name(monkeypatch, value, says):
    from commfuse.errors import CommfuseValueError

    monkeypatch.setenv(launch_module.PRELOAD_ENV, value)
    with pytest.raises(CommfuseValueError, match="COMMFUSE_LAUNCH_PRELOAD") as caught:
        launch_module._preload()
    assert says in str(caught.value)
    monkeypatch.setenv(launch_module.PRELOAD_ENV, " json , xml.dom,json ")
    assert launch_module._preload() == [*launch_module.FORKSERVER_PRELOAD, "json", "xml.dom"]
    monkeypatch.delenv(launch_module.PRELOAD_ENV)
    assert launch_module._preload() == list(launch_module.FORKSERVER_PRELOAD)
