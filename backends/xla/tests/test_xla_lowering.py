"""Tier (c) on XLA:CPU (needs torch_xla; the environment of ci/setup_xla.sh): world size 1 executes end
to end against the reference; world sizes 2, 3, 4 and 8 are traced per rank and their HLO, parsed and
never executed, has the schedule's collective-permutes, pairs and dot interleaving; wrong lowerings fail it."""

from __future__ import annotations

import pytest

torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed here: run bash ci/test_xla.sh")

import torch  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402

from commfuse.schedule import Collective, SliceId, Transfer  # noqa: E402
from commfuse_xla import verify  # noqa: E402
from commfuse_xla.backend import XlaBackend  # noqa: E402


@pytest.mark.parametrize("case", verify.CASES, ids=str)
def test_world_size_one_executes_and_matches_the_reference(case):
    assert verify.run_world_one(case) == []


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("case", verify.CASES, ids=str)
def test_traced_hlo_follows_the_schedule(case, n):
    results = verify.check_world(case, n)
    failures = [f"rank {r.rank}: {f}" for r in results for f in r.failures]
    assert not failures, "\n".join(failures)
    schedule = case.schedule(n)
    if schedule.algorithm.value in ("ring", "bidirectional"):
        channels = 2 if schedule.algorithm.value == "bidirectional" else 1
        for r in results:  # N-1 permutes per ring (times the parts of a shard)
            assert r.permutes_per_channel == {c: (n - 1) * schedule.parts for c in range(channels)}


def test_backend_primitives_execute_at_world_size_one():
    device = torch_xla.device()
    be = XlaBackend(rank=0, world_size=1, device=device)
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    handle = be.post([(Transfer(SliceId(0), 0, 1), x.to(device))], [(Transfer(SliceId(0), 0, 1), be.empty((2, 3), torch.float32))])
    (got,) = handle.wait(1.0)
    gathered = be.collective(Collective.ALL_GATHER, [x.to(device)], [be.empty((2, 3), torch.float32)]).wait(1.0)
    reduced = be.collective(Collective.REDUCE_SCATTER, [x.to(device)], [be.empty((2, 3), torch.float32)]).wait(1.0)
    swapped = be.collective(Collective.ALL_TO_ALL, [x.to(device)], [be.empty((2, 3), torch.float32)]).wait(1.0)
    torch_xla.sync()
    for t in (got, *gathered, *reduced, *swapped):
        assert torch.equal(t.cpu(), x)


def test_uneven_permute_shapes_are_refused():
    be = XlaBackend(rank=0, world_size=2, device=torch_xla.device())
    with pytest.raises(Exception, match="divide by the world size 2"):
        be.post([(Transfer(SliceId(0), 1, 1), torch.zeros(3, 2))], [(Transfer(SliceId(1), 1, 1), torch.zeros(2, 2))])


def _hlo(build) -> str:
    device = torch_xla.device()
    out = build(device)
    text = torch_xla._XLAC._get_xla_tensors_hlo(out)
    verify.forget(device)
    return text


def _hand_ring(rank, n, pairs_shift=1):
    """A hand-written ring all-gather matmul: hop the shard on, multiply each arrival."""

    def build(device):
        a = verify._inputs(verify.Case("all_gather_matmul", "ring"), rank, n)
        x, w = a["a"].to(device), a["w"].to(device)
        held = [x]
        for _ in range(n - 1):
            held.append(xm.collective_permute(held[-1], pairs=[[i, (i + pairs_shift) % n] for i in range(n)]))
        return [torch.cat([h @ w for h in held])]

    return build


def test_a_lowering_that_computes_after_all_hops_fails_the_interleaving_check():
    case = verify.Case("all_gather_matmul", "ring")
    # The hand-written ring has the schedule's structure and passes ...
    assert verify.check_rank(case, 4, 1, _hlo(_hand_ring(1, 4))).failures == []
    # ... but the same hops with every dot made to wait for the last one do not.

    def late(device):
        a = verify._inputs(case, 1, 4)
        x, w = a["a"].to(device), a["w"].to(device)
        held = [x]
        for _ in range(3):
            held.append(xm.collective_permute(held[-1], pairs=[[i, (i + 1) % 4] for i in range(4)]))
        last = held[-1].sum() * 0  # every dot now depends on the last permute
        return [torch.cat([(h + last) @ w for h in held])]

    failures = verify.check_rank(case, 4, 1, _hlo(late)).failures
    assert any("dots out of schedule order" in f and "[2, 2, 2, 2]" in f for f in failures), failures


def test_wrong_pairs_and_missing_permutes_fail():
    case = verify.Case("all_gather_matmul", "ring")
    failures = verify.check_rank(case, 4, 1, _hlo(_hand_ring(1, 4, pairs_shift=3))).failures
    assert any("has pairs [[0, 3], [1, 0], [2, 1], [3, 2]], expected [[0, 1], [1, 2], [2, 3], [3, 0]]" in f
               for f in failures), failures
    failures = verify.check_rank(case, 8, 1, _hlo(_hand_ring(1, 4))).failures
    assert failures == ["3 collective-permutes, the schedule has 7"]


def test_the_registry_makes_a_runtime_backend_that_runs_every_op():
    import commfuse as cf

    be = cf.backends.get("xla", device=torch_xla.device())
    assert (be.rank, be.world_size, be.groups) == (0, 1, [[0]])
    assert be.capabilities.execution == "traced"
    assert verify.execute_here() == []


_DEFAULT_CHECK = """
import torch, torch_xla, commfuse as cf
from commfuse_xla import verify
from commfuse_xla.backend import XlaBackend
d = torch_xla.device()
be = XlaBackend(rank=1, world_size=4, device=d)
a, w = torch.ones(4, 8).to(d), torch.ones(8, 3).to(d)
before = verify._executions()
with torch.no_grad():
    y = cf.all_gather_matmul(a, w, backend=be, algorithm="ring")  # check= left at its default (on)
text = torch_xla._XLAC._get_xla_tensors_hlo([y])
assert verify._executions() == before, "the fingerprint check executed the graph"
assert verify.check_rank(verify.Case("all_gather_matmul", "ring"), 4, 1, text).failures == []
verify.forget(d)
print("TRACED-ONLY")
"""


def test_default_fingerprint_check_does_not_execute_a_traced_graph():
    import os
    import subprocess
    import sys

    # A subprocess: executing the fake-world graph poisons the device for the rest of a session.
    done = subprocess.run([sys.executable, "-c", _DEFAULT_CHECK], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert "TRACED-ONLY" in done.stdout, done.stderr[-2000:]


_UNEVEN = """
import torch, torch_xla, commfuse as cf
from commfuse.errors import CommfuseValueError
from commfuse_xla.backend import XlaBackend
d = torch_xla.device()
be = XlaBackend(rank=1, world_size=2, device=d)
chunks = [torch.ones(3, 4).to(d), torch.ones(1, 4).to(d)]
for call in (lambda: cf.all_to_all_consume(chunks, lambda t, s: t, backend=be, algorithm="ring",
                                           output_splits=[2, 1]),
             lambda: cf.produce_all_to_all(lambda q: chunks[q], backend=be, algorithm="ring",
                                           output_splits=[2, 1], input_splits=[3, 1])):
    try:
        call()
        print("NOT REFUSED")
    except CommfuseValueError as e:
        assert "traces a graph of fixed shapes" in str(e) and "pad every block to one capacity" in str(e), e
        print("REFUSED")
"""


def test_an_uneven_all_to_all_is_refused_on_a_traced_backend():
    """Uneven sizes change every call; a traced graph has fixed shapes: the ops name the padded even form."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _UNEVEN], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert done.stdout.split() == ["REFUSED", "REFUSED"], done.stdout + done.stderr[-2000:]
