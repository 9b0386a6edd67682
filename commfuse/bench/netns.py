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

Needs root (or CAP_SYS_ADMIN + CAP_NET_ADMIN), ``unshare`` (util-linux), ``ip``
and ``tc`` (iproute2). Imports no torch.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from commfuse.errors import CommfuseError, CommfuseValueError

#: Set in the re-executed benchmark: the rate its namespace's loopback is shaped to.
ENV = "COMMFUSE_BENCH_NETNS_RATE"
#: ... and the network namespace it was started from, which it must not be in.
PARENT_ENV = "COMMFUSE_BENCH_NETNS_PARENT"

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
    """The rate of the shaped namespace this process runs in, or None."""
    return os.environ.get(ENV) or None


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


def _namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError as e:
        raise LinkRateError(f"cannot tell which network namespace this process is in ({e})") from e


def reexec(argv: list[str], rate: str) -> int:
    """Run ``python -m commfuse.bench ARGV`` in a new network namespace shaped to ``rate``; its exit status."""
    parse_rate(rate)
    _require_tools()
    env = dict(os.environ, **{ENV: rate, PARENT_ENV: _namespace()})
    cmd = ["unshare", "--net", "--", sys.executable, "-m", "commfuse.bench", *argv]
    try:
        return subprocess.call(cmd, env=env)
    except OSError as e:
        raise LinkRateError(f"could not start {' '.join(cmd[:3])}: {e}") from e


def shape_loopback(rate: str) -> str:
    """Bring ``lo`` up in this (private) namespace and limit it to ``rate``; the qdisc as ``tc`` shows it."""
    burst = burst_bytes(parse_rate(rate))
    own, parent = _namespace(), os.environ.get(PARENT_ENV, "")
    if not parent or own == parent:
        raise LinkRateError(
            f"{ENV} is set but this process is not in a namespace of its own (it is in {own}, the process that "
            f"set {ENV} in {parent or 'an unknown one'}): refusing to shape that loopback. Unset {ENV}; "
            "--link-rate starts its own namespace."
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
