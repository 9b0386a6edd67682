"""The conformance suite's abstract test classes; subclass :class:`ConformanceSuite` (or single tiers).

Tiers: transport (ring shifts both ways, pairwise exchange at every distance,
self-exchange, large messages), schedules (every collective x algorithm x
dtype against the reference, bit-exact for moved data and integer-valued
sums, within tolerance otherwise; the all-to-alls, consume and produce side,
also over blocks of different sizes with empty ones among them), ops and
autograd (the fused ops and the layers' gradients against unsharded
references; all_to_all_consume and produce_all_to_all over uneven splits,
given or exchanged, with a rank that receives nothing, one that sends
nothing and all blocks empty, bit-exact; and, through a wrapper of the
backend's ``post``, that an empty block is never posted; and an uneven
all-to-all, one rank's blocks all one size, as the first of a new group),
robustness (each case its
own launch, so it runs outside torchrun: mismatched shapes or algorithms, an
absent peer, a peer killed mid-schedule: every surviving rank ends in an error
within the timeout; two threads on one group: refused or exact, never wrong,
never hung; a rank one call ahead after a failed call: never pairs across the
gap; an error every rank shares leaves the group usable; a mismatch reaches
every rank in seconds, not at the timeout; one rank's producer or consumer
raises, before its first transfer or later: its peers are told by name within
half the timeout or return exactly the reference, and the group ends by name
or stays usable; in-place consumers change no input and no other result;
``output_splits`` that lie raise on the liar only; a straggler is named late
by its peers and hears it was late), overlap (the time a ring hides
over the most it could hide, ``min(compute, comm)``, against the capability's
threshold), determinism (same inputs, same outputs) and capture (where the
backend declares ``Capabilities.capturable``: all_gather_matmul and
matmul_reduce_scatter, ring and vanilla, captured in a device graph after an
eager warm-up, by the suite's own ``torch.cuda.graph`` and by
``commfuse.graphs.capture``, replayed with new values copied into the static
inputs and compared with eager calls on them: bit-exact for the gathers,
within tolerance for the sums; and a graphed forward and backward) and
traced (for a backend whose ranks are the devices of one traced program,
which the other tiers skip by ``Capabilities.traced_runner``: every op and
algorithm, forward and backward, float32 and bfloat16, run as one program by
the backend's runner against the reference semantics, bit-exact on integer
inputs, within tolerance for ring attention; and the backend's own check of
what it lowered, ``traced-check``).
"""

from __future__ import annotations

import os
import re
import time

import pytest

from commfuse.launch import running_ranks
from commfuse.schedule import parse_algorithm
from commfuse.testing import _bodies, traced as _traced
from commfuse.testing.capabilities import Capabilities

ALL_DTYPES = ("float32", "bfloat16", "float16", "float64")
ALL_ALGORITHMS = ("ring", "ring:2", "bidirectional", "sliced:2", "sliced:4", "vanilla")
#: The all-to-all collectives (consume and produce sides) and the algorithms they have: no bidirectional
#: ring, the pairwise exchange has no direction to split.
A2A_COLLECTIVES = ("all_to_all", "produce_all_to_all")
A2A_ALGORITHMS = tuple(a for a in ALL_ALGORITHMS if parse_algorithm(a).name != "bidirectional")
ROBUSTNESS = ("mismatched-shapes", "mismatched-algorithms", "absent-peer", "peer-death", "two-threads-one-group",
              "skipped-call", "symmetric-consumer-error", "mismatch-promptness", "producer-raises-first",
              "producer-raises-later", "consumer-raises-first", "consumer-raises-last", "in-place-consumer",
              "lying-split", "straggler")


def cases(tier: str, n: int) -> list[str]:
    """Every case name a tier can have at world size n (those the capabilities exclude are skipped)."""
    if tier == "transport":
        return (["ring-shift-forward", "ring-shift-backward", "ring-shift-both-directions"]
                + [f"pairwise-distance-{k}" for k in range(1, n)] + ["large-message", "self-exchange"])
    if tier == "schedules":
        return ([f"{c}-{a}-{d}-{t}" for c in ("all_gather", "reduce_scatter") for a in ALL_ALGORITHMS
                 for d in ALL_DTYPES for t in ("exact", "tolerance")]
                + [f"{c}-{a}-{d}-{t}" for c in A2A_COLLECTIVES for a in A2A_ALGORITHMS for d in ALL_DTYPES
                   for t in ("exact", "tolerance")]
                + [f"{c}-uneven-{a}-{d}" for c in A2A_COLLECTIVES for a in A2A_ALGORITHMS for d in ALL_DTYPES])
    if tier == "ops":
        return ([f"{o}-{a}-{d}-{t}" for o in ("all_gather_matmul", "matmul_reduce_scatter") for a in ALL_ALGORITHMS
                 for d in ALL_DTYPES for t in ("exact", "tolerance")]
                + [f"autograd-{w}-{a}" for w in ("mlp", "ops") for a in ("ring", "vanilla")]
                + _bodies.uneven_op_cases(A2A_ALGORITHMS, ALL_DTYPES))
    if tier == "determinism":
        return [f"determinism-{a}" for a in ALL_ALGORITHMS]
    if tier == "overlap":
        return ["ring-hides-communication"]
    if tier == "capture":
        return _bodies.capture_cases()
    if tier == "robustness":
        return list(ROBUSTNESS)
    if tier == "traced":
        return _traced.cases(ALL_ALGORITHMS, ALL_DTYPES) + ["traced-check"]
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


def _skip_traced(caps: Capabilities) -> None:
    """The tiers that launch ranks skip a backend whose ranks are one traced program (``traced_runner``)."""
    if getattr(caps, "traced_runner", None) or getattr(caps, "traced_check", None):
        pytest.skip("capability: traced_runner is set: this backend's ranks are the devices of one traced program, "
                    "not processes the suite launches; the traced tier checks it")


class _Tier:
    @pytest.fixture(autouse=True)
    def _commfuse(self, commfuse_backend_name, commfuse_world_size, commfuse_capabilities):
        self.backend, self.world_size, self.caps = commfuse_backend_name, commfuse_world_size, commfuse_capabilities

    def _result(self, tier: str, case: str, record_property) -> None:
        _skip_traced(self.caps)
        reason = _skip_reason(case, self.caps)
        if reason:
            pytest.skip(reason)
        key = (tier, self.backend, self.world_size, tuple(sorted(self.caps.as_dict().items())))
        if key not in _RESULTS:
            body = _bodies.TIERS[tier]
            _RESULTS[key] = _execute(body, self.world_size, self.backend, self.caps.as_dict())
        failures, skips = [], []
        for rank, results in enumerate(_RESULTS[key]):
            entry = results.get(case)
            if entry is None:
                failures.append(f"rank {rank}: case did not run")
                continue
            for name, value in entry["figures"].items():
                record_property(f"rank{rank}.{name}", value)
            if entry["error"]:
                failures.append(f"rank {rank}: {entry['error']}")
            elif entry.get("skip"):  # a capability the ranks found on the backend object itself
                skips.append(entry["skip"])
        if failures:
            pytest.fail("\n".join(failures), pytrace=False)
        if skips:
            pytest.skip(skips[0])


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
    """The time the ring hides over the most it could hide (the shorter of compute-only and comm-only), with
    the old figure (over comm-only) for reference; the capability's threshold decides."""


    @pytest.mark.commfuse_tier("overlap")
    def test_overlap(self, commfuse_case, record_property):
        self._result("overlap", commfuse_case, record_property)


class CaptureTests(_Tier):
    """Planned calls captured in a device graph replay right with new inputs; only where the backend declares
    ``Capabilities.capturable`` (read from its plugin record, or from the backend object the ranks make for a
    ``module:factory`` reference), skipped by that capability elsewhere."""


    @pytest.mark.commfuse_tier("capture")
    def test_capture(self, commfuse_case, record_property):
        _skip_traced(self.caps)
        reason = declared_capture_skip(self.backend)
        if reason:
            pytest.skip(reason)
        self._result("capture", commfuse_case, record_property)


def declared_capture_skip(ref: str) -> str | None:
    """For a registered backend name, why the capture tier skips it, from its plugin record (no ranks are
    launched to find out); None when it runs, or when ``ref`` is a ``module:factory`` (the ranks decide)."""
    if ":" in ref:
        return None
    from commfuse import backends
    from commfuse.errors import BackendUnavailableError

    try:
        spec = backends.spec(ref)
    except BackendUnavailableError:
        return None  # the ranks fail to make it, and say why
    return _bodies.capture_skip_reason(spec.capabilities, ref)


class RobustnessTests(_Tier):
    """Faults and bad calls end in errors on every surviving rank within the timeout, never in a hang or a
    wrong result; threads sharing a group are refused, never mixed; a failure every rank shares leaves the
    group usable; a failure on one rank is told to the peers that need its data, by name, long before the
    timeout. Each case is its own launch (``commfuse.launch``), so this tier runs outside torchrun."""


    @pytest.mark.commfuse_tier("robustness")
    def test_robustness(self, commfuse_case, record_property):
        caps, n = self.caps, self.world_size
        _skip_traced(caps)
        if _under_torchrun():
            pytest.skip(torchrun_skip_reason(self.backend, n, caps))
        if commfuse_case == "peer-death" and not caps.survives_peer_death:
            pytest.skip("capability: survives_peer_death is off for this backend")
        need = _bodies.ROBUSTNESS_MIN_WORLD.get(commfuse_case, 1)
        if n < need:
            pytest.skip(_WORLD_REASONS.get(commfuse_case, f"needs world size >= {need}") + f" (world size {n})")
        limit = caps.timeout_s
        before = running_ranks()
        out = _execute(_bodies.robustness, n, self.backend, caps.as_dict(), commfuse_case,
                       timeout=_LAUNCH_BOUNDS.get(commfuse_case, lambda t: 4 * t + 60)(limit), allow_failures=True)
        record_property("seconds_per_rank", [round(o["seconds"], 2) if isinstance(o, dict) else None for o in out])
        for rank, o in enumerate(out):
            if isinstance(o, dict):
                for name, value in o["figures"].items():
                    record_property(f"rank{rank}.{name}", value)
        leftover = running_ranks() - before
        deadline = time.monotonic() + 30  # a loaded machine may still be reaping ranks that just exited
        while leftover and time.monotonic() < deadline:
            time.sleep(0.5)
            leftover = running_ranks() - before
        assert not leftover, f"processes left behind 30 s after the launch returned: {sorted(leftover)}"
        failures = judge_robustness(commfuse_case, out, limit)
        if failures:
            pytest.fail("\n".join(failures), pytrace=False)


_WORLD_REASONS = {
    "absent-peer": "needs two ranks",
    "mismatch-promptness": ("needs world size >= 4, so that rank 0 is not a ring neighbour of the mismatched "
                            "rank 2 and must learn of the mismatch through the others"),
}
#: Launch bound per case, from the capability's timeout: what the case may take at worst, plus start-up.
_LAUNCH_BOUNDS = {
    "two-threads-one-group": lambda t: 6 * t + 60,
    "mismatch-promptness": lambda t: 4 * max(t, _bodies.PROMPTNESS_TIMEOUT_S) + 60,
    "straggler": lambda t: (_bodies.STRAGGLER_LATE + 4) * t + 60,  # rank 1 sleeps first
}
#: A survivor that hears of a dead peer from the group's board (not beside it: from 4 ranks) raises
#: GroupDeadError, the CommunicationError of a group another rank declared dead.
_COMMFUSE_ERRORS = ("MismatchError", "CommfuseTimeoutError", "CommunicationError", "GroupDeadError")
#: The errors with which commfuse's watchdog ends a rank (``commfuse.runtime.watchdog``; the launcher reports
#: them as ``FAILED: <kind>: <message>``): a host held in a post past its deadline, a transfer that failed.
_WATCHDOG_ENDS = ("CommfuseTimeoutError", "CommunicationError")


def torchrun_skip_reason(backend: str, n: int, caps: Capabilities) -> str:
    """Why the robustness tier skips under torchrun, and the command that runs it."""
    command = f"commfuse conformance --backend {backend} --world-size {n} --tier robustness"
    if type(caps) is not Capabilities:
        command += f" --capabilities {type(caps).__module__}:{type(caps).__qualname__}"
    one_gpu = ""
    if caps.dist_backend == "nccl":
        one_gpu = " (on a host with fewer GPUs than ranks, prefix COMMFUSE_NCCL_HOST_PER_RANK=1)"
    return ("the robustness tier launches fresh ranks of its own for every case (commfuse.launch; it kills one, "
            "starves one), which it cannot do from inside a torchrun job; run the tier outside torchrun, on one "
            f"host, with: {command}{one_gpu}")


def _line_naming(rank: int) -> re.Pattern:
    """A fingerprint line of a MismatchError that names ``rank`` alone (``rank 2: call #...`` or
    ``rank 2 (this rank): call #...``)."""
    return re.compile(rf"(^|\n)\s*rank {rank}( \(this rank\))?: call #")


#: What a peer of a rank whose call failed raises when told (every one a commfuse ``CommunicationError``).
_TOLD = ("PeerFailedError", "GroupDeadError", "MismatchError", "CommfuseTimeoutError", "CommunicationError")
#: The one-rank cases in which rank 1's compute raises, and the op it raises in.
_COMPUTE_FAULTS = {"producer-raises-first": "produce_reduce_scatter", "producer-raises-later": "produce_reduce_scatter",
                   "consumer-raises-first": "all_gather_consume", "consumer-raises-last": "all_gather_consume"}


def _names(rank: int, message: str) -> bool:
    return re.search(rf"\brank {rank}\b", message) is not None


def judge_robustness(case: str, out: list, limit: float) -> list[str]:
    """Every way the ranks' outcomes of one robustness case break the rules, as sentences (none: it passed).

    ``out[rank]`` is what ``_bodies.robustness`` returned on that rank (a
    dict), or the launcher's ``"FAILED: ..."`` text for a rank that raised,
    died or did not finish; ``limit`` is the capability's timeout in seconds.
    """
    n = len(out)
    failures: list[str] = []
    ranks = list(range(n))
    if case == "peer-death":
        if not (isinstance(out[1], str) and "died" in out[1]):
            failures.append(f"rank 1 should have been killed: {out[1]}")
        ranks = [r for r in ranks if r != 1]
    elif case == "absent-peer":
        ranks = [r for r in ranks if r != 1]
    # the backend ends the group on one rank's failure rather than completing the call (its capability, as the
    # ranks that reported say)
    ending = any(isinstance(o, dict) and o["figures"].get("survives") is False for o in out)
    for rank in ranks:
        o = out[rank]
        # a stream-ordered backend's survivor whose host was held inside the transport (NCCL setting up a
        # pair with a peer that never came) is ended by commfuse's watchdog at the deadline, which reports
        # the named error as the rank's result before the process exits
        ended = next((k for k in _WATCHDOG_ENDS if isinstance(o, str) and o.startswith(f"FAILED: {k}: ")), None)
        if case in ("absent-peer", "peer-death") and ended:
            out[rank] = {"kind": ended, "message": o[len(f"FAILED: {ended}: "):], "seconds": 0.0,
                         "problems": [], "figures": {}}
        elif case in _COMPUTE_FAULTS and rank != 1 and isinstance(o, str) and ending:
            # the watchdog of a stream-ordered backend whose group may end (group_survives_one_rank_failure
            # off) ends a told peer's process with the named error: that rank was told, by name
            told = next((k for k in _TOLD if o.startswith(f"FAILED: {k}: ")), None)
            if told:
                out[rank] = {"kind": told, "message": o[len(f"FAILED: {told}: "):], "seconds": 0.0,
                             "problems": [], "figures": {"survives": False, "before": ["right"], "after": [told]}}
            else:
                failures.append(f"rank {rank} did not report: {o}")
        elif not isinstance(o, dict):
            failures.append(f"rank {rank} did not report: {o}")
    if failures:
        return failures
    for rank in ranks:
        for problem in out[rank]["problems"]:
            failures.append(f"rank {rank}: {problem}")

    def ended_in_error(rank: int, kinds, bound: float) -> None:
        o = out[rank]
        kind, message, seconds = o["kind"], o["message"], o["seconds"]
        if kind not in kinds:
            failures.append(f"rank {rank} ended with {kind!r} instead of one of {list(kinds)}: {message}")
        if seconds > bound:
            failures.append(f"rank {rank} took {seconds:.1f} s, over {bound:g} s")
        if f"rank {rank}" not in message:
            failures.append(f"rank {rank}'s error does not name it: {message}")

    def no_error(rank: int) -> None:
        if out[rank]["kind"] != "no error":
            failures.append(f"rank {rank} ended with {out[rank]['kind']}: {out[rank]['message']}")

    if case in ("mismatched-shapes", "mismatched-algorithms", "absent-peer", "peer-death"):
        for rank in ranks:
            ended_in_error(rank, _COMMFUSE_ERRORS, 2 * limit + 10)
        if case == "mismatched-shapes":
            for rank in {1, n - 1}:
                o = out[rank]
                if not (o["kind"] == "MismatchError" and "rank 0" in o["message"]):
                    failures.append(f"rank {rank} should name rank 0 in a MismatchError: {o['kind']}: {o['message']}")
        if case == "mismatched-algorithms" and "MismatchError" not in {out[r]["kind"] for r in ranks}:
            failures.append(f"no rank raised MismatchError: {[out[r]['kind'] for r in ranks]}")
        if case in ("absent-peer", "peer-death"):
            for rank in ranks:  # who waited, in which step, on which peer
                message = out[rank]["message"]
                if not (re.search(r"step \d+", message) and re.search(r"(from|to|with) ranks? \d", message)):
                    failures.append(f"rank {rank}'s error does not name the step and the peer: {message}")
    elif case == "two-threads-one-group":
        for rank in ranks:
            no_error(rank)
            counts = out[rank]["figures"]
            if counts.get("wrong", 1) or counts.get("other", 1):
                failures.append(f"rank {rank}: {counts.get('wrong')} wrong results and {counts.get('other')} "
                                f"unexpected outcomes (counts {counts})")
            if not counts.get("refused") or not (counts.get("race_correct") or counts.get("race_named")):
                failures.append(f"rank {rank}: the case did not run both phases (counts {counts})")
    elif case == "skipped-call":
        for rank in ranks:
            ended_in_error(rank, ("MismatchError", "CommfuseTimeoutError"), 2 * limit)
            kind, message = out[rank]["kind"], out[rank]["message"]
            if kind == "MismatchError":
                if not _line_naming(1).search(message):
                    failures.append(f"rank {rank}'s MismatchError does not name rank 1 on a line of its own: {message}")
                if "skipped or added a call" not in message:
                    failures.append(f"rank {rank}'s MismatchError does not say the ranks are at different calls: "
                                    f"{message}")
            elif kind == "CommfuseTimeoutError" and not re.search(r"step \d+|call check", message):
                failures.append(f"rank {rank}'s timeout does not name the step it waited in: {message}")
    elif case == "symmetric-consumer-error":
        for rank in ranks:
            no_error(rank)
    elif case == "mismatch-promptness":
        timeout = max(_bodies.PROMPTNESS_TIMEOUT_S, limit)
        bound = min(_bodies.PROMPTNESS_BOUND_S, timeout / 4)
        for rank in ranks:
            ended_in_error(rank, ("MismatchError",), bound)
            if not _line_naming(2).search(out[rank]["message"]):
                failures.append(f"rank {rank}'s MismatchError does not name rank 2 on a line of its own: "
                                f"{out[rank]['message']}")
    elif case in _COMPUTE_FAULTS or case in ("in-place-consumer", "lying-split", "straggler"):
        failures += _judge_one_rank(case, out, limit)
    else:
        failures.append(f"no rules for robustness case {case!r}")
    return failures


def _judge_one_rank(case: str, out: list, limit: float) -> list[str]:
    """The rules of the cases in which one rank (1) fails, is misled or is late (see :func:`judge_robustness`)."""
    failures: list[str] = []
    fault = _bodies.InjectedFault.__name__
    told_within = limit / 2  # a peer told through the group's board, not one that waited the fault out

    def told(rank: int, kinds, *words: str) -> None:
        """Rank ``rank`` raised one of ``kinds``, naming rank 1 and ``words``, within half the timeout."""
        kind, message, seconds = out[rank]["kind"], out[rank]["message"], out[rank]["seconds"]
        if kind not in kinds:
            failures.append(f"rank {rank} ended with {kind!r} instead of one of {list(kinds)} naming rank 1: "
                            f"{message}")
        if not _names(1, message):
            failures.append(f"rank {rank}'s error does not name rank 1, the rank that failed: {message}")
        for word in words:
            if word not in message:
                failures.append(f"rank {rank}'s error does not name {word}: {message}")
        if seconds > told_within:
            failures.append(f"rank {rank} took {seconds:.1f} s to raise, over half the timeout ({told_within:g} s): "
                            "it waited the fault out instead of being told")

    def raised_own(rank: int, kind: str) -> None:
        o = out[rank]
        if o["kind"] != kind:
            failures.append(f"rank {rank} ended with {o['kind']!r} instead of its own {kind}: {o['message']}")

    def right(rank: int) -> None:
        """Rank ``rank``'s faulty call returned exactly the reference."""
        o = out[rank]
        if o["kind"] != "no error":
            failures.append(f"rank {rank} ended with {o['kind']!r} instead of returning its result: {o['message']}")
        elif o["figures"].get("result") != "right":
            failures.append(f"rank {rank} returned a result that differs from the reference "
                            f"({o['figures'].get('result')})")

    def after(rank: int, calls: int, dead_allowed: bool) -> None:
        """The plain calls after the fault: exactly right (or, where the group may be dead, a commfuse error)."""
        went = out[rank]["figures"].get("after", [])
        ok = [w == "right" or (dead_allowed and w in _TOLD) for w in went]
        if len(went) < (1 if dead_allowed else calls) or not all(ok):
            why = out[rank]["figures"].get("after_error", "")
            want = "right or a commfuse error (the group is dead)" if dead_allowed else "exactly right"
            failures.append(f"rank {rank}: the plain calls after the fault went {went}, each should be {want}"
                            + (f": {why}" if why else ""))

    def before(rank: int) -> None:
        if out[rank]["figures"].get("before", ["right"]) != ["right"]:
            failures.append(f"rank {rank}: the call before the fault went {out[rank]['figures']['before']}")

    n = len(out)
    if case in _COMPUTE_FAULTS:
        op = _COMPUTE_FAULTS[case]
        first = case == "producer-raises-first"
        for rank in range(n):
            before(rank)
            # a stream-ordered backend ends the group instead of completing the call (its capability says so)
            survives = out[rank]["figures"].get("survives", True)
            if rank == 1:
                raised_own(rank, fault)
            elif first or not survives and out[rank]["kind"] != "no error":
                told(rank, _TOLD, fault)  # rank 1 never took part, or the group ended: every peer is told
            elif out[rank]["kind"] != "no error":  # told, by name, or unaffected
                told(rank, ("PeerFailedError",), op, fault)
            else:
                right(rank)
            after(rank, 1 if first else 2, dead_allowed=first or not survives)
    elif case == "in-place-consumer":
        for rank in range(n):
            counts = out[rank]["figures"]
            if out[rank]["kind"] != "no error":
                failures.append(f"rank {rank} ended with {out[rank]['kind']!r}: {out[rank]['message']}")
            if counts.get("results") != 2 * n or counts.get("wrong", 1) or counts.get("inputs_changed", 1):
                failures.append(f"rank {rank}: {counts.get('wrong')} of {counts.get('results')} results not twice "
                                f"the reference ({2 * n} expected), {counts.get('inputs_changed')} inputs changed by "
                                "in-place consumers")
    elif case == "lying-split":
        claimed, sent = _bodies.LYING_CLAIMED, _bodies.LYING_SENT
        for rank in range(n):
            o = out[rank]
            if rank == 1:
                if o["kind"] != "CommfuseValueError":
                    failures.append(f"rank 1 ended with {o['kind']!r} instead of CommfuseValueError for its "
                                    f"output_splits: {o['message']}")
                numbers = re.findall(r"\d+", o["message"])
                if not _names(0, o["message"]) or str(claimed) not in numbers or str(sent) not in numbers:
                    failures.append(f"rank 1's error does not name rank 0 and both sizes ({claimed} claimed, "
                                    f"{sent} sent): {o['message']}")
            else:
                right(rank)
            after(rank, 1, dead_allowed=False)
    else:  # straggler
        late = _bodies.STRAGGLER_LATE * limit
        for rank in range(n):
            o = out[rank]
            kind, message, seconds = o["kind"], o["message"], o["seconds"]
            before(rank)
            if rank == 1:
                if kind not in _TOLD:
                    failures.append(f"rank 1 (the straggler) ended with {kind!r} instead of a commfuse error "
                                    f"saying it was late: {message}")
                elif not ("this rank" in message and re.search(r"\blate\b", message)):
                    failures.append(f"rank 1's error does not say that this rank was late: {message}")
                if seconds > told_within:
                    failures.append(f"rank 1 took {seconds:.1f} s to raise after arriving {late:g} s late, over half "
                                    f"the timeout ({told_within:g} s): it was not told it was late")
                continue
            if kind != "CommfuseTimeoutError":
                failures.append(f"rank {rank} ended with {kind!r} instead of a CommfuseTimeoutError naming rank 1 "
                                f"late: {message}")
            if not re.search(r"\branks? (\d+, )*1\b[^.;\n]*\blate\b", message):  # in one sentence
                failures.append(f"rank {rank}'s error does not name rank 1 as late: {message}")
            if not 0.8 * limit <= seconds <= 1.5 * limit + 5:
                failures.append(f"rank {rank} raised after {seconds:.1f} s, not at the timeout ({limit:g} s)")
    return failures


class TracedTests(_Tier):
    """A backend whose ranks are the devices of one traced program (``Capabilities.traced_runner``): every op
    and algorithm, forward and backward, run by the backend's runner on ``world_size`` devices of its runtime
    against the reference semantics (``commfuse.testing.traced``), and ``traced-check``, the backend's own
    check of what it lowered (``Capabilities.traced_check``). Skipped by those capabilities for the backends
    whose ranks the other tiers launch."""

    @pytest.mark.commfuse_tier("traced")
    def test_traced(self, commfuse_case, record_property):
        import importlib

        which = "traced_check" if commfuse_case == "traced-check" else "traced_runner"
        ref = getattr(self.caps, which, None)
        if not ref:
            traced = getattr(self.caps, "traced_runner", None)
            pytest.skip(f"capability: {which} is not set ("
                        + ("the backend has no check of its own lowering)" if traced else
                           "the backend's ranks are processes: the other tiers check it)"))
        reason = _skip_reason(commfuse_case, self.caps)
        if reason:
            pytest.skip(reason)
        module, _, attr = ref.partition(":")
        function = getattr(importlib.import_module(module), attr)
        if commfuse_case == "traced-check":
            failures = function(self.world_size)
        else:
            failures = _traced.check(function, commfuse_case, self.world_size)
        record_property("failures", len(failures))
        if failures:
            pytest.fail("\n".join(failures), pytrace=False)


class ConformanceSuite(TransportTests, ScheduleTests, OpsTests, DeterminismTests, OverlapTests, CaptureTests,
                       RobustnessTests, TracedTests):
    """Every tier. A vendor's test module: ``class TestConformance(ConformanceSuite): pass``."""
