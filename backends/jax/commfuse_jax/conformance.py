"""The capabilities file for the conformance suite: the ``jax`` backend's ranks are devices of one program.

``commfuse conformance --backend jax -n N`` finds this file beside the plugin
(the record declares ``whole_ops``). The tiers that launch ranks as processes
skip by ``traced_runner``; the traced tier runs every op and algorithm of the
suite (``commfuse.testing.traced``) through :func:`run` on N CPU host
devices, forward and backward, against the reference semantics, and its
``traced-check`` case calls :func:`check`, which checks each case of
:mod:`commfuse_jax.verify` for its lowered HLO against its schedule.
"""

from __future__ import annotations

import os
import sys

import commfuse.testing


class Capabilities(commfuse.testing.Capabilities):
    dtypes = ("float32", "bfloat16")
    device = "jax"
    traced_runner = "commfuse_jax.conformance:run"
    traced_check = "commfuse_jax.conformance:check"


def _host_devices(world_size: int) -> None:
    """Ask for enough CPU host devices, which are fixed when jax starts (nothing is changed once it has)."""
    if "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={max(8, world_size)}").strip()


def run(body, inputs, world_size: int, cotangents=None):
    """``body`` as one program on ``world_size`` host devices (the suite's traced runner; its contract is in
    ``commfuse.testing.traced``): rank r's arguments are ``inputs[i][r]``; returns every rank's output and, with
    ``cotangents``, every rank's gradient of each argument, as CPU torch tensors in the inputs' dtype."""
    _host_devices(world_size)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import torchax
    from jax import shard_map
    from jax.sharding import PartitionSpec as P

    from commfuse_jax.verify import _mesh

    env = torchax.default_env()
    dtype = inputs[0][0].dtype
    jdtype = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16}[dtype]

    def stacked(tensors):  # rank r's tensor at row r: the array each device holds one row of
        return jnp.asarray(np.stack([t.to(torch.float32).numpy() for t in tensors]), dtype=jdtype)

    def device(*rows):
        tensors = env.j2t_iso(tuple(x[0] for x in rows))
        with env:
            out = body(*tensors)
        return env.t2j_iso(out)[None]

    f = shard_map(device, mesh=_mesh(world_size), in_specs=tuple(P("tp") for _ in inputs), out_specs=P("tp"))
    args = [stacked(arg) for arg in inputs]

    def back(x) -> list:
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            x = multihost_utils.process_allgather(x, tiled=True)
        rows = torch.from_numpy(np.array(x.astype(jnp.float32))).to(dtype)
        return list(rows.unbind(0))

    if cotangents is None:
        return back(jax.jit(f)(*args)), None
    ct = stacked(cotangents)

    def loss(*xs):
        out = f(*xs)
        return (out.astype(jnp.float32) * ct.astype(jnp.float32)).sum(), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True))(*args)
    return back(out), [back(g) for g in grads]


def check(world_size: int) -> list[str]:
    """The lowered HLO of every verify case at ``world_size`` host devices against its schedule; the failures,
    as lines (the numbers are the traced tier's other cases)."""
    _host_devices(world_size)
    from commfuse_jax import verify

    failures = []
    for case in verify.CASES:
        failures += [f"world {world_size} {case} hlo: {f}" for f in
                     verify.check_hlo(case, world_size, verify.lowered_hlo(case, world_size))]
    return failures
