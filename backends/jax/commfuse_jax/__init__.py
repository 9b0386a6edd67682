"""commfuse-jax: commfuse's schedules run on the devices of a JAX mesh axis, through torchax.

Every ring hop is a ``jax.lax.ppermute`` with the schedule's pairs, ``vanilla``
and ``sliced`` are JAX's whole collectives, and the rank is the device's
``axis_index``: one program for every device (:mod:`commfuse_jax.lowering`).
The ops (:mod:`commfuse_jax.ops`) carry commfuse's backward; the backend
(:mod:`commfuse_jax.backend`) takes commfuse's public ops whole when they are
called on torchax tensors inside ``shard_map``. Nothing here imports jax or
torchax at import time: :mod:`commfuse_jax.plugin` only looks for them.
"""

from __future__ import annotations

__version__ = "0.1.0"
