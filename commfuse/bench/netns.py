"""``--link-rate``: run the ranks behind a rate-limited loopback in a private network namespace.

On a CPU box the loopback moves gigabytes per second while one core does
tens of GFLOP/s, so communication is too cheap beside compute for overlap to
matter. Limiting the loopback with a token-bucket filter gives real TCP
traffic the comm/compute ratio of an accelerator cluster. The benchmark
re-executes itself under ``unshare --net`` (a new, empty network namespace:
the host's own loopback is never touched), and inside brings ``lo`` up and
adds ``tc qdisc ... tbf rate RATE burst B latency 400ms`` (DESIGN.md, "Facts
about this machine"; tc-tbf(8)). Every packet of every rank crosses ``lo``'s
one egress queue, so RATE is shared by both directions of every pair of
ranks: a half-duplex link.

Whether a process is in that private namespace is decided by the namespaces
themselves, never by the environment alone: the re-executed benchmark's parent
is the process that ran ``unshare`` (``unshare`` execs it), and the two must be
in different network namespaces, the parent's being the one it recorded. A
copied or stale environment therefore never gets ``tc`` applied to a loopback
the benchmark did not create.

The outer process runs the inner one in a session of its own and passes
SIGTERM, SIGHUP and SIGINT on to its process group (the inner benchmark and its
ranks), so stopping ``commfuse bench --link-rate`` stops the measurement too.

Needs root (or CAP_SYS_ADMIN + CAP_NET_ADMIN), ``unshare`` (util-linux), ``ip``
and ``tc`` (iproute2). Imports no torch.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from commfuse.errors import CommfuseError, CommfuseValueError
from commfuse.runtime.env import text as env_text

#: Set in the re-executed benchmark: the rate its namespace's loopback is shaped to.
ENV = "COMMFUSE_BENCH_NETNS_RATE"
#: ... and the network namespace it was started from, which it must not be in.
PARENT_ENV = "COMMFUSE_BENCH_NETNS_PARENT"
#: ... and the process id of the benchmark that started it, which must be its parent.
PID_ENV = "COMMFUSE_BENCH_NETNS_PID"

#: Signals the outer benchmark passes on to the one in the private namespace.
FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
#: Seconds the outer benchmark waits for the inner one after passing on a signal, before SIGKILL.
FORWARD_GRACE_S = 30.0

_UNITS = {
    "bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
    "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12,
}
_RATE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([a-z]+)$")

#: Smallest token bucket: at least the loopback MTU (65536) many times over,
#: DESIGN.md's 256 KiB that worked at 800 mbit.
MIN_BURST = 256 * 1024


class LinkRateError(CommfuseError, RuntimeError):
    """The rate-limited namespace cannot be set up here."""


def parse_rate(text: str) -> float:
    """Bytes per second of a tc rate such as ``800mbit``, ``2gbit`` or ``100mbps`` (tc's units: bit/s, B/s)."""
    m = _RATE.match(text.strip().lower()) if isinstance(text, str) else None
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise CommfuseValueError(
            f"--link-rate {text!r} is not a rate: give a positive number and one of tc's units "
            f"{', '.join(_UNITS)} (e.g. 800mbit, 2gbit; 'bps' means bytes per second)"
        )
    return float(m.group(1)) * _UNITS[m.group(2)]


def burst_bytes(rate_bytes_per_s: float) -> int:
    """Token bucket size: 4 ms worth of the rate, never under :data:`MIN_BURST`.

    tbf needs a bucket of at least rate / HZ plus one packet to reach its rate
    (tc-tbf(8)); at 800 mbit 256 KiB is ~2.6 ms of traffic.
    """
    return max(MIN_BURST, int(rate_bytes_per_s * 0.004))


def inside() -> str | None:
    """The rate of the shaped namespace this process runs in, or None.

    The environment names the rate, but only the namespaces say whether this
    process is in the private namespace ``reexec`` made for it: see
    :func:`not_inside_because`.
    """
    rate = env_text(ENV)
    if rate is None or not_inside_because() is not None:
        return None
    return rate


def not_inside_because() -> str | None:
    """Why this process is not in a private namespace ``reexec`` made for it; None when it is.

    It is when all of these hold: :data:`ENV` is set; the parent process is the
    one :data:`PID_ENV` names (``unshare`` execs the benchmark, so its parent is
    the outer benchmark); that parent is in the namespace :data:`PARENT_ENV`
    recorded; and this process is in a different one.
    """
    if not env_text(ENV):
        return f"{ENV} is not set"
    ppid = os.getppid()
    starter = env_text(PID_ENV, "")
    if starter != str(ppid):
        return (f"its parent process ({ppid}) is not the benchmark that set {ENV} "
                f"({PID_ENV}={starter or 'unset'}): the variables were inherited or copied")
    try:
        own = _namespace()
        parents = _namespace(ppid)
    except LinkRateError as e:
        return str(e)
    if own == parents:
        return f"it is in its parent's network namespace ({own})"
    recorded = env_text(PARENT_ENV, "")
    if parents != recorded:
        return (f"its parent is in network namespace {parents}, not the one the benchmark recorded "
                f"({PARENT_ENV}={recorded or 'unset'})")
    return None


def _require_tools() -> None:
    if not sys.platform.startswith("linux"):
        raise LinkRateError(f"--link-rate needs Linux network namespaces; this is {sys.platform}. "
                            "Run without --link-rate (plain loopback).")
    missing = [t for t, pkg in (("unshare", "util-linux"), ("ip", "iproute2"), ("tc", "iproute2"))
               if shutil.which(t) is None]
    if missing:
        raise LinkRateError(f"--link-rate needs {', '.join(missing)} on PATH (packages util-linux, iproute2); "
                            "install them or run without --link-rate (plain loopback).")
    if os.geteuid() != 0:
        raise LinkRateError(
            f"--link-rate needs root to create a network namespace and shape its loopback with tc (this process "
            f"runs as uid {os.geteuid()}). Run it as root, e.g. `sudo -E env PATH=\"$PATH\" commfuse bench "
            "--link-rate RATE ...`, or drop --link-rate to measure on plain loopback."
        )


def _namespace(pid: int | str = "self") -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError as e:
        who = "this process" if pid == "self" else f"process {pid}"
        raise LinkRateError(f"cannot tell which network namespace {who} is in ({e})") from e


def reexec(argv: list[str], rate: str, module: str = "commfuse.bench") -> int:
    """Run ``python -m MODULE ARGV`` (the benchmark, or ``commfuse.sim``'s calibration) in a new network
    namespace shaped to ``rate``; its exit status.

    SIGTERM, SIGHUP and SIGINT sent to this process are passed on (see
    :func:`run_forwarding_signals`).
    """
    parse_rate(rate)
    _require_tools()
    if env_text(ENV) and env_text(PID_ENV) == str(os.getppid()):
        # our parent re-executed us, yet the namespaces do not agree: another unshare would only recurse
        raise LinkRateError(
            f"this benchmark was re-executed in a private network namespace by its parent, but cannot confirm "
            f"it: {not_inside_because() or f'it runs at {env_text(ENV)}, not {rate}'}. Refusing to start "
            "another; run without --link-rate (plain loopback)."
        )
    env = dict(os.environ, **{ENV: rate, PARENT_ENV: _namespace(), PID_ENV: str(os.getpid())})
    cmd = ["unshare", "--net", "--", sys.executable, "-m", module, *argv]
    try:
        return run_forwarding_signals(cmd, env)
    except OSError as e:
        raise LinkRateError(f"could not start {' '.join(cmd[:3])}: {e}") from e


def run_forwarding_signals(cmd: Sequence[str], env: dict[str, str] | None = None, *,
                           grace_s: float = FORWARD_GRACE_S) -> int:
    """Run ``cmd`` and pass :data:`FORWARDED` signals on to it; its exit status (128 + N if signal N ended it).

    The child runs in a session, so a process group, of its own, and every
    forwarded signal goes to that whole group: the child and whatever it
    started (the benchmark's ranks). Each signal reaches it once, a terminal's
    Ctrl-C too, which the terminal sends only to this process's group. A signal
    this process ignores (``nohup``, a background job's SIGINT) stays ignored
    and is not passed on. After the first forwarded signal the child gets
    ``grace_s`` seconds to exit, then the group is killed. Outside the main
    thread (where no handler can be installed) the child simply runs. The
    previous handlers are restored before returning.
    """
    proc: subprocess.Popen | None = None
    received: list[int] = []
    held: list[int] = []

    def forward(signum, frame) -> None:
        received.append(signum)
        if proc is None:
            held.append(signum)
        else:
            _signal_group(proc, signum)

    previous: dict[int, object] = {}
    try:
        try:
            for signum in FORWARDED:  # before the child exists: a signal in between is held, then passed on
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    previous[signum] = signal.signal(signum, forward)
        except ValueError:  # not the main thread
            pass
        proc = subprocess.Popen(list(cmd), env=env, start_new_session=True)
        while held:
            _signal_group(proc, held.pop(0))
        deadline = None
        while True:
            try:
                proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if received and deadline is None:
                deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() >= deadline:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
                break
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    code = proc.returncode
    return 128 - code if code < 0 else code


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    if proc.returncode is not None:  # reaped: its id (and group id) may belong to someone else now
        return
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass


def shape_loopback(rate: str) -> str:
    """Bring ``lo`` up in this (private) namespace and limit it to ``rate``; the qdisc as ``tc`` shows it."""
    burst = burst_bytes(parse_rate(rate))
    why = not_inside_because()
    if why is not None:
        raise LinkRateError(
            f"this process is not in a private network namespace that --link-rate created ({why}): refusing to "
            f"shape that loopback. Unset {ENV}, {PARENT_ENV} and {PID_ENV}; --link-rate starts its own namespace."
        )
    commands = [
        ["ip", "link", "set", "lo", "up"],
        ["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", rate, "burst", str(burst),
         "latency", "400ms"],
    ]
    for cmd in commands:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise LinkRateError(
                f"`{' '.join(cmd)}` failed with exit status {done.returncode}: {done.stderr.strip() or done.stdout}"
                " (unshare --net gave this process its own namespace; is CAP_NET_ADMIN missing?)"
            )
    shown = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True)
    return shown.stdout.strip()
