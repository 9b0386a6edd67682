"""Ulysses sequence parallelism's exchange: this rank's rows of every head to every rank's rows of this rank's
heads (``to_heads``), or back (``to_sequence``), a pairwise all-to-all over the group each way. In plain code,
for x (b, L, H, d) on each of U ranks::

    chunks = x.chunk(U, dim=2)                   # head chunk t goes to rank t
    got = all_to_all(chunks)                     # got[s]: rank s's rows of this rank's heads
    to_heads(x) = cat(got, dim=1)                # (b, U*L, H/U, d): every rank's rows, in rank order

and ``to_sequence`` is its inverse (row chunk s back to rank s, joined along the heads). The backward of
either is the other.

Two entry points share that exchange:

================================== ==========================================================================
name                               what it is
================================== ==========================================================================
:func:`to_heads`, :func:`to_sequence`
                                   the plain exchange, differentiable (:class:`_UlyssesExchange`): ring
                                   attention's 2-D form (``commfuse.fused.ring_attention``, Ulysses inside,
                                   the ring across) runs its ring between them
:func:`attention`                  the exchange fused with the attention (:class:`_UlyssesAttention`; under
                                   ``commfuse.nn.UlyssesAttention`` and ``commfuse.nn.ulysses_attention``):
                                   K and V go to their heads' ranks as :func:`to_heads` takes them (stacked,
                                   one exchange), then each arriving query chunk's attention is computed
                                   while the next chunk flies, and the outputs go back
================================== ==========================================================================

They stay two because the second overlaps the queries' exchange with the attention chunk by chunk (a
consumer of the all-to-all, forward and backward), which the plain exchange followed by attention would
give up; each keeps its own labels, checks and messages.
"""

from __future__ import annotations

import torch

from commfuse import backends
from commfuse.context import positions
from commfuse.errors import CommfuseValueError
from commfuse.fused import attention as fused_attention
from commfuse.planning.all_to_all import all_to_all_consume_core
from commfuse.planning.consumers import StandIn, collect
from commfuse.planning.derive import configured
from commfuse.planning.agreement import agree_around
from commfuse.planning.calls import resolve_call
from commfuse.runtime.programs import rounded, sum_zeros
from commfuse.schedule import Collective

__all__ = ["attention", "exchange_call", "heads_in", "to_heads", "to_sequence", "ulysses_positions"]


# -- the exchange ------------------------------------------------------------------------------------------------


def _exchanged(call, chunks: list[torch.Tensor], dim: int, join: int, label: str) -> torch.Tensor:
    """``chunks[t]`` to rank t (rows along ``dim``), what arrived joined along ``join`` in source order."""
    return torch.cat(all_to_all_consume_core(call, chunks, collect, dim, label=label), dim=join)


def _to_heads(call, x: torch.Tensor, label: str, seq: int = 1) -> torch.Tensor:
    """x (..., L, H, ...) with its rows along ``seq`` and its heads along the next dim -> (..., U*L, H/U, ...)."""
    chunks = [c.contiguous() for c in x.chunk(call.world_size, dim=seq + 1)]
    return _exchanged(call, chunks, seq, seq, label)


def _to_sequence(call, x: torch.Tensor, label: str) -> torch.Tensor:
    """x (b, U*L, H/U, d) -> (b, L, H, d): the inverse of :func:`_to_heads`."""
    chunks = [c.contiguous() for c in x.chunk(call.world_size, dim=1)]
    return _exchanged(call, chunks, 1, 2, label)


class _UlyssesExchange(torch.autograd.Function):
    """Ulysses' exchange, each way: ``to_heads`` takes this rank's rows of every head to every rank's rows of
    this rank's heads; otherwise the inverse. The backward is the exchange the other way.

    ======== ====================================================== ====================================
    pass     computes (to_heads; the other way swaps the shapes)    communication (pairwise, U ranks)
    ======== ====================================================== ====================================
    forward  x (b, L, H, d) -> (b, U*L, H/U, d)                     head chunk t of x to rank t
    backward g (b, U*L, H/U, d) -> (b, L, H, d)                     row chunk s of g back to rank s
    ======== ====================================================== ====================================
    """

    @staticmethod
    def forward(ctx, call, to_heads: bool, label: str, x: torch.Tensor):
        ctx.call, ctx.to_heads, ctx.label = call, to_heads, label
        return _to_heads(call, x, label) if to_heads else _to_sequence(call, x, label)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        call, label = ctx.call, ctx.label
        return None, None, None, _to_sequence(call, g, label) if ctx.to_heads else _to_heads(call, g, label)


def to_heads(call, x: torch.Tensor, *, label: str) -> torch.Tensor:
    """x (b, L, H, d), this rank's rows of every head -> (b, U*L, H/U, d), every rank's rows of this rank's
    heads; differentiable (the backward is :func:`to_sequence`'s exchange)."""
    return _UlyssesExchange.apply(call, True, label, x)


def to_sequence(call, x: torch.Tensor, *, label: str) -> torch.Tensor:
    """The inverse of :func:`to_heads`: (b, U*L, H/U, d) -> (b, L, H, d); differentiable."""
    return _UlyssesExchange.apply(call, False, label, x)


def exchange_call(q: torch.Tensor, k: torch.Tensor, group, timeout):
    """The 2-D form's exchange call over the Ulysses ``group`` (None: no group, or one of size 1), ``auto``
    decided on one head's bytes of q; q's and k's heads checked to cut into the group's ranks."""
    if group is None:
        return None
    call = resolve_call(Collective.ALL_TO_ALL, "auto", group=group, device=q.device,
                        slice_bytes=q.numel() // q.shape[2] * q.element_size(), timeout=timeout)
    if call is None:
        return None
    u = call.world_size
    for name, t in (("q", q), ("k", k)):
        if t.shape[2] % u:
            raise CommfuseValueError(f"rank {call.rank}: {name} has {t.shape[2]} heads, not divisible by the Ulysses "
                                     f"group's size {u}: every rank of it needs whole heads")
    return call


def heads_in(call, group, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shared=None) -> tuple:
    """The 2-D form's way in: q, k and v through :func:`to_heads` into this rank's heads of the cp shard. The
    ranks of the Ulysses group must pass the same document lengths too (the cp ring compares only its own
    ranks'): ``shared`` (their ``(digest, described)``; None: nothing compared) rides the exchanges where the
    transport can carry it, else one exchange of digests first; where they differ every rank of the Ulysses
    group raises ``MismatchError`` before the ring."""
    def run():
        return tuple(to_heads(call, t, label="ring_attention.ulysses") for t in (q, k, v))

    if shared is None:
        return run()
    return agree_around(call, group, "ring_attention's document_lengths (the Ulysses group)", *shared, run,
                        label="ring_attention.ulysses.documents", device=q.device)


def ulysses_positions(seq_len: int, cp_rank: int, cp_size: int, ulysses_rank: int, ulysses_size: int,
                      layout: str = "contiguous", *, device=None) -> torch.Tensor:
    """The global positions of the tokens a rank of the 2-D form holds: the ``ulysses_rank``-th of
    ``ulysses_size`` equal pieces of cp rank ``cp_rank``'s shard (``commfuse.context.positions``)."""
    pos = positions(seq_len, cp_rank, cp_size, layout, device=device)
    if pos.numel() % ulysses_size:
        raise CommfuseValueError(f"rank {ulysses_rank}: the cp shard of {pos.numel()} positions does not cut into "
                                 f"{ulysses_size} equal pieces for the Ulysses group")
    return pos.chunk(ulysses_size)[ulysses_rank]


# -- the exchange fused with the attention -----------------------------------------------------------------------


class _UlyssesAttention(torch.autograd.Function):
    """Attention over the whole sequence for this rank's heads, from and back to sequence shards.

    ======== ================================================= ===============================
    pass     computes                                          communication (pairwise rings)
    ======== ================================================= ===============================
    forward  o_s = attend(q_s, K, V) per arriving query chunk  K,V to head owners; q chunks
                                                               (overlapped); o_s back to s
    backward dq_s, dK, dV += vjp(o_s) per arriving do chunk    do chunks (overlapped); dq_s,
                                                               dK/dV rows back to their owners
    ======== ================================================= ===============================

    Shapes: q (b, L, H, d), k and v (b, L, Hkv, d) with L = s/N rows on this
    rank and all heads; K, V (b, s, Hkv/N, d) all rows of this rank's heads;
    output like q.
    """

    @staticmethod
    def forward(ctx, call, causal: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        n = call.world_size
        b, length, hq, d = q.shape
        hq_l = hq // n
        # (2, b, s, Hkv/N, d): K and V stacked, one exchange, rows in source order
        kv_full = _to_heads(call, torch.stack([k, v]), "ulysses.kv", seq=2)
        kk, vv = kv_full[0], kv_full[1]
        q_chunks = [q[:, :, t * hq_l : (t + 1) * hq_l].contiguous() for t in range(n)]

        def attend_chunk(q_s: torch.Tensor, s: int) -> torch.Tensor:
            keys = slice(0, (s + 1) * length) if causal else slice(0, n * length)
            return fused_attention.attend(q_s, kk[:, keys], vv[:, keys], causal=causal, q_offset=s * length)

        # every arriving query chunk's attention runs while the next chunk is in flight
        # (comm_only measurements: the attention's stand-in is an empty tensor of its shape, that of q_s)
        arrived = all_to_all_consume_core(
            call, q_chunks, StandIn(lambda q_s, s: (q_s, attend_chunk(q_s, s).contiguous()),
                                              lambda q_s, s: (q_s, torch.empty_like(q_s))), 1, label="ulysses.q")
        q_got = [a[0] for a in arrived]
        out = _exchanged(call, [a[1] for a in arrived], 1, 2, "ulysses.out")
        ctx.call, ctx.causal, ctx.length = call, causal, length
        ctx.save_for_backward(torch.stack(q_got), kk, vv)
        return out

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        q_all, kk, vv = ctx.saved_tensors
        call, causal, length = ctx.call, ctx.causal, ctx.length
        n = call.world_size
        hq_l = do.shape[2] // n
        # dK, dV sum one piece per arriving do chunk: in float32 for half inputs, rounded once (programs.sum_dtype)
        dk, dv = sum_zeros(kk), sum_zeros(vv)

        def back_chunk(do_s: torch.Tensor, s: int) -> torch.Tensor:
            keys = slice(0, (s + 1) * length) if causal else slice(0, n * length)
            with torch.enable_grad():
                q_s = q_all[s].detach().requires_grad_()
                k_s = kk[:, keys].detach().requires_grad_()
                v_s = vv[:, keys].detach().requires_grad_()
                o = fused_attention.attend(q_s, k_s, v_s, causal=causal, q_offset=s * length)
                dq_s, dk_s, dv_s = torch.autograd.grad(o, (q_s, k_s, v_s), do_s)
            dk[:, keys] += dk_s
            dv[:, keys] += dv_s
            return dq_s.contiguous()

        do_chunks = [do[:, :, t * hq_l : (t + 1) * hq_l].contiguous() for t in range(n)]
        back = StandIn(back_chunk, lambda do_s, s: torch.empty_like(do_s))  # comm_only: dq_s is do_s-shaped
        dq_chunks = all_to_all_consume_core(call, do_chunks, back, 1, label="ulysses.backward")
        dq = _exchanged(call, dq_chunks, 1, 2, "ulysses.dq")
        rows = [slice(s * length, (s + 1) * length) for s in range(n)]
        dk, dv = rounded(dk, kk.dtype), rounded(dv, vv.dtype)
        dkv_chunks = [torch.stack([dk[:, r], dv[:, r]]).contiguous() for r in rows]
        dkv = _exchanged(call, dkv_chunks, 2, 3, "ulysses.dkv")
        return None, None, dq, dkv[0], dkv[1]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, group, algorithm: str,
              timeout: float | None, backend, config) -> torch.Tensor:
    """``commfuse.nn.ulysses_attention`` (which documents it) on a resolved ``group``: at world size 1 the
    attention alone; else the heads checked, the exchanges' call resolved with the options (``config``) their
    fingerprints carry, and :class:`_UlyssesAttention` run."""
    be = backends.resolve(backend, group, q.device)
    n = 1 if be is None else be.world_size
    if n == 1:
        return fused_attention.attend(q, k, v, causal=causal)
    for name, t in (("q", q), ("k", k)):
        if t.shape[2] % n:
            raise CommfuseValueError(f"{name} has {t.shape[2]} heads, not divisible by the world size {n}")
    call = resolve_call("all_to_all", algorithm, group=group, backend=be, device=q.device,
                        slice_bytes=q.numel() // n * q.element_size(), timeout=timeout)
    return _UlyssesAttention.apply(configured(call, config), causal, q, k, v)
