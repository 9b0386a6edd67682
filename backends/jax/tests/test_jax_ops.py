"""Tier (c) on CPU host devices (needs jax and torchax: the environment of ci/setup_jax.sh): commfuse's public
ops on torchax tensors inside jax.jit(shard_map) equal plain torch forward and backward, their lowered HLO
follows the schedule, the conformance suite's traced tier passes through this backend's runner and
``commfuse conformance --backend jax`` runs it, wrong lowerings fail both checks, and bad input is refused by
name."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax", reason="jax is not installed here: run bash ci/test_jax.sh")
pytest.importorskip("torchax", reason="torchax is not installed here: run bash ci/test_jax.sh")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
import torchax  # noqa: E402
from jax import shard_map  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import commfuse as cf  # noqa: E402
from commfuse.errors import CommfuseValueError  # noqa: E402
from commfuse.testing import traced  # noqa: E402
from commfuse_jax import conformance, verify  # noqa: E402
from commfuse_jax.ops import all_gather_matmul  # noqa: E402


# Every verify case at 2, 3, 4 and 8 devices, both dtypes, with its HLO: ci/test_jax.sh runs the table
# (python -m commfuse_jax.verify). Here: the suite's traced tier through the runner, and what must fail.


@pytest.mark.parametrize("case", ["traced-all_gather_matmul-sliced:2-bfloat16",
                                  "traced-produce_reduce_scatter-bidirectional-bfloat16",
                                  "traced-all_to_all_consume-ring:2-float32",
                                  "traced-ring_attention-zigzag-bidirectional-float32"])
def test_the_suites_traced_cases_pass_through_the_runner(case):
    """The conformance suite's problems and references (commfuse.testing.traced), run by this backend's runner."""
    assert traced.check(conformance.run, case, 4) == []


def test_a_ring_sent_the_wrong_way_fails_the_suites_traced_case(monkeypatch):
    from commfuse_jax import lowering

    monkeypatch.setattr(lowering.Axis, "permute",
                        lambda self, x, shift: jax.lax.ppermute(x, self.name, perm=self.ring.pairs(-shift)))
    failures = traced.check(conformance.run, "traced-matmul_reduce_scatter-ring-float32", 4)
    assert any(f.startswith("rank 0: output") for f in failures), failures
    assert any("gradient of argument 0" in f for f in failures), failures


def test_the_conformance_command_runs_the_traced_tier_and_skips_the_launching_tiers(tmp_path):
    """As a vendor runs it: the capabilities file is found beside the plugin."""
    report = tmp_path / "jax.json"
    done = subprocess.run([sys.executable, "-m", "commfuse", "conformance", "--backend", "jax", "-n", "2", "--report",
                           str(report), "-k", "traced-all_gather_matmul-ring-float32 or ring-shift-forward or "
                           "all_gather_matmul-ring-float32-exact"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tests = {t["test"].split("[", 1)[1].rstrip("]"): t for t in json.loads(report.read_text())["tests"]}
    assert tests["traced-all_gather_matmul-ring-float32"]["outcome"] == "passed"
    for launched in ("ring-shift-forward", "all_gather_matmul-ring-float32-exact"):
        assert tests[launched]["outcome"] == "skipped" and "traced_runner" in tests[launched]["reason"]


def test_traced_check_passes_at_two_devices():
    """The suite's traced-check case: every verify case's lowered HLO against its schedule."""
    assert conformance.check(2) == []


def _mesh(n, name="tp"):
    return Mesh(jax.devices()[:n], (name,))


def _hlo_of(fn, n, *args, specs):
    return jax.jit(shard_map(fn, mesh=_mesh(n), in_specs=specs, out_specs=P("tp"))).lower(*args).as_text(
        dialect="hlo")


def test_a_ring_sent_the_wrong_way_fails_the_values_and_the_hlo():
    """The same walk with every permute reversed: the results are wrong, and the HLO check names the pairs."""
    n = 4
    from commfuse_jax import lowering

    real = lowering.Axis.permute
    try:
        lowering.Axis.permute = lambda self, x, shift: jax.lax.ppermute(x, self.name, perm=self.ring.pairs(-shift))
        fwd, _, _ = verify.run_case(verify.Case("all_gather_matmul", "ring"), n, "float32")
        text = verify.lowered_hlo(verify.Case("all_gather_matmul", "ring"), n)
    finally:
        lowering.Axis.permute = real
    assert fwd > 0
    assert any("pairs" in f for f in verify.check_hlo(verify.Case("all_gather_matmul", "ring"), n, text))


def test_a_dot_that_waits_for_every_hop_fails_the_hlo_check():
    """All hops first, then the dots: the values are right but nothing overlaps, and the check says so."""
    n = 4

    def late(a, b):
        held, got = a, [a]
        for _ in range(n - 1):
            held = jax.lax.ppermute(held, "tp", perm=[(i, (i + 1) % n) for i in range(n)])
            got.append(held)
        last = got[-1]
        return jnp.concatenate([(g + 0 * last) @ b for g in got])[None]

    text = _hlo_of(late, n, jnp.ones((n * 2, 8)), jnp.ones((8, 3)), specs=(P("tp"), P()))
    failures = verify.check_hlo(verify.Case("all_gather_matmul", "ring"), n, text)
    assert any("out of schedule order" in f for f in failures)


def test_an_unbound_axis_is_named_with_the_axes_in_scope():
    with pytest.raises(CommfuseValueError, match=r"mesh axis 'sp' is not bound here.*\['tp'\]"):
        jax.jit(shard_map(lambda a, b: all_gather_matmul(a, [b], axis_name="sp")[1][0], mesh=_mesh(2),
                          in_specs=(P("tp"), P()), out_specs=P("tp")))(jnp.ones((4, 8)), jnp.ones((8, 3)))


def test_no_group_with_two_axes_in_scope_is_refused_by_name():
    env = torchax.default_env()
    mesh = Mesh(jax.devices()[:4].reshape(2, 2) if hasattr(jax.devices()[:4], "reshape") else
                [[d for d in jax.devices()[:2]], [d for d in jax.devices()[2:4]]], ("dp", "tp"))

    def body(a, b):
        ta, tb = env.j2t_iso((a, b))
        with env:
            return env.t2j_iso(cf.all_gather_matmul(ta, tb, algorithm="ring"))

    with pytest.raises(CommfuseValueError, match=r"binds the axes \['dp', 'tp'\]: pass the one"):
        jax.jit(shard_map(body, mesh=mesh, in_specs=(P(("dp", "tp")), P()), out_specs=P(("dp", "tp"))))(
            jnp.ones((8, 8)), jnp.ones((8, 3)))


def test_a_size_that_does_not_divide_by_the_axis_is_named():
    env = torchax.default_env()

    def body(a, b):
        ta, tb = env.j2t_iso((a, b))
        with env:
            return env.t2j_iso(cf.matmul_reduce_scatter(ta, tb, algorithm="ring"))

    with pytest.raises(CommfuseValueError, match=r"scatters dim 0 of size 5 over 3 devices"):
        jax.jit(shard_map(body, mesh=_mesh(3), in_specs=(P("tp"), P()), out_specs=P("tp")))(
            jnp.ones((15, 8)), jnp.ones((8, 3)))


def test_chunks_of_different_shapes_are_refused_by_name():
    env = torchax.default_env()

    def body(a, w):
        ta, tw = env.j2t_iso((a, w))
        with env:
            chunks = [ta[:2], ta[2:5]]
            return env.t2j_iso(torch.stack(cf.all_to_all_consume(chunks, lambda t, s: t.sum(0), algorithm="ring", uneven=True)))

    with pytest.raises(CommfuseValueError, match=r"chunks differ \(\[\[2, 8\], \[3, 8\]\]\)"):
        jax.jit(shard_map(body, mesh=_mesh(2), in_specs=(P("tp"), P()), out_specs=P("tp")))(
            jnp.ones((10, 8)), jnp.ones((8, 3)))


def test_an_op_the_backend_does_not_run_whole_is_refused_by_name():
    from commfuse_jax.backend import JaxBackend

    with pytest.raises(CommfuseValueError, match="needs the rank as an int"):
        JaxBackend("tp").post([], [])
