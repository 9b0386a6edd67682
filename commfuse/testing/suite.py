"""The conformance suite's abstract test classes; subclass :class:`ConformanceSuite` (or single tiers).

Tiers: transport (ring shifts both ways, pairwise exchange at every distance,
self-exchange, large messages), schedules (every collective x algorithm x
dtype against the reference, bit-exact for moved data and integer-valued
sums, within tolerance otherwise), ops and autograd (the fused ops and the
layers' gradients against unsharded references), robustness (mismatched
shapes or algorithms, an absent peer, a peer killed mid-schedule: every
surviving rank ends in an error within the timeout), overlap (the fraction of
ring communication hidden, against the capability's threshold) and
determinism (same inputs, same outputs).
"""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

from commfuse.testing import _bodies
from commfuse.testing.capabilities import Capabilities

ALL_DTYPES = ("float32", "bfloat16", "float16", "float64")
ALL_ALGORITHMS = ("ring", "ring:2", "bidirectional", "sliced:2", "sliced:4", "vanilla")
ROBUSTNESS = ("mismatched-shapes", "mismatched-algorithms", "absent-peer", "peer-death")


def cases(tier: str, n: int) -> list[str]:
    """Every case name a tier can have at world size n (those the capabilities exclude are skipped)."""
    if tier == "transport":
        return (["ring-shift-forward", "ring-shift-backward", "ring-shift-both-directions"]
                + [f"pairwise-distance-{k}" for k in range(1, n)] + ["large-message", "self-exchange"])
    if tier == "schedules":
        return [f"{c}-{a}-{d}-{t}" for c in ("all_gather", "reduce_scatter", "all_to_all") for a in ALL_ALGORITHMS
                for d in ALL_DTYPES for t in ("exact", "tolerance")]
    if tier == "ops":
        return ([f"{o}-{a}-{d}-{t}" for o in ("all_gather_matmul", "matmul_reduce_scatter") for a in ALL_ALGORITHMS
                 for d in ALL_DTYPES for t in ("exact", "tolerance")]
                + [f"autograd-{w}-{a}" for w in ("mlp", "ops") for a in ("ring", "vanilla")])
    if tier == "determinism":
        return [f"determinism-{a}" for a in ALL_ALGORITHMS]
    if tier == "overlap":
        return ["ring-hides-communication"]
    if tier == "robustness":
        return list(ROBUSTNESS)
    raise ValueError(f"unknown conformance tier {tier!r}")


_RESULTS: dict[tuple, list] = {}


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def _execute(body, n: int, *args, timeout: float = 900.0, allow_failures: bool = False) -> list:
    """Run ``body(rank, n, *args)`` on every rank: launched here, or in place under torchrun."""
    if _under_torchrun():
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group(init_method="env://")
        mine = body(dist.get_rank(), dist.get_world_size(), *args)
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, mine)
        return out
    from commfuse.launch import launch

    caps = args[1] if len(args) > 1 else {}
    return launch(body, n, *args, timeout=timeout, backend=caps.get("dist_backend", "gloo"),
                  allow_failures=allow_failures)


def _skip_reason(case: str, caps: Capabilities) -> str | None:
    for alg in ALL_ALGORITHMS:
        if f"-{alg}-" in f"-{case}-" and alg not in caps.algorithms:
            return f"capability: algorithm {alg!r} not in this backend's algorithms"
    for dtype in ALL_DTYPES:
        if f"-{dtype}-" in f"-{case}-" and dtype not in caps.dtypes:
            return f"capability: dtype {dtype!r} not in this backend's dtypes"
    if case.startswith("autograd-") and not caps.autograd:
        return "capability: autograd is off for this backend"
    return None


class _Tier:
    @pytest.fixture(autouse=True)
    def _commfuse(self, commfuse_backend_name, commfuse_world_size, commfuse_capabilities):
        self.backend, self.world_size, self.caps = commfuse_backend_name, commfuse_world_size, commfuse_capabilities

    def _result(self, tier: str, case: str, record_property) -> None:
        reason = _skip_reason(case, self.caps)
        if reason:
            pytest.skip(reason)
        key = (tier, self.backend, self.world_size, tuple(sorted(self.caps.as_dict().items())))
        if key not in _RESULTS:
            body = _bodies.TIERS[tier]
            _RESULTS[key] = _execute(body, self.world_size, self.backend, self.caps.as_dict())
        failures = []
        for rank, results in enumerate(_RESULTS[key]):
            entry = results.get(case)
            if entry is None:
                failures.append(f"rank {rank}: case did not run")
                continue
            for name, value in entry["figures"].items():
                record_property(f"rank{rank}.{name}", value)
            if entry["error"]:
                failures.append(f"rank {rank}: {entry['error']}")
        if failures:
            pytest.fail("\n".join(failures), pytrace=False)


class TransportTests(_Tier):
    """Raw transfers through the backend's ``post``/``wait``."""


    @pytest.mark.commfuse_tier("transport")
    def test_transport(self, commfuse_case, record_property):
        self._result("transport", commfuse_case, record_property)


class ScheduleTests(_Tier):
    """Every collective x algorithm x dtype through the executor, against the references."""


    @pytest.mark.commfuse_tier("schedules")
    def test_schedule(self, commfuse_case, record_property):
        self._result("schedules", commfuse_case, record_property)


class OpsTests(_Tier):
    """The fused ops and the layers' gradients against unsharded references."""


    @pytest.mark.commfuse_tier("ops")
    def test_op(self, commfuse_case, record_property):
        self._result("ops", commfuse_case, record_property)


class DeterminismTests(_Tier):

    @pytest.mark.commfuse_tier("determinism")
    def test_determinism(self, commfuse_case, record_property):
        self._result("determinism", commfuse_case, record_property)


class OverlapTests(_Tier):
    """The measured fraction of ring communication hidden; the capability's threshold decides."""


    @pytest.mark.commfuse_tier("overlap")
    def test_overlap(self, commfuse_case, record_property):
        self._result("overlap", commfuse_case, record_property)


class RobustnessTests(_Tier):
    """Faults and bad calls end in errors on every surviving rank within the timeout, never in a hang."""


    @pytest.mark.commfuse_tier("robustness")
    def test_robustness(self, commfuse_case, record_property):
        caps, n = self.caps, self.world_size
        if _under_torchrun():
            pytest.skip("fault injection launches its own ranks; run `commfuse conformance` without torchrun")
        if commfuse_case == "peer-death" and not caps.survives_peer_death:
            pytest.skip("capability: survives_peer_death is off for this backend")
        if commfuse_case == "absent-peer" and n < 2:
            pytest.skip("needs two ranks")
        limit = caps.timeout_s
        before = _children()
        out = _execute(_bodies.robustness, n, self.backend, caps.as_dict(), commfuse_case,
                       timeout=4 * limit + 60, allow_failures=True)
        record_property("seconds_per_rank", [None if isinstance(o, str) else round(o[2], 2) for o in out])
        leftover = _children() - before
        deadline = time.monotonic() + 30  # a loaded machine may still be reaping ranks that just exited
        while leftover and time.monotonic() < deadline:
            time.sleep(0.5)
            leftover = _children() - before
        assert not leftover, f"processes left behind 30 s after the launch returned: {sorted(leftover)}"
        if commfuse_case == "peer-death":
            assert isinstance(out[1], str) and "died" in out[1], f"rank 1 should have been killed: {out[1]}"
            survivors = [r for r in range(n) if r != 1]
        elif commfuse_case == "absent-peer":
            survivors = [r for r in range(n) if r != 1]
        else:
            survivors = list(range(n))
        for rank in survivors:
            kind, message, seconds = out[rank]
            assert kind in ("MismatchError", "CommfuseTimeoutError", "CommunicationError"), (
                f"rank {rank} ended with {kind!r} instead of a commfuse error: {message}")
            assert seconds <= 2 * limit + 10, f"rank {rank} took {seconds:.1f} s, over twice the {limit} s timeout"
            assert f"rank {rank}" in message, f"rank {rank}'s error does not name it: {message}"
        if commfuse_case == "mismatched-shapes":
            for rank in {1, n - 1}:
                kind, message, _ = out[rank]
                assert kind == "MismatchError" and "rank 0" in message, (rank, message)
        if commfuse_case == "mismatched-algorithms":
            kinds = {out[r][0] for r in survivors}
            assert "MismatchError" in kinds, kinds
        if commfuse_case in ("absent-peer", "peer-death"):
            for rank in survivors:  # who waited, in which step, on which peer
                _, message, _ = out[rank]
                assert re.search(r"step \d+", message) and re.search(r"(from|to|with) ranks? \d", message), (
                    rank, message)


def _children() -> set[int]:
    """Child processes of this process, zombies included, but for multiprocessing's resource tracker
    (started with the first launch and meant to outlive it): no rank may outlive its launch."""
    try:
        text = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(os.getpid())], capture_output=True,
                              text=True).stdout
    except FileNotFoundError:  # pragma: no cover - no ps
        return set()
    pids = set()
    for line in text.splitlines():
        pid, _, args = line.strip().partition(" ")
        if pid and "resource_tracker" not in args and not args.startswith("ps "):
            pids.add(int(pid))
    return pids


class ConformanceSuite(TransportTests, ScheduleTests, OpsTests, DeterminismTests, OverlapTests, RobustnessTests):
    """Every tier. A vendor's test module: ``class TestConformance(ConformanceSuite): pass``."""
