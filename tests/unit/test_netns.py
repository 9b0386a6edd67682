"""``--link-rate``'s private namespace: decided by the namespaces themselves, and signals reach the benchmark."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from commfuse.bench import netns

ROOT_AND_UNSHARE = os.geteuid() == 0 and shutil.which("unshare") is not None


def _claim_inside(monkeypatch, rate: str = "800mbit") -> None:
    """Set every variable the re-executed benchmark gets, as if this process's parent had re-executed it."""
    monkeypatch.setenv(netns.ENV, rate)
    monkeypatch.setenv(netns.PARENT_ENV, os.readlink(f"/proc/{os.getppid()}/ns/net"))
    monkeypatch.setenv(netns.PID_ENV, str(os.getppid()))


def test_variables_alone_do_not_make_a_private_namespace(monkeypatch):
    # pytest runs in its parent's namespace: the variables say "inside", the namespaces say otherwise
    _claim_inside(monkeypatch)
    assert netns.inside() is None


def test_a_stale_parent_variable_does_not_make_a_private_namespace(monkeypatch):
    _claim_inside(monkeypatch)
    monkeypatch.setenv(netns.PARENT_ENV, "net:[1]")  # some other namespace, as a stale value would name
    assert netns.inside() is None


def test_shape_loopback_refuses_the_parents_namespace(monkeypatch):
    _claim_inside(monkeypatch)
    monkeypatch.setenv(netns.PARENT_ENV, "net:[1]")
    ran = []
    monkeypatch.setattr(netns.subprocess, "run", lambda *a, **k: ran.append(a))  # never reach ip or tc
    with pytest.raises(netns.LinkRateError, match="refusing to shape"):
        netns.shape_loopback("800mbit")
    assert ran == []


def test_no_variables_is_not_inside(monkeypatch):
    for name in (netns.ENV, netns.PARENT_ENV, netns.PID_ENV):
        monkeypatch.delenv(name, raising=False)
    assert netns.inside() is None


def test_bench_reexecutes_instead_of_trusting_the_variables(monkeypatch):
    from commfuse.bench import command

    _claim_inside(monkeypatch)
    monkeypatch.setenv(netns.PID_ENV, "1")  # not our parent: a stale copy, not a re-execution
    calls = []
    monkeypatch.setattr(netns, "reexec", lambda argv, rate: calls.append((argv, rate)) or 7)
    monkeypatch.setattr(netns, "shape_loopback", lambda rate: pytest.fail("shaped a loopback it did not create"))
    args = command.argparse.ArgumentParser()
    command.arguments(args)
    parsed = args.parse_args(["--link-rate", "800mbit", "--no-progress"])
    assert command.run(parsed) == 7
    assert calls and calls[0][1] == "800mbit"


def test_reexec_refuses_to_nest_when_its_own_child_cannot_verify(monkeypatch):
    # the variables name our parent as the bench that re-executed us, yet we are in its namespace: starting
    # another `unshare` would recurse; say what is wrong instead
    _claim_inside(monkeypatch)
    monkeypatch.setattr(netns, "_require_tools", lambda: None)
    monkeypatch.setattr(netns, "run_forwarding_signals", lambda *a, **k: pytest.fail("re-executed again"))
    with pytest.raises(netns.LinkRateError, match="private network namespace"):
        netns.reexec(["--link-rate", "800mbit"], "800mbit")


_REPORT = "import os, commfuse.bench.netns as n; print(repr(n.inside()))"


@pytest.mark.skipif(not ROOT_AND_UNSHARE, reason="needs root and unshare to create a network namespace")
def test_a_real_unshared_child_is_inside():
    env = dict(os.environ, **{netns.ENV: "800mbit", netns.PARENT_ENV: os.readlink("/proc/self/ns/net"),
                              netns.PID_ENV: str(os.getpid())})
    # unshare execs python, so python's parent is this process, in the namespace that PARENT_ENV names
    done = subprocess.run(["unshare", "--net", "--", sys.executable, "-c", _REPORT], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "'800mbit'"
    # the same child without a namespace of its own is not inside
    done = subprocess.run([sys.executable, "-c", _REPORT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"


_RECORDER = """
import signal, sys, time
path = sys.argv[1]
def on(signum, frame):
    with open(path, "w") as f:
        f.write(str(signum))
    sys.exit(3)
for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
    signal.signal(s, on)
open(path + ".ready", "w").close()
time.sleep(60)
sys.exit(0)
"""

_DEFAULT = """
import sys, time
open(sys.argv[1] + ".ready", "w").close()
time.sleep(60)
"""


def _send_when_ready(tmp_path, signum: int, *, code: str):
    """Run ``code`` under run_forwarding_signals and send ``signum`` to this process once the child is up."""
    path = tmp_path / "got"
    ready = tmp_path / "got.ready"

    done = threading.Event()

    def sender():
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline and not done.is_set():
            time.sleep(0.05)
        if ready.exists() and not done.is_set():  # never signal pytest itself outside the helper
            os.kill(os.getpid(), signum)

    before = {s: signal.getsignal(s) for s in netns.FORWARDED}
    t = threading.Thread(target=sender, daemon=True)
    t.start()
    start = time.monotonic()
    try:
        code_out = netns.run_forwarding_signals([sys.executable, "-c", code, str(path)], dict(os.environ))
    finally:
        done.set()
    took = time.monotonic() - start
    t.join(5)
    assert {s: signal.getsignal(s) for s in netns.FORWARDED} == before  # handlers restored
    return code_out, path, took


@pytest.mark.usefixtures("sigint_handled")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signals_reach_the_child(tmp_path, signum):
    code, path, took = _send_when_ready(tmp_path, signum, code=_RECORDER)
    assert path.read_text() == str(int(signum))
    assert code == 3  # the child's own exit status
    assert took < 30


def test_a_child_killed_by_the_signal_gives_128_plus_signum(tmp_path):
    code, _, took = _send_when_ready(tmp_path, signal.SIGTERM, code=_DEFAULT)
    assert code == 128 + signal.SIGTERM
    assert took < 30


def test_an_ignored_signal_stays_ignored():
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        assert netns.run_forwarding_signals([sys.executable, "-c", "pass"], dict(os.environ)) == 0
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


def test_exit_status_passes_through():
    assert netns.run_forwarding_signals([sys.executable, "-c", "raise SystemExit(5)"], dict(os.environ)) == 5


def _children(pid: int) -> list[int]:
    found = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not ROOT_AND_UNSHARE or not all(shutil.which(t) for t in ("ip", "tc")),
                    reason="--link-rate needs root, unshare, ip and tc")
def test_sigterm_to_the_bench_stops_the_benchmark_in_the_namespace(tmp_path):
    """The outer `commfuse bench --link-rate` gets SIGTERM while its ranks run: they all stop, promptly."""
    cmd = [sys.executable, "-m", "commfuse.bench", "--preset", "tiny", "--repeats", "100000", "--warmup", "0",
           "-w", "ag_matmul", "-a", "vanilla", "--link-rate", "1gbit", "--json", str(tmp_path / "never.json")]
    # the bench's ranks start as users run it (spawn, launch's default), not as this suite's do
    outer = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                             env=dict(os.environ, OMP_NUM_THREADS="1", COMMFUSE_LAUNCH_START="spawn"))
    seen: set[int] = set()
    try:
        inner, ranks = None, []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(ranks) < 2:
            assert outer.poll() is None, "the benchmark ended before it was signalled"
            kids = _children(outer.pid)
            inner = kids[0] if kids else None
            ranks = [c for c in _children(inner) if "spawn_main" in _cmdline(c)] if inner else []
            time.sleep(0.2)
        assert inner is not None and len(ranks) == 2, "the ranks never started"
        seen = {inner, *ranks}
        outer.send_signal(signal.SIGTERM)
        code = outer.wait(timeout=40)
        assert code in (128 + signal.SIGTERM, 1), code  # the inner benchmark's fate, as an exit status
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(p) for p in seen):
            time.sleep(0.2)
        assert not [p for p in seen if _alive(p)], "processes in the namespace outlived the signal"
    finally:
        if outer.poll() is None:
            outer.kill()
            outer.wait()
        for p in seen:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.skipif(not ROOT_AND_UNSHARE or not shutil.which("tc") or not shutil.which("ip"),
                    reason="needs root, unshare, ip and tc to create and shape a network namespace")
def test_calibrate_link_rate_measures_once_inside_its_namespace(tmp_path):
    # the calibration re-executes itself in a shaped namespace the way the benchmark does; its child must know
    # it is inside (before, the child was never told its parent's pid, and nested namespaces until killed)
    out = tmp_path / "profile.toml"
    done = subprocess.run([sys.executable, "-m", "commfuse", "simulate", "calibrate", "--link-rate", "800mbit",
                           "--quick", "--output", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("private network namespace") == 1, done.stderr[-3000:]
    assert out.exists() and "800mbit" in out.read_text()
