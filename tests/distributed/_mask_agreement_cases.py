"""Rank-side bodies of the mask agreement tests: per-call masks and document metadata that differ in content
from rank to rank (commfuse.nn.ParallelAttention's document_ids, cu_seqlens and boolean attn_mask, ring
attention's document_lengths, one list or one per row) raise MismatchError on every rank naming both ranks and
what differs, and the next call on the same group, with the masks equal again, matches the unsharded
attention."""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import commfuse as cf
from commfuse import backends
from commfuse.errors import MismatchError, PeerFailedError
from commfuse.fused import ring_attention as ring_module
from commfuse.runtime.groups import group_state

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ring_attention_cases import mesh_2d, reference  # noqa: E402
from _tp_cases import _run  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-5)  # float32, summed in another order
HEADS, HEAD_DIM, ROWS = 6, 4, 4  # ParallelAttention: 6 heads divide over 2 and 3 ranks; 4 rows a rank


def _close(got, want, what):
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {list(got.shape)} != {list(want.shape)}")
    if not torch.allclose(got, want, **TOL):
        raise AssertionError(f"{what}: max diff {(got - want).abs().max().item():.3g}")


def _calls_made(call) -> int:
    """How many numbered calls ``call()`` makes on the world group (every lane)."""
    state = group_state(backends.resolve(None, None, torch.device("cpu")))
    before = sum(state.seqs.values())
    call()
    return sum(state.seqs.values()) - before


def _rides(results: dict, name: str, plain, checked) -> None:
    """``checked()`` (an op with masks the ranks compare) makes no numbered call more than ``plain()`` (the op
    without them): the masks' digest rides the op's own transfers (commfuse.runtime.rider)."""
    def run():
        plain(), checked()  # the first calls plan and check their signatures
        made = _calls_made(plain), _calls_made(checked)
        if made[0] != made[1]:
            raise AssertionError(f"with the masks compared the op makes {made[1]} calls, without {made[0]}: the "
                                 "comparison is an exchange of its own, not carried by the op's transfers")
    _run(results, name, run)


def _mismatch(results: dict, name: str, call, *words) -> None:
    """``call()`` must raise MismatchError naming every one of ``words``; the wall time from the call to the
    error on this rank goes into ``results`` as ``time:<name>`` (seconds)."""
    t0 = time.perf_counter()
    try:
        call()
    except MismatchError as e:
        results[f"time:{name}"] = time.perf_counter() - t0
        missing = [w for w in words if w not in str(e)]
        if missing:
            raise AssertionError(f"the error does not say {missing}: {e}") from e
        return
    raise AssertionError(f"no MismatchError naming {words}: the call returned a result")


# -- ParallelAttention ---------------------------------------------------------------------------------------------


def _ids(lengths) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def cu(rows) -> torch.Tensor:
    """Cumulative document lengths over the flattened batch, from each row's lengths."""
    ends = [0]
    for row in rows:
        for length in row:
            ends.append(ends[-1] + length)
    return torch.tensor(ends, dtype=torch.int32)


def _two_masks(s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A boolean (s, s) mask in which every query sees itself, and a copy that differs in one place."""
    allowed = torch.rand(s, s, generator=torch.Generator().manual_seed(3)) < 0.6
    allowed |= torch.eye(s, dtype=torch.bool)
    differs = allowed.clone()
    differs[0, 1] = not bool(differs[0, 1])
    return allowed, differs


def _whole(linears, x, allowed, causal):
    """The unsharded attention of x (b, s, hidden) through the layer's four projections, ``allowed`` (b or 1,
    1, s, s) boolean."""
    q_proj, k_proj, v_proj, o_proj = linears
    b, s, _ = x.shape
    q, k, v = (p(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for p in (q_proj, k_proj, v_proj))
    if causal:
        allowed = allowed & torch.ones(s, s, dtype=torch.bool).tril()
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    return o_proj(o.transpose(1, 2).reshape(b, s, -1))


def parallel_attention(rank: int, n: int, check: str = "") -> dict:
    """document_ids and cu_seqlens that differ on the last rank, and with ``check`` "always"
    (COMMFUSE_CHECK=always, set before the process's first call: the mode is read when a call is first
    resolved) a boolean attn_mask too: MismatchError on every rank naming rank 0 and the last rank and the
    argument; then the same layer with the masks equal matches the unsharded attention."""
    if check:
        os.environ["COMMFUSE_CHECK"] = check
    torch.set_num_threads(1)
    results: dict = {}
    torch.manual_seed(0)
    layer = cf.nn.ParallelAttention(HEADS * HEAD_DIM, HEADS, causal=False, algorithm="ring")
    linears = layer.to_linears()
    s = ROWS * n
    x = torch.randn(2, s, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(1))
    mine = x[:, rank * ROWS : (rank + 1) * ROWS]
    last = rank == n - 1
    halves, other = [s // 2, s - s // 2], [3, s - 3]
    names = ("rank 0", f"rank {n - 1}")

    def healthy(kw, allowed, what):
        got = layer(mine, **kw)
        want = _whole(linears, x, allowed, False)[:, rank * ROWS : (rank + 1) * ROWS]
        _close(got.detach(), want.detach(), what)

    def document_ids():
        ids = _ids(other if last else halves)
        _mismatch(results, "document-ids", lambda: layer(mine, document_ids=ids), *names, "document_ids",
                  f"lengths {halves}", f"lengths {other}")
        same = _ids(halves)
        healthy(dict(document_ids=same), (same[:, None] == same[None, :])[None, None], "after document_ids")

    def cu_seqlens():
        mine_cu = cu([halves, other if last else halves])
        _mismatch(results, "cu-seqlens", lambda: layer(mine, cu_seqlens=mine_cu), *names, "cu_seqlens")
        same = _ids(halves)
        healthy(dict(cu_seqlens=cu([halves, halves])), (same[:, None] == same[None, :])[None, None],
                "after cu_seqlens")

    def boolean():
        allowed, differs = _two_masks(s)
        _mismatch(results, "boolean", lambda: layer(mine, attn_mask=differs if last else allowed), *names,
                  "attn_mask", "bool [", " attend")
        healthy(dict(attn_mask=allowed), allowed[None, None], "after attn_mask")

    _run(results, "document-ids", document_ids)
    _run(results, "cu-seqlens", cu_seqlens)
    same = _ids(halves)
    _rides(results, "rides", lambda: layer(mine), lambda: layer(mine, document_ids=same))
    if check == "always":
        _run(results, "boolean", boolean)
    return results


# -- commfuse.tp.AttentionParallel ------------------------------------------------------------------------------------


def attention_parallel(rank: int, n: int, check: str = "") -> dict:
    """commfuse.tp.AttentionParallel on a block given its masks by keyword: document_ids and cu_seqlens that
    differ on the last rank (and with ``check`` "always" a boolean attn_mask): MismatchError on every rank naming
    the block, rank 0, the last rank and the argument; then the same block with equal masks matches the unsharded
    attention; and a call with masks makes as many numbered calls as one without (the digest rides)."""
    if check:
        os.environ["COMMFUSE_CHECK"] = check
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from _masks_cases import KeywordAttention, _projections, _Reference  # noqa: E402

    torch.set_num_threads(1)
    results: dict = {}
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    s, h = 4 * n, 8 * n
    q, k, v, o = _projections(n, bias=False)
    ref = _Reference(q, k, v, o, 2 * n)
    block = KeywordAttention(*(copy.deepcopy(m) for m in (q, k, v, o)))
    parallelize_module(block, mesh, cf.tp.AttentionParallel(head_dim=4, causal=False, algorithm="ring"))
    x = torch.randn(2, s, h, generator=torch.Generator().manual_seed(7))
    mine = x.tensor_split(n, dim=1)[rank]
    last = rank == n - 1
    halves, other = [s // 2, s - s // 2], [3, s - 3]
    names = ("rank 0", f"rank {n - 1}", "AttentionParallel")
    same = _ids(halves)
    allowed = (same[:, None] == same[None, :])[None, None]

    def healthy(kw, allowed, what):
        with torch.no_grad():
            _close(block(mine, **kw), ref(x, False, allowed).tensor_split(n, dim=1)[rank], what)

    def document_ids():
        ids = _ids(other if last else halves)
        _mismatch(results, "tp-document-ids", lambda: block(mine, document_ids=ids), *names, "document_ids")
        healthy(dict(document_ids=same), allowed, "after document_ids")

    def cu_seqlens():
        _mismatch(results, "tp-cu-seqlens", lambda: block(mine, cu_seqlens=cu([halves, other if last else halves])),
                  *names, "cu_seqlens")
        healthy(dict(cu_seqlens=cu([halves, halves])), allowed, "after cu_seqlens")

    def boolean():
        dense, differs = _two_masks(s)
        _mismatch(results, "tp-boolean", lambda: block(mine, attn_mask=differs if last else dense), *names,
                  "attn_mask")
        healthy(dict(attn_mask=dense), dense[None, None], "after attn_mask")

    _run(results, "tp-document-ids", document_ids)
    _run(results, "tp-cu-seqlens", cu_seqlens)
    if check == "always":
        _run(results, "tp-boolean", boolean)
    _rides(results, "tp-rides", lambda: block(mine), lambda: block(mine, document_ids=same))
    return results


# -- ring attention ------------------------------------------------------------------------------------------------


def ring_attention(rank: int, n: int) -> dict:
    """document_lengths ([s/2, s/2] against [s/4, 3s/4]) and per-row lists that differ on the last rank:
    MismatchError on every rank naming rank 0, the last rank and both values; then a call with equal lengths
    matches the unsharded attention, forward and backward (lengths given as a tensor on one rank and a list on
another agree); and through commfuse.nn.RingAttention too."""
    torch.set_num_threads(1)
    results: dict = {}
    length = 8
    s = length * n
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, s, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    rows = slice(rank * length, (rank + 1) * length)
    last = rank == n - 1
    halves, quarter = [s // 2, s - s // 2], [s // 4, s - s // 4]
    names = ("rank 0", f"rank {n - 1}")

    def healthy(lengths, what):
        mine = [t[:, rows].detach().requires_grad_() for t in (q, k, v)]
        got = cf.ring_attention(*mine, causal=True, algorithm="ring", document_lengths=lengths)
        whole = [t.detach().requires_grad_() for t in (q, k, v)]
        want = reference(*whole, True, lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)
        _close(got, want[:, rows], what)
        dout = torch.randn(want.shape, generator=torch.Generator().manual_seed(11), dtype=want.dtype)
        got.backward(dout[:, rows])
        want.backward(dout)
        for name, a, b in zip("qkv", mine, whole):
            _close(a.grad, b.grad[:, rows], f"{what}: d{name}")

    def lengths():
        mine = [t[:, rows] for t in (q, k, v)]
        _mismatch(results, "lengths",
                  lambda: cf.ring_attention(*mine, algorithm="ring", document_lengths=quarter if last else halves),
                  *names, "document_lengths", repr(halves), repr(quarter))
        healthy(halves, "after document_lengths")
        # a 1-D tensor on the last rank, a list on the others, the same lengths: they agree
        healthy(torch.tensor(halves) if last else halves, "lengths as a tensor on one rank")

    def per_row():
        mine = [t[:, rows] for t in (q, k, v)]
        want, theirs = [halves, quarter], [halves, [s]]
        _mismatch(results, "per-row",
                  lambda: cf.ring_attention(*mine, algorithm="ring", document_lengths=theirs if last else want),
                  *names, "document_lengths", repr(want), repr(theirs))
        healthy(want, "after per-row document_lengths")

    def middle(algorithm):  # rank 1 alone differs: on 3 ranks rank 0 hears of it only through rank 2's flag
        mine = [t[:, rows] for t in (q, k, v)]
        odd = quarter if rank == 1 else halves
        _mismatch(results, f"middle-{algorithm}",
                  lambda: cf.ring_attention(*mine, algorithm=algorithm, document_lengths=odd),
                  "rank 0", "rank 1", "document_lengths", repr(halves), repr(quarter))
        healthy(halves, f"after the middle rank's lengths ({algorithm})")

    def failing():
        """The last rank fails in its first block while the digest rides. It raises its own error; every other
        rank raises PeerFailedError naming it (the call drained, digest pairs included) or, where its own ring
        completed before it heard (the failed block was the last rank's alone), returns its result, which must
        be right; and the next call with equal lengths is right on every rank."""
        mine = [t[:, rows] for t in (q, k, v)]
        lengths = halves
        real, seen = ring_module.block_attention, []

        def broken(*args, **kwargs):
            seen.append(1)
            if len(seen) == 1:
                raise RuntimeError("the first block failed on purpose")
            return real(*args, **kwargs)

        if last:
            ring_module.block_attention = broken
        try:
            got = cf.ring_attention(*mine, algorithm="ring", document_lengths=lengths)
        except PeerFailedError as e:
            if last or f"rank {n - 1}" not in str(e):
                raise
        except Exception as e:  # noqa: BLE001 - the failing rank's own error
            if not last:
                raise
            if "on purpose" not in str(e):
                raise AssertionError(f"the failing rank's own error does not say why: {e}") from e
        else:
            if last:
                raise AssertionError("the failing rank's call returned")
            _close(got, reference(q, k, v, True, halves)[:, rows], "a result returned beside the failed rank")
        finally:
            ring_module.block_attention = real
        healthy(halves, "after a rank failed in the call")

    def layer():  # commfuse.nn.RingAttention passes document_lengths to the op: refused the same way
        torch.manual_seed(0)
        ra = cf.nn.RingAttention(16, 4, num_kv_heads=2, group=None)
        x = torch.randn(2, length, 16, generator=torch.Generator().manual_seed(rank))
        _mismatch(results, "layer", lambda: ra(x, document_lengths=quarter if last else halves), *names,
                  "document_lengths")
        ra(x, document_lengths=halves)

    _run(results, "lengths", lengths)
    _run(results, "per-row", per_row)
    # the digest rides every algorithm's transfers; vanilla's whole collective carries none, and an exchange of
    # its own after the call compares instead
    for algorithm in ("ring", "ring:2", "bidirectional", "vanilla"):
        _run(results, f"middle-{algorithm}", functools.partial(middle, algorithm))
    _run(results, "layer", layer)
    _run(results, "fails", failing)
    mine = [t[:, rows] for t in (q, k, v)]
    _rides(results, "rides", lambda: cf.ring_attention(*mine, algorithm="ring"),
           lambda: cf.ring_attention(*mine, algorithm="ring", document_lengths=halves))
    return results


# -- the 2-D form: the Ulysses group compares too ---------------------------------------------------------------------


def two_dimensional(rank: int, n: int, algorithm: str = "ring") -> dict:
    """cp x ulysses of 2 x 2 (n = 4): the ranks of Ulysses index 1 pass other document_lengths than those of
    index 0. Each cp group agrees within itself, so only the Ulysses groups' comparison can see it: MismatchError
    on every rank naming the Ulysses group and both values; then equal lengths match the unsharded attention."""
    from commfuse.fused.ring_attention import ulysses_positions

    torch.set_num_threads(1)
    results: dict = {}
    cp_size, u_size, cp_rank, u_rank, cp_group, u_group = mesh_2d(rank, n)
    g = torch.Generator().manual_seed(5)
    s = 4 * n
    q, k, v = (torch.randn(1, s, 4, 4, generator=g, dtype=torch.float64) for _ in range(3))
    halves, quarter = [s // 2, s - s // 2], [s // 4, s - s // 4]
    pos = ulysses_positions(s, cp_rank, cp_size, u_rank, u_size)
    mine = [t[:, pos] for t in (q, k, v)]

    def call(lengths):
        return cf.ring_attention(*mine, group=cp_group, ulysses_group=u_group, algorithm=algorithm,
                                 document_lengths=lengths)

    def differs():
        _mismatch(results, "two-d", lambda: call(quarter if u_rank == 1 else halves), "Ulysses group",
                  "document_lengths", repr(halves), repr(quarter))
        _close(call(halves), reference(q, k, v, True, halves)[:, pos], "after the Ulysses group's lengths")

    _run(results, "two-d", differs)
    return results
