"""Processes, where nothing less proves it: ``python -m commfuse.cli`` is the same command as ``python -m commfuse``,
and the ranks ``commfuse.launch`` starts (those of ``commfuse bench`` and ``commfuse conformance``) die with a
parent that is killed, leaving no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

SIMULATE = ["simulate", "--profile", "h100-sxm", "--workload", "mlp", "--tp", "4", "--seq", "1024", "--hidden", "1024"]


@pytest.mark.parametrize("module", ["commfuse", "commfuse.cli"])
def test_python_m_runs_every_subcommand(module):
    done = subprocess.run([sys.executable, "-m", module, *SIMULATE], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "mlp forward, tp 4" in done.stdout and "bidirectional" in done.stdout


LAUNCHER = textwrap.dedent('''
    import os
    import sys
    import time
    from pathlib import Path


    def sleeper(rank, world_size, folder):
        Path(folder, f"rank{rank}.pid").write_text(str(os.getpid()))
        time.sleep(600)


    if __name__ == "__main__":
        from commfuse.launch import launch

        launch(sleeper, 2, sys.argv[1], timeout=600)
''')


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended: only its exit status is left for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            out.append(int(entry))
    return out


def _wait(condition, seconds: float) -> bool:
    """Poll ``condition`` until it holds or ``seconds`` pass (a bound on waiting, not a measured time)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _descendants(pid: int) -> list[int]:
    """``pid``'s children, theirs, and so on (a forkserver's ranks are its launcher's grandchildren)."""
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="looks processes up in /proc")
@pytest.mark.parametrize("start", ["spawn", "forkserver"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT], ids=lambda s: s.name)
@pytest.mark.usefixtures("sigint_handled")
def test_launched_ranks_die_with_a_killed_parent(sig, start, tmp_path):
    """Either way ranks start (commfuse.launch.START_ENV): spawned, the ranks are the launcher's children;
    forked from a forkserver, its grandchildren, and the forkserver goes with them."""
    script = tmp_path / "launch_and_sleep.py"
    script.write_text(LAUNCHER)
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env={**os.environ, "COMMFUSE_LAUNCH_START": start})
    pid_files = [tmp_path / f"rank{r}.pid" for r in range(2)]
    survivors: list[int] = []
    try:
        started = _wait(lambda: all(p.exists() and p.read_text() for p in pid_files) or parent.poll() is not None,
                        300)
        assert started and parent.poll() is None, "the ranks did not start"
        ranks = [int(p.read_text()) for p in pid_files]
        # the ranks, and multiprocessing's helpers (the forkserver, the resource tracker)
        children = sorted(set(_descendants(parent.pid)) | set(ranks))
        assert set(ranks) <= set(_children(parent.pid) if start == "spawn" else _descendants(parent.pid))
        parent.send_signal(sig)
        parent.wait(timeout=120)
        _wait(lambda: not any(_alive(c) for c in children), 60)
        survivors = [c for c in children if _alive(c)]
        assert not survivors, f"processes left behind by a parent ended with {sig.name}: {survivors}"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in survivors:  # ours: started by this test's launch
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
