"""The expert-parallel MoE block: the dispatch and combine all-to-alls fused with the experts' GEMMs, forward
and backward, and the autograd Functions that run its four exchanges. The one implementation under
``commfuse.nn.MoE`` and the two halves ``commfuse.nn.moe.dispatch_experts`` / ``experts_combine``;
``commfuse.nn.moe`` documents the layer, its routing and its options, builds the layer, routes the tokens
and hands the sorted rows here.

================================== ==========================================================================
name                               what it is
================================== ==========================================================================
:func:`grouped_mm`                 the local experts' GEMM over rows grouped by expert (torch's grouped GEMM
                                   where this build runs it for the device and dtype, else a loop)
:func:`grouped_wgrad_add_`         a weight gradient per expert, accumulated over the slices of a call
:func:`expert_parallel`            the whole layer's exchanges: :class:`_ExpertParallel`, dispatch fused with
                                   gate/up and SwiGLU, the down GEMM fused with combine (and the shared
                                   experts while the dispatch flies)
:func:`dispatch_experts`           the first half alone (:class:`_DispatchExperts`)
:func:`experts_combine`            the second half alone (:class:`_ExpertsCombine`)
================================== ==========================================================================

Sizes are known only after routing: each call first exchanges the per-expert row counts (one small
all-to-all, read on the host), then the rows travel in the ring or all-to-all its ``call`` resolved.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from commfuse import backends
from commfuse.errors import CommfuseTypeError, CommfuseValueError
from commfuse.planning.all_to_all import all_to_all_consume_core, exchange_sizes, produce_all_to_all_core
from commfuse.planning.consumers import StandIn
from commfuse.planning.calls import resolve_call
from commfuse.runtime.admission import op_calls
from commfuse.runtime.eager import eager_only
from commfuse.runtime.groups import register_format
from commfuse.runtime.programs import rounded, sum_zeros
from commfuse.schedule import Collective

__all__ = ["GROUPED_MM", "dispatch_experts", "expert_parallel", "experts_combine", "grouped_mm", "grouped_mm_kind",
           "grouped_wgrad_add_", "not_traced", "swiglu"]

#: What :func:`grouped_mm` ran with, by (device type, dtype), once asked: "torch.nn.functional.grouped_mm"
#: or "loop" (this build has no grouped GEMM for that device and dtype).
GROUPED_MM: dict[tuple[str, torch.dtype], str] = {}


def grouped_mm_kind(device: torch.device | str, dtype: torch.dtype) -> str:
    """Whether :func:`grouped_mm` uses torch's grouped GEMM on ``device`` for ``dtype``, or a loop (probed once:
    a build without it, or whose kernel refuses the device or dtype, takes the loop)."""
    device = torch.device(device)
    key = (device.type, dtype)
    kind = GROUPED_MM.get(key)
    if kind is None:
        kind = "loop"
        op = getattr(F, "grouped_mm", None)
        if op is not None:
            try:
                a = torch.ones(8, 8, device=device, dtype=dtype)
                b = torch.ones(2, 8, 8, device=device, dtype=dtype)
                got = op(a, b, offs=torch.tensor([3, 8], dtype=torch.int32, device=device))
                if bool((got == 8).all()):
                    kind = "torch.nn.functional.grouped_mm"
            except (RuntimeError, NotImplementedError, TypeError):
                pass
        GROUPED_MM[key] = kind
    return kind


def _aligned(*tensors: torch.Tensor) -> bool:
    """torch's grouped GEMM wants 16-byte aligned rows."""
    return all((t.shape[-1] * t.element_size()) % 16 == 0 for t in tensors)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts) -> torch.Tensor:
    """``x`` (rows, k) grouped by expert, ``counts[e]`` rows each, times ``w[e]`` (k, m): (rows, m)."""
    counts = list(counts)
    rows = x.shape[0]
    if rows and grouped_mm_kind(x.device, x.dtype) != "loop" and _aligned(x, w):
        offs = torch.tensor(_cumulative(counts), dtype=torch.int32, device=x.device)
        return F.grouped_mm(x, w, offs=offs)
    out = x.new_empty(rows, w.shape[-1])
    at = 0
    for e, c in enumerate(counts):
        if c:
            torch.matmul(x.narrow(0, at, c), w[e], out=out.narrow(0, at, c))
        at += c
    return out


def grouped_wgrad_add_(out: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, counts, alpha: float = 1.0) -> None:
    """``out[e] += alpha * x_e.T @ dy_e`` per expert: a weight gradient accumulated over the slices of a call.

    On a CPU each expert's product is added in place (``addmm_``: no temporary the size of the weights per
    slice); elsewhere torch's grouped GEMM makes every expert's at once, then one add. ``alpha`` scales the
    product within that add (no pass of its own over the gradient). ``out`` may be float32 for half ``x`` and
    ``dy`` (``programs.sum_zeros``): each product is then made in their dtype and added in float32.
    """
    counts = list(counts)
    if (x.shape[0] and x.device.type != "cpu" and grouped_mm_kind(x.device, x.dtype) != "loop"
            and _aligned(x, dy) and x.shape[0] % 8 == 0):
        offs = torch.tensor(_cumulative(counts), dtype=torch.int32, device=x.device)
        out.add_(F.grouped_mm(x.t(), dy, offs=offs), alpha=alpha)
        return
    at = 0
    same = out.dtype is x.dtype
    for e, c in enumerate(counts):
        if c:
            if same:
                out[e].addmm_(x.narrow(0, at, c).t(), dy.narrow(0, at, c), alpha=alpha)
            else:
                out[e].add_(x.narrow(0, at, c).t() @ dy.narrow(0, at, c), alpha=alpha)
        at += c


def _cumulative(counts) -> list[int]:
    out, total = [], 0
    for c in counts:
        total += c
        out.append(total)
    return out


def swiglu(h13: torch.Tensor) -> torch.Tensor:
    """SwiGLU of ``h13`` (..., 2 * ffn), the gate projection's columns then the up projection's: (..., ffn)."""
    gate, up = h13.chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_backward(h13: torch.Tensor, d_act: torch.Tensor) -> torch.Tensor:
    gate, up = h13.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    d_gate = d_act * up * sig * (1 + gate * (1 - sig))
    return torch.cat([d_gate, d_act * silu], dim=-1)


# -- the exchanges, each with its half of the local experts' work ----------------------------------------------


def _counts_in(counts: list[int], start: int, rows: int) -> list[int]:
    """Rows per expert within rows ``start .. start + rows`` of a block grouped by expert (``counts`` each)."""
    out, at, stop = [], 0, start + rows
    for c in counts:
        out.append(max(0, min(at + c, stop) - max(at, start)))
        at += c
    return out


class _Experts:
    """One call's local expert work, by source rank and slice of its block, shared by forward and backward.

    Each exchange hands over a block in slices (one for ``ring`` and
    ``vanilla``, several for ``ring:m`` and ``sliced:c``): every slice is
    computed on its own, as it arrives or before it leaves, with the experts'
    rows it holds. The dispatch half (:meth:`up`, :meth:`up_backward`) needs
    only ``w13``, the combine half (:meth:`down`, :meth:`down_backward`) only
    ``w2`` and the activations (:meth:`hold`).
    """

    def __init__(self, w13: torch.Tensor | None, w2: torch.Tensor | None, recv_counts: list[list[int]],
                 scale: float = 1.0) -> None:
        self.w13, self.w2, self.recv = w13, w2, recv_counts
        self.scale = scale  # of the weight gradients: 1 / the group size (the mean of the ranks' losses)
        self.rows = [sum(c) for c in recv_counts]
        n = len(recv_counts)
        self.x: list = [None] * n  # each source's rows, as they arrived
        self.h13: list = [None] * n  # their gate/up projection (the activation's backward reads it)
        self.act: list = [None] * n
        # the whole layer runs the activation's backward as each output gradient arrives (into dh13); the
        # dispatch half, which alone holds h13, runs it on the combine half's d_act before its gate/up dgrad
        self.whole = w13 is not None and w2 is not None
        self.d_act: list = [None] * n
        self.dh13: list = [None] * n

    def _keep(self, table: list, q: int, start: int, t: torch.Tensor) -> None:
        total = self.rows[q]
        if start == 0 and t.shape[0] == total:
            table[q] = t
            return
        if table[q] is None:
            table[q] = t.new_empty(total, *t.shape[1:])
        table[q].narrow(0, start, t.shape[0]).copy_(t)

    def hold(self, table: list, t: torch.Tensor) -> None:
        """``table`` (:attr:`act` or :attr:`d_act`) from ``t``, every source's rows one after the other."""
        table[:] = t.split(self.rows)

    def joined(self, table: list, like: torch.Tensor, width: int) -> torch.Tensor:
        """``table``'s rows, every source's one after the other: (sum of :attr:`rows`, width)."""
        parts = [like.new_empty(0, width) if t is None else t for t in table]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    # forward
    def up(self, xq: torch.Tensor, q: int, start: int) -> None:
        h13 = grouped_mm(xq, self.w13, _counts_in(self.recv[q], start, xq.shape[0]))
        self._keep(self.x, q, start, xq)
        self._keep(self.h13, q, start, h13)
        self._keep(self.act, q, start, swiglu(h13))

    def up_stand_in(self, xq: torch.Tensor, q: int, start: int) -> None:  # comm_only: the shapes, no work
        self._keep(self.x, q, start, xq)
        self._keep(self.h13, q, start, xq.new_empty(xq.shape[0], self.w13.shape[-1]))
        self._keep(self.act, q, start, xq.new_empty(xq.shape[0], self.w13.shape[-1] // 2))

    def down(self, q: int, start: int, rows: int) -> torch.Tensor:
        return grouped_mm(self.act[q].narrow(0, start, rows), self.w2, _counts_in(self.recv[q], start, rows))

    # backward
    def down_backward(self, dyq: torch.Tensor, q: int, start: int, dw2: torch.Tensor) -> None:
        rows = dyq.shape[0]
        counts = _counts_in(self.recv[q], start, rows)
        d_act = grouped_mm(dyq, self.w2.transpose(1, 2), counts)
        grouped_wgrad_add_(dw2, self.act[q].narrow(0, start, rows), dyq, counts, self.scale)
        if self.whole:
            self._keep(self.dh13, q, start, _swiglu_backward(self.h13[q].narrow(0, start, rows), d_act))
        else:
            self._keep(self.d_act, q, start, d_act)

    def down_backward_stand_in(self, dyq: torch.Tensor, q: int, start: int) -> None:  # comm_only: the shapes
        if self.whole:
            self._keep(self.dh13, q, start, dyq.new_empty(dyq.shape[0], self.w13.shape[-1]))
        else:
            self._keep(self.d_act, q, start, dyq.new_empty(dyq.shape[0], self.w2.shape[1]))

    def up_backward(self, q: int, start: int, rows: int, dw13: torch.Tensor) -> torch.Tensor:
        counts = _counts_in(self.recv[q], start, rows)
        if self.whole:
            dh13 = self.dh13[q].narrow(0, start, rows)
        else:
            dh13 = _swiglu_backward(self.h13[q].narrow(0, start, rows), self.d_act[q].narrow(0, start, rows))
        dx = grouped_mm(dh13, self.w13.transpose(1, 2), counts)
        grouped_wgrad_add_(dw13, self.x[q].narrow(0, start, rows), dh13, counts, self.scale)
        return dx


class _Shared:
    """One call's shared experts: a SwiGLU (``x @ w13`` -> SwiGLU -> ``@ w2``) that every token of this rank goes
    through, run as the first compute of an exchange: its forward in the dispatch's first compute step, its
    backward (dgrad and wgrad) in the backward dispatch's.

    Those steps are where the dispatch is in flight: in a ring, step 0 sends
    the first hop while the own block is computed, so the shared GEMMs run
    beside that hop too; ``sliced:c`` runs them beside its second chunk's
    exchange; ``vanilla`` (one whole exchange, with no compute beside it) runs
    every compute after the exchange, the shared experts' as well. Each
    method runs once however often it is called: a call that received no
    slice runs it after its dispatch.
    """

    def __init__(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.x, self.w13, self.w2 = x, w13, w2
        self.h13 = self.act = self.out = self.dy = self.grads = None

    def forward(self) -> None:
        if self.out is None:
            self.h13 = self.x @ self.w13
            self.act = swiglu(self.h13)
            self.out = self.act @ self.w2

    def forward_stand_in(self) -> None:  # comm_only: the shape, no work
        if self.out is None:
            self.out = self.x.new_zeros(self.x.shape[0], self.w2.shape[-1])

    def backward(self) -> None:
        if self.grads is None:
            if self.act is None:  # its forward stood in (comm_only)
                return self.backward_stand_in()
            d_act = self.dy @ self.w2.t()
            dh13 = _swiglu_backward(self.h13, d_act)
            self.grads = (dh13 @ self.w13.t(), self.x.t() @ dh13, self.act.t() @ self.dy)

    def backward_stand_in(self) -> None:
        if self.grads is None:
            self.grads = (torch.zeros_like(self.x), torch.zeros_like(self.w13), torch.zeros_like(self.w2))

    def first(self, run, stand_in, consumer: StandIn) -> StandIn:
        """``consumer`` (a by-slice one) that runs ``run`` (``stand_in`` in comm_only runs) before its first
        slice."""
        def consume(t, q, start):
            run()
            consumer.consumer(t, q, start)

        def stand(t, q, start):
            stand_in()
            consumer.stand_in(t, q, start)

        return StandIn(consume, stand)


# The four exchanges of one call, each with its half of the local experts' work. :class:`_ExpertParallel` runs
# all four; :class:`_DispatchExperts` the first and, in its backward, the last; :class:`_ExpertsCombine` the
# second and, in its backward, the third. ``call`` None (one process): the work, no exchange.


def _sizes(call, send_counts: torch.Tensor, meta: list[int], label: str) -> tuple[list[int], list[list[int]]]:
    """The rows this rank sends each rank, and the rows per local expert each rank sends here (one small
    all-to-all)."""
    send_rows = send_counts.sum(dim=1).tolist()
    if call is None:
        return send_rows, send_counts.tolist()
    return send_rows, exchange_sizes(call, send_counts, label=label, meta=meta).tolist()


def _up_dispatch(call, work: _Experts, xs: torch.Tensor, send_rows: list[int], shared: _Shared | None = None) -> None:
    """Forward dispatch: each arriving slice of ``xs``'s blocks through the gate/up GEMM and SwiGLU while the next
    flies; the shared experts' forward in the first compute step."""
    if call is None:
        if shared is not None:
            shared.forward()
        work.up(xs, 0, 0)
        return
    up = StandIn(work.up, work.up_stand_in)
    if shared is not None:
        up = shared.first(shared.forward, shared.forward_stand_in, up)
    all_to_all_consume_core(
        call, list(xs.split(send_rows)), up, 0, recv_sizes=work.rows, label="moe.dispatch", by_slice=True)
    if shared is not None:
        shared.forward()  # no slice came (nothing is run twice)


def _down_combine(call, work: _Experts, send_rows: list[int], like: torch.Tensor) -> torch.Tensor:
    """Forward combine: each source's down projection made and sent back while the next is made; the rows back
    in the dispatched order, in ``like``'s dtype."""
    if call is None:
        return work.down(0, 0, work.rows[0])
    ys = produce_all_to_all_core(call, work.down, 0, recv_sizes=send_rows, send_sizes=work.rows,
                                           label="moe.combine", like=like.new_empty(0, work.w2.shape[-1]),
                                           by_slice=True)
    return torch.cat(ys) if len(ys) > 1 else ys[0]


def _down_backward_dispatch(call, work: _Experts, dys: torch.Tensor, send_rows: list[int], dw2: torch.Tensor,
                            shared: _Shared | None = None) -> None:
    """Backward dispatch: the output gradient's blocks to the expert ranks, each arriving slice through the
    down projection's dgrad and wgrad (into ``dw2``) and, for the whole layer, the activation's backward; the
    shared experts' backward in the first compute step."""
    if call is None:
        if shared is not None:
            shared.backward()
        work.down_backward(dys, 0, 0, dw2)
        return

    def down_backward(dyq, q, start):
        work.down_backward(dyq, q, start, dw2)

    down = StandIn(down_backward, work.down_backward_stand_in)
    if shared is not None:
        down = shared.first(shared.backward, shared.backward_stand_in, down)
    all_to_all_consume_core(
        call, list(dys.split(send_rows)), down, 0, recv_sizes=work.rows, label="moe.dispatch.backward",
        by_slice=True)
    if shared is not None:
        shared.backward()  # no slice came (nothing is run twice)


def _up_backward_combine(call, work: _Experts, send_rows: list[int], dw13: torch.Tensor,
                         like: torch.Tensor) -> torch.Tensor:
    """Backward combine: each source's input gradient made (the dispatch half's SwiGLU' first, then gate/up
    dgrad, and wgrad into ``dw13``) and sent back while the next is made; the rows back in the dispatched
    order."""
    def up_backward(q, start, rows):
        return work.up_backward(q, start, rows, dw13)

    if call is None:
        return up_backward(0, 0, work.rows[0])
    dxs = produce_all_to_all_core(call, up_backward, 0, recv_sizes=send_rows, send_sizes=work.rows,
                                            label="moe.combine.backward", like=like.new_empty(0, work.w13.shape[1]),
                                            by_slice=True)
    return torch.cat(dxs) if len(dxs) > 1 else dxs[0]


def _calls(call, label: str, planned: int) -> op_calls:
    """:class:`op_calls` for ``call``'s group (nothing for one process)."""
    return op_calls(None if call is None else call.be, label, planned)


class _ExpertParallel(torch.autograd.Function):
    """Rows sorted by expert (``send_counts[d]`` per expert of rank d) through the experts of their ranks and
    back, in the same order: dispatch fused with the gate/up GEMM, the down GEMM fused with combine.

    ========== =============================== =================================== ================================
    pass       rows (this rank's)              per source rank q, as it arrives    local experts' weights
    ========== =============================== =================================== ================================
    forward    xs (rows, h) -> ys (rows, h)    x_q (rows_q, h) @ w13 -> SwiGLU     w13 (E/N, h, 2f), w2 (E/N, f, h)
                                               -> act_q (rows_q, f) @ w2 -> back
    dgrad      dys (rows, h) -> dxs (rows, h)  dy_q @ w2^T -> SwiGLU' -> @ w13^T   (the same)
    wgrad      (none)                          act_q^T @ dy_q, x_q^T @ dh13_q      dw13, dw2: every source's rows,
                                                                                   summed, times ``scale``
    ========== =============================== =================================== ================================

    With shared experts (``xt``, ``sw13``, ``sw2`` given; :class:`_Shared` runs them while the dispatch flies):

    ========== ========================================================== ======================================
    pass       this rank's tokens xt (tokens, h)                          shared weights (replicated)
    ========== ========================================================== ======================================
    forward    xt @ sw13 -> SwiGLU -> act (tokens, fs) @ sw2: a second    sw13 (h, 2fs), sw2 (fs, h)
               output, (tokens, h)
    dgrad      dshared @ sw2^T -> SwiGLU' -> dh (tokens, 2fs) @ sw13^T    (the same)
    wgrad      (none)                                                     xt^T @ dh, act^T @ dshared: this
                                                                          rank's tokens only (the caller
                                                                          reduces them over the group)
    ========== ========================================================== ======================================

    The experts' weight gradients are multiplied by ``scale`` (in the GEMMs that accumulate them): 1/N when
    every rank has a loss of its own (the layer's gradients are those of the mean of its ranks' losses), 1 when
    the ranks share one (``commfuse.nn.MoE``'s ``loss``). :class:`_DispatchExperts` followed by
    :class:`_ExpertsCombine` compute the same, as two Functions."""

    @staticmethod
    def forward(ctx, xs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, call, send_counts: torch.Tensor,
                meta: list[int], scale: float, xt: torch.Tensor | None = None, sw13: torch.Tensor | None = None,
                sw2: torch.Tensor | None = None):
        shared = None if xt is None else _Shared(xt, sw13, sw2)
        send_rows, recv_counts = _sizes(call, send_counts, meta, "moe.sizes")
        work = _Experts(w13, w2, recv_counts, scale)
        _up_dispatch(call, work, xs, send_rows, shared)
        ys = _down_combine(call, work, send_rows, xs)
        ctx.state = (call, work, send_rows, shared)
        return ys if shared is None else (ys, shared.out)

    @staticmethod
    def backward(ctx, dys: torch.Tensor, dshared: torch.Tensor | None = None):
        call, work, send_rows, shared = ctx.state
        ctx.state = None
        dys = dys.contiguous()
        dw13 = sum_zeros(work.w13)
        dw2 = sum_zeros(work.w2)
        if shared is not None:
            shared.dy = dshared.contiguous()
        with _calls(call, "MoE.backward (its dispatch and combine)", 2):
            _down_backward_dispatch(call, work, dys, send_rows, dw2, shared)
            dxs = _up_backward_combine(call, work, send_rows, dw13, dys)
        dx, dsw13, dsw2 = (None, None, None) if shared is None else shared.grads
        return (dxs, rounded(dw13, work.w13.dtype), rounded(dw2, work.w2.dtype), None, None, None, None, dx, dsw13,
                dsw2)


class _DispatchExperts(torch.autograd.Function):
    """The first half of :class:`_ExpertParallel`: rows sorted by expert (``send_counts[d]`` per expert of rank
    d) dispatched to their experts' ranks, each source's rows through the gate/up GEMM and SwiGLU as they
    arrive. Outputs the activations, every source's rows one after the other, and the rows per local expert
    each source sent (an int tensor, no gradient).

    ========== =============================== =================================== ================================
    pass       this rank's                     per source rank q                   local experts' weights
    ========== =============================== =================================== ================================
    forward    xs (rows, h) -> acts (arrived,  x_q (rows_q, h) @ w13 -> SwiGLU     w13 (E/N, h, 2f)
               f), recv_counts (N, E/N)        -> act_q (rows_q, f), as it arrives
    dgrad      dacts (arrived, f) -> dxs       dact_q -> SwiGLU' -> @ w13^T, made  (the same)
               (rows, h)                       and sent back while the next is
    wgrad      (none)                          x_q^T @ dh13_q                      dw13: every source's rows,
                                                                                   summed, times ``scale``
    ========== =============================== =================================== ================================
    """

    @staticmethod
    def forward(ctx, xs: torch.Tensor, w13: torch.Tensor, call, send_counts: torch.Tensor, meta: list[int],
                scale: float):
        send_rows, recv_counts = _sizes(call, send_counts, meta, "moe.experts.sizes")
        work = _Experts(w13, None, recv_counts, scale)
        _up_dispatch(call, work, xs, send_rows)
        acts = work.joined(work.act, xs, w13.shape[-1] // 2)
        work.act = []  # the combine half holds them (acts); the backward reads x and h13
        ctx.state = (call, work, send_rows)
        recv = torch.tensor(recv_counts, dtype=torch.int64, device=send_counts.device)
        ctx.mark_non_differentiable(recv)
        return acts, recv

    @staticmethod
    def backward(ctx, dacts: torch.Tensor, _):
        call, work, send_rows = ctx.state
        ctx.state = None
        dacts = dacts.contiguous()
        work.hold(work.d_act, dacts)
        dw13 = sum_zeros(work.w13)
        with _calls(call, "dispatch_experts.backward", 1):
            dxs = _up_backward_combine(call, work, send_rows, dw13, dacts)
        return dxs, rounded(dw13, work.w13.dtype), None, None, None, None


class _ExpertsCombine(torch.autograd.Function):
    """The second half of :class:`_ExpertParallel`: the activations of every source (``recv_counts[q]`` rows
    per local expert from rank q, one source after the other) through the down GEMM, each source's made and
    sent back while the next is made; the rows back in the order they were dispatched in.

    ========== =============================== =================================== ================================
    pass       this rank's                     per source rank q                   local experts' weights
    ========== =============================== =================================== ================================
    forward    acts (arrived, f) -> ys (rows,  act_q (rows_q, f) @ w2, made and    w2 (E/N, f, h)
               h)                              sent back while the next is
    dgrad      dys (rows, h) -> dacts          dy_q (rows_q, h) @ w2^T, as it      (the same)
               (arrived, f)                    arrives
    wgrad      (none)                          act_q^T @ dy_q                      dw2: every source's rows,
                                                                                   summed, times ``scale``
    ========== =============================== =================================== ================================
    """

    @staticmethod
    def forward(ctx, acts: torch.Tensor, w2: torch.Tensor, call, recv_counts: list[list[int]],
                send_rows: list[int], scale: float):
        work = _Experts(None, w2, recv_counts, scale)
        work.hold(work.act, acts)
        ys = _down_combine(call, work, send_rows, acts)
        ctx.state = (call, work, send_rows)
        return ys

    @staticmethod
    def backward(ctx, dys: torch.Tensor):
        call, work, send_rows = ctx.state
        ctx.state = None
        dys = dys.contiguous()
        dw2 = sum_zeros(work.w2)
        with _calls(call, "experts_combine.backward", 1):
            _down_backward_dispatch(call, work, dys, send_rows, dw2)
        return work.joined(work.d_act, dys, work.w2.shape[1]), rounded(dw2, work.w2.dtype), None, None, None, None


def not_traced() -> None:
    """Refuse a torch.compile trace of the exchanges, by name; under fullgraph=False Dynamo then runs this call
    eagerly (a graph break), where it returns."""
    if torch.compiler.is_compiling():
        raise CommfuseValueError(
            "MoE's dispatch and combine are sized on the host each call (dropless routing), so they cannot be part "
            "of a torch.compile graph: with fullgraph=False torch.compile runs them eagerly (a graph break) and "
            "compiles the router and the gating around them"
        )


def expert_parallel(xs, w13, w2, call, send_counts, meta, scale, shared=None):
    """The routed rows through the experts and back, the experts' gradients times ``scale``; with ``shared``
    (``xt``, ``sw13``, ``sw2``), also the shared experts' output on ``xt``, computed while the dispatch flies:
    ``(ys, shared_out)``."""
    not_traced()
    xt, sw13, sw2 = (None, None, None) if shared is None else shared
    return _ExpertParallel.apply(xs, w13, w2, call, send_counts, meta, scale, xt, sw13, sw2)


# -- the two halves, for a caller that runs something between them (commfuse.strands' stages) -------------------


def _half_backend(group, n: int, device: torch.device):
    """The backend of :func:`dispatch_experts` / :func:`experts_combine`: None for one process."""
    return None if n == 1 else backends.resolve(None, group, device)


def _half_call(algorithm: str, group, be, device: torch.device, rows: int, row_bytes: int):
    """The exchanges' resolved options (None for one process). ``auto`` decides on a balanced block of this
    rank's ``rows`` (``commfuse.nn.MoE``'s rule, so both halves decide alike), which every rank must share."""
    if be is None:
        return None
    return resolve_call(Collective.ALL_TO_ALL, algorithm, group=group, backend=be, device=device,
                        slice_bytes=rows // be.world_size * row_bytes, halves=True)


def _check_counts(where: str, rank: int, n: int, name: str, counts: torch.Tensor, local_experts: int) -> None:
    if counts.is_floating_point() or counts.is_complex() or tuple(counts.shape) != (n, local_experts):
        raise CommfuseValueError(
            f"{where}: rank {rank}: {name} must be integer rows per local expert of each rank, (world size {n}, "
            f"local experts {local_experts}), got {counts.dtype} {list(counts.shape)}")


def _check_operands(op: str, rank: int, data: tuple, weight: tuple, shapes_ok: bool, wanted: str) -> None:
    """A half's activations and weights: ``shapes_ok`` or a ``CommfuseValueError`` saying what was ``wanted``
    and got, then one dtype (``data``, ``weight``: (name, tensor))."""
    (a_name, a), (w_name, w) = data, weight
    if not shapes_ok:
        raise CommfuseValueError(f"{op}: rank {rank}: {wanted}, got {list(a.shape)} and {list(w.shape)}")
    if a.dtype != w.dtype:
        raise CommfuseTypeError(f"{op}: rank {rank}: {a_name} is {a.dtype} and {w_name} is {w.dtype}; cast one")


def dispatch_experts(xs: torch.Tensor, w13: torch.Tensor, send_counts: torch.Tensor, *, group, rank: int,
                     world_size: int, algorithm: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``commfuse.nn.moe.dispatch_experts`` (which documents it) on a resolved ``group``, this rank ``rank`` of
    its ``world_size``: the operands checked, the exchanges' options resolved, :class:`_DispatchExperts` run."""
    n = world_size
    be = _half_backend(group, n, xs.device)
    with op_calls(be, "dispatch_experts", 2):  # the counts, the dispatch: peers hear of a rank that leaves
        _check_operands("dispatch_experts", rank, ("xs", xs), ("w13", w13),
                        xs.ndim == 2 and w13.ndim == 3 and xs.shape[1] == w13.shape[1] and not w13.shape[2] % 2,
                        "xs must be (rows, hidden) and w13 (local experts, hidden, 2 * ffn)")
        _check_counts("dispatch_experts", rank, n, "send_counts", send_counts, w13.shape[0])
        rows = int(send_counts.sum())
        if rows != xs.shape[0]:
            raise CommfuseValueError(f"dispatch_experts: rank {rank}: send_counts sum to {rows} rows, xs has "
                                     f"{xs.shape[0]}")
        call = _half_call(algorithm, group, be, xs.device, rows, xs.shape[1] * xs.element_size())
        return _DispatchExperts.apply(xs, w13, call, send_counts, [w13.shape[1], w13.shape[2] // 2], 1.0 / n)


def experts_combine(acts: torch.Tensor, w2: torch.Tensor, recv_counts: torch.Tensor, send_counts: torch.Tensor, *,
                    group, rank: int, world_size: int, algorithm: str) -> torch.Tensor:
    """``commfuse.nn.moe.experts_combine`` (which documents it) on a resolved ``group``, this rank ``rank`` of
    its ``world_size``: the operands checked, the exchanges' options resolved, :class:`_ExpertsCombine` run."""
    n = world_size
    be = _half_backend(group, n, acts.device)
    with op_calls(be, "experts_combine", 1):  # peers hear of a rank that leaves
        _check_operands("experts_combine", rank, ("acts", acts), ("w2", w2),
                        acts.ndim == 2 and w2.ndim == 3 and acts.shape[1] == w2.shape[1],
                        "acts must be (rows arrived, ffn) and w2 (local experts, ffn, hidden)")
        _check_counts("experts_combine", rank, n, "send_counts", send_counts, w2.shape[0])
        _check_counts("experts_combine", rank, n, "recv_counts", recv_counts, w2.shape[0])
        recv, send_rows = recv_counts.tolist(), send_counts.sum(dim=1).tolist()
        arrived = sum(map(sum, recv))
        if arrived != acts.shape[0]:
            raise CommfuseValueError(
                f"experts_combine: rank {rank}: recv_counts sum to {arrived} rows, acts has {acts.shape[0]}; pass "
                "dispatch_experts' outputs")
        call = _half_call(algorithm, group, be, acts.device, sum(send_rows), w2.shape[2] * acts.element_size())
        return _ExpertsCombine.apply(acts, w2, call, recv, send_rows, 1.0 / n)


eager_only(expert_parallel, dispatch_experts, experts_combine)

register_format("moe.experts.sizes", lambda v: f"{v[0]} local experts' counts per rank, hidden {v[1]}, ffn {v[2]}")
for _label in ("moe.dispatch", "moe.combine", "moe.dispatch.backward", "moe.combine.backward"):
    register_format(_label, lambda v: f"token rows of {v[3:3 + v[2]]} (dim {v[1]} differs per peer)")
