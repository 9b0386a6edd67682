"""The ``jax`` backend: commfuse's public ops, called on torchax tensors inside ``shard_map``, run whole.

torchax runs torch code on JAX arrays, so a model written with commfuse's ops
runs under ``jax.jit(shard_map(...))`` unchanged. There every device runs one
program, and the rank is ``lax.axis_index``, a value of the graph: commfuse's
step loop, which walks with the rank as an int, cannot run it. So the backend
declares ``whole_ops`` and commfuse hands each such call to :meth:`run_op`,
which unwraps the torchax tensors, walks the op's schedule on the mesh axis
(:mod:`commfuse_jax.ops`) and wraps the results. A consumer or producer the
caller gave is called with torchax tensors, and with the rank as a 0-d
integer tensor (traced), not a Python int.

The axis is the op's ``group``: a mesh axis name (``"tp"``), a tuple of them,
or None for the one axis the enclosing ``shard_map`` binds. An axis that is
not bound there, several axes with no group, shapes that cannot be one program
(a dim that does not divide by the axis size, chunks of different shapes,
uneven all-to-all sizes), and options that only an eager rank can honour are
refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence

from commfuse.errors import CommfuseValueError
from commfuse_jax.capabilities import CAPABILITIES


def _env():
    import torchax

    return torchax.default_env()


def _jax(x):
    """A torchax tensor's JAX array (anything else as it is)."""
    import torch

    if isinstance(x, torch.Tensor):
        if not hasattr(x, "jax"):
            raise CommfuseValueError(
                f"jax backend: a plain torch tensor {type(x).__name__}{list(x.shape)} on {x.device} was given inside "
                "a JAX trace; move it to the JAX device first (torchax: tensor.to('jax'))"
            )
        return x.jax()
    return x


def _torch(tree):
    return _env().j2t_iso(tree)


class JaxBackend:
    """commfuse's ops on a JAX mesh axis (see the module docstring). ``group``: the axis."""

    name = "jax"
    capabilities = CAPABILITIES

    def __init__(self, group=None) -> None:
        if group is not None and not (isinstance(group, (str, tuple, list))):
            raise CommfuseValueError(
                f"jax backend: group must be a mesh axis name, a tuple of them or None, got {type(group).__name__} "
                f"{group!r} (a torch.distributed process group does not name a JAX mesh axis)"
            )
        self.group = tuple(group) if isinstance(group, list) else group

    def __repr__(self) -> str:
        return f"JaxBackend(group={self.group!r})"

    def axis(self, group=None):
        """The :class:`~commfuse_jax.lowering.Axis` of a call: its ``group``, this backend's, or the one in scope."""
        from commfuse_jax.lowering import Axis

        name = group if isinstance(group, (str, tuple, list)) else self.group
        return Axis.in_scope() if name is None else Axis(name)

    @property
    def world_size(self) -> int:
        """The size of the axis (read inside the trace)."""
        return self.axis().size

    @property
    def rank(self):
        raise CommfuseValueError(
            "jax backend: the rank is the device's axis_index, a value of the JAX graph and not a Python int; only "
            f"the ops it runs whole ({', '.join(CAPABILITIES.whole_ops)}) work on it"
        )

    # -- the Backend protocol's transport: not this backend's way ----------------------------------------------

    def _stepwise(self, *_args, **_kwargs):
        raise CommfuseValueError(
            "jax backend: this op drives commfuse's step loop from Python, which needs the rank as an int; on a JAX "
            f"mesh axis the rank is traced, so only the ops run whole work ({', '.join(CAPABILITIES.whole_ops)})"
        )

    post = collective = empty = _stepwise

    # -- whole ops ----------------------------------------------------------------------------------------------

    def run_op(self, op: str, **arguments):
        """Run commfuse's ``op`` whole on the call's axis; ``arguments`` are the public op's."""
        runner = getattr(self, f"_{op}", None)
        if runner is None or op not in CAPABILITIES.whole_ops:
            raise CommfuseValueError(f"jax backend: {op} is not an op it runs (it runs {CAPABILITIES.whole_ops})")
        return runner(**arguments)

    def _axis_name(self, group):
        return self.axis(group).name

    def _all_gather_matmul(self, a_shard, b, group, gather_dim, algorithm, return_gathered, gathered_size,
                           keep_gathered):
        from commfuse_jax import ops

        axis = self.axis(group)
        if gathered_size is not None and gathered_size != a_shard.shape[gather_dim] * axis.size:
            raise CommfuseValueError(
                f"jax backend: all_gather_matmul with gathered_size={gathered_size}, but every device holds "
                f"{a_shard.shape[gather_dim]} rows along dim {gather_dim} ({axis.size} devices on axis {axis.name!r}: "
                f"{a_shard.shape[gather_dim] * axis.size}); one program moves one shape, so shards are even"
            )
        single = not isinstance(b, (list, tuple))
        bs = [b] if single else list(b)
        gathered, outs = ops.all_gather_matmul(_jax(a_shard), [_jax(x) for x in bs], axis_name=axis.name,
                                               algorithm=algorithm, gather_dim=gather_dim,
                                               return_gathered=return_gathered, keep_gathered=keep_gathered)
        results = _torch(outs[0]) if single else _torch(list(outs))
        return (_torch(gathered), results) if return_gathered else results

    def _matmul_reduce_scatter(self, a, b, group, scatter_dim, reduce_op, algorithm):
        from commfuse_jax import ops

        return _torch(ops.matmul_reduce_scatter(_jax(a), _jax(b), axis_name=self._axis_name(group),
                                                algorithm=algorithm, scatter_dim=scatter_dim, reduce_op=reduce_op))

    def _all_gather_consume(self, shard, consumer, group, dim, algorithm):
        from commfuse_jax import ops

        def call(piece, rank):
            return _jax_tree(consumer(_torch(piece), _torch(rank)))

        return _torch(ops.all_gather_consume(_jax(shard), call, axis_name=self._axis_name(group),
                                             algorithm=algorithm, dim=dim))

    def _produce_reduce_scatter(self, producer, inputs, group, dim, algorithm):
        from commfuse_jax import ops

        if inputs is None:
            def call(rank):
                return _jax(producer(_torch(rank)))
        else:
            def call(rank):
                return _jax(producer(_torch(rank), *inputs))

        return _torch(ops.produce_reduce_scatter(call, axis_name=self._axis_name(group), algorithm=algorithm, dim=dim))

    def _all_to_all_consume(self, chunks: Sequence, consumer, group, dim, algorithm, output_splits, uneven):
        from commfuse_jax import ops

        if output_splits is not None:
            sizes = [int(s) for s in (output_splits.tolist() if hasattr(output_splits, "tolist") else output_splits)]
            wrong = [(s, size) for s, size in enumerate(sizes) if size != chunks[0].shape[dim]]
            if wrong:
                s, size = wrong[0]
                raise CommfuseValueError(
                    f"jax backend: output_splits[{s}] = {size}, but every device sends chunks of "
                    f"{chunks[0].shape[dim]} rows along dim {dim} (one program moves one shape); an uneven "
                    "all-to-all needs every block padded to one size"
                )

        def call(piece, rank):
            return _jax_tree(consumer(_torch(piece), _torch(rank)))

        return _torch(ops.all_to_all_consume([_jax(c) for c in chunks], call, axis_name=self._axis_name(group),
                                             algorithm=algorithm, dim=dim))

    def _ring_attention(self, q, k, v, group, causal, scale, layout, algorithm, document_lengths, ulysses_group):
        from commfuse_jax import ops

        if document_lengths is not None or ulysses_group is not None:
            what = "document_lengths" if document_lengths is not None else "ulysses_group"
            raise CommfuseValueError(
                f"jax backend: ring_attention with {what} is not lowered (contiguous and zigzag layouts, causal or "
                "not, are); call it without, or on an eager backend"
            )
        return _torch(ops.ring_attention(_jax(q), _jax(k), _jax(v), axis_name=self._axis_name(group), causal=causal,
                                         scale=scale, layout=layout, algorithm=algorithm))


def _jax_tree(tree):
    import torch.utils._pytree as pytree
    import torch

    return pytree.tree_map_only(torch.Tensor, _jax, tree)
