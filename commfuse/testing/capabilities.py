"""What a backend under test can do. Conformance tests skip by these attributes, never by a backend's name."""

from __future__ import annotations


class Capabilities:
    """Defaults fit a CPU backend like gloo; a vendor overrides what differs in its capabilities file.

    ``dtypes``: dtypes the ops must handle (names of torch dtypes).
    ``algorithms``: algorithms the backend must run (every one by default).
    ``autograd``: run the ops/autograd tier's gradient checks.
    ``self_transfer``: the transport can send a message to its own rank
    (gloo cannot; the schedules never need it).
    ``overlap_threshold``: the least ``hidden_fraction`` for the overlap tier
    to pass: the time a ring all_gather_matmul saves over compute plus
    communication run apart, as a fraction of the most it could save, the
    shorter of the two, ``(compute + comm - total) / min(compute, comm)``; 0
    reports the figure only (gloo on a 2-core loopback: copies compete with
    the GEMMs).
    ``survives_peer_death``: a dead peer surfaces as an error, not a hang, so
    the SIGKILL test may run.
    ``timeout_s``: the bound every robustness test gives its waits (but
    ``mismatch-promptness``, which runs with at least 60 s and must name the
    mismatch within 10).
    ``device``: device type tensors are made on; ``dist_backend``: the
    torch.distributed backend of the process group the suite launches.
    ``group_survives_one_rank_failure``: when one rank's compute fails in the
    middle of a call, it completes the call's transfers and the group stays
    usable (a backend whose hosts wait on each step, as gloo's do). A
    stream-ordered backend (NCCL, HCCL) ends the group instead, by name (its
    hosts never wait on a step, so its peers could not learn in time): False
    lets the calls after such a fault raise commfuse's error (never return a
    wrong result), and counts a rank that commfuse's watchdog ended with the
    named error as told.
    ``traced_runner``: ``module:function`` for a backend whose ranks are the
    devices of one traced program (its plugin record declares ``whole_ops``:
    the JAX lowering, where the rank is a value of the graph), which the
    suite cannot launch as processes. Set, the tiers that launch ranks skip
    by this capability, and the ``traced`` tier runs every op and algorithm
    through ``function(body, inputs, world_size, cotangents)`` on that many
    devices of the backend's runtime, forward and backward, against the
    reference semantics (``commfuse.testing.traced`` says what the runner
    is given and returns).
    ``traced_check``: ``module:function``, a traced backend's own check of
    what it lowered (the JAX lowering's: the HLO against the schedule); the
    ``traced`` tier's ``traced-check`` case calls ``function(world_size)``,
    which returns its failures, as lines.
    """

    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    algorithms: tuple[str, ...] = ("ring", "ring:2", "bidirectional", "sliced:2", "sliced:4", "vanilla")
    autograd: bool = True
    self_transfer: bool = False
    overlap_threshold: float = 0.0
    survives_peer_death: bool = True
    timeout_s: float = 10.0
    device: str = "cpu"
    dist_backend: str = "gloo"
    group_survives_one_rank_failure: bool = True
    traced_runner: str | None = None
    traced_check: str | None = None

    def as_dict(self) -> dict:
        names = [n for n in dir(self) if not n.startswith("_") and not callable(getattr(self, n))]
        return {n: getattr(self, n) for n in names}

    @classmethod
    def load(cls, ref: str | None) -> "Capabilities":
        """``module:Class`` (a vendor's capabilities file), or the defaults."""
        if not ref:
            return cls()
        import importlib

        module, _, attr = ref.partition(":")
        return getattr(importlib.import_module(module), attr or "Capabilities")()
