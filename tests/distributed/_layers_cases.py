"""Rank-side bodies of the layer tests: every layer and gradient against the unsharded single-process layer."""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist
from torch import nn

import commfuse as cf
from commfuse.nn import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelMLP,
    RowParallelLinear,
    ShardedLinear,
    UlyssesAttention,
    attend,
)

TOL = dict(rtol=1e-4, atol=1e-5)


def _close(got, want, what):
    got = got.to_local() if hasattr(got, "to_local") else got  # a DTensor parameter's gradient: this rank's piece
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {list(got.shape)} != {list(want.shape)}")
    if not torch.allclose(got, want, **TOL):
        raise AssertionError(f"{what}: max diff {(got - want).abs().max().item():.3g}")


def _run(results, name, fn):
    try:
        fn()
        results[name] = None
    except Exception as e:
        results[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"


def _seq(t, rank, n, dim=1):
    return t.tensor_split(n, dim=dim)[rank]


def ops_autograd(rank, n, alg, keep, dim):
    g = torch.Generator().manual_seed(3)
    full = [2, 3 * n, 8]
    full[dim] = 3 * n if dim == 1 else 2 * n
    A = torch.randn(full, generator=g)
    B1, B2 = torch.randn(8, 5, generator=g), torch.randn(8, 7, generator=g)
    G1 = torch.randn(*full[:-1], 5, generator=g)
    G2 = torch.randn(*full[:-1], 7, generator=g)
    # reference
    a_ref, b1_ref, b2_ref = A.clone().requires_grad_(), B1.clone().requires_grad_(), B2.clone().requires_grad_()
    ((a_ref @ b1_ref) * G1).sum().add(((a_ref @ b2_ref) * G2).sum()).backward()
    # sharded: every rank holds its own copy of the weights; the reference's weight gradient is the sum over ranks
    a = _seq(A, rank, n, dim).clone().requires_grad_()
    b1, b2 = B1.clone().requires_grad_(), B2.clone().requires_grad_()
    y1, y2 = cf.all_gather_matmul(a, [b1, b2], gather_dim=dim, algorithm=alg, keep_gathered=keep, timeout=60)
    # every rank computes the whole output, so count its loss 1/n times: the total is the reference loss
    (y1 * G1).sum().add((y2 * G2).sum()).div(n).backward()
    _close(a.grad, _seq(a_ref.grad, rank, n, dim), "all_gather_matmul da (reduce-scattered over ranks)")
    _close(b1.grad, b1_ref.grad / n, "all_gather_matmul db1")
    _close(b2.grad, b2_ref.grad / n, "all_gather_matmul db2")
    # matmul_reduce_scatter: rank r holds a_r; z = sum_r a_r @ b scattered
    As = [torch.randn(full, generator=torch.Generator().manual_seed(50 + r)) for r in range(n)]
    W = torch.randn(8, 6, generator=g)
    H = torch.randn(*full[:-1], 6, generator=g)
    refs = [x.clone().requires_grad_() for x in As]
    w_ref = W.clone().requires_grad_()
    for reduce_op in ("sum", "avg"):
        for t in refs + [w_ref]:
            t.grad = None
        total = sum(x @ w_ref for x in refs)
        if reduce_op == "avg":
            total = total / n
        (total * H).sum().backward()
        x = As[rank].clone().requires_grad_()
        w = W.clone().requires_grad_()
        z = cf.matmul_reduce_scatter(x, w, scatter_dim=dim, reduce_op=reduce_op, algorithm=alg, timeout=60)
        (z * _seq(H, rank, n, dim)).sum().backward()
        _close(z.detach(), _seq(total.detach(), rank, n, dim), f"matmul_reduce_scatter {reduce_op} forward")
        _close(x.grad, refs[rank].grad, f"matmul_reduce_scatter {reduce_op} da")
        wg = w.grad.clone()
        dist.all_reduce(wg)
        _close(wg, w_ref.grad, f"matmul_reduce_scatter {reduce_op} db (summed over ranks)")


def _check_layer(rank, n, ref: nn.Module, layer: nn.Module, x_full, *, dp=False, pairs=()):
    """Forward and every gradient of ``layer`` (sharded) against ``ref`` (unsharded)."""
    g = torch.Generator().manual_seed(11)
    x_ref = x_full.clone().requires_grad_()
    out_ref = ref(x_ref)
    G = torch.randn(out_ref.shape, generator=g)
    (out_ref * G).sum().backward()
    if dp:  # data parallel: each rank its batch rows, the loss averaged over ranks
        x = x_full.tensor_split(n, dim=0)[rank].clone().requires_grad_()
        out = layer(x)
        _close(out.detach(), out_ref.detach().tensor_split(n, dim=0)[rank], "forward")
        (out * G.tensor_split(n, dim=0)[rank]).sum().mul(n).backward()
        _close(x.grad, x_ref.grad.tensor_split(n, dim=0)[rank] * n, "input grad")
    else:
        x = _seq(x_full, rank, n).clone().requires_grad_()
        out = layer(x)
        _close(out.detach(), _seq(out_ref.detach(), rank, n), "forward")
        (out * _seq(G, rank, n)).sum().backward()
        _close(x.grad, _seq(x_ref.grad, rank, n), "input grad")
    for mine, (ref_grad, what) in pairs(layer, ref):
        _close(mine, ref_grad, what)


def layers(rank, n):
    results = {}
    torch.manual_seed(0)
    h, ffn, b, L = 16, 24, 2, 3
    s = L * n

    def column():
        ref = nn.Linear(h, ffn)
        layer = ColumnParallelLinear.from_linear(ref, algorithm="ring")
        start = sum(ffn // n + (1 if i < ffn % n else 0) for i in range(rank))
        rows = ffn // n + (1 if rank < ffn % n else 0)
        x = torch.randn(b, s, h)
        x_ref = x.clone().requires_grad_()
        out_ref = ref(x_ref)
        G = torch.randn(out_ref.shape)
        (out_ref * G).sum().backward()
        xs = _seq(x, rank, n).clone().requires_grad_()
        out = layer(xs)
        _close(out.detach(), out_ref.detach()[..., start : start + rows], "forward")
        (out * G[..., start : start + rows]).sum().backward()
        dx = xs.grad
        _close(dx, _seq(x_ref.grad, rank, n), "input grad")
        _close(layer.weight.grad, ref.weight.grad[start : start + rows], "weight grad")
        _close(layer.bias.grad, ref.bias.grad[start : start + rows], "bias grad")

    def row():
        ref = nn.Linear(ffn, h)
        layer = RowParallelLinear.from_linear(ref, algorithm="bidirectional")
        start = sum(ffn // n + (1 if i < ffn % n else 0) for i in range(rank))
        cols = ffn // n + (1 if rank < ffn % n else 0)
        x = torch.randn(b, s, ffn)
        x_ref = x.clone().requires_grad_()
        out_ref = ref(x_ref)
        G = torch.randn(out_ref.shape)
        (out_ref * G).sum().backward()
        xs = x[..., start : start + cols].clone().requires_grad_()
        out = layer(xs)
        _close(out.detach(), _seq(out_ref.detach(), rank, n), "forward")
        (out * _seq(G, rank, n)).sum().backward()
        _close(xs.grad, x_ref.grad[..., start : start + cols], "input grad")
        _close(layer.weight.grad, ref.weight.grad[:, start : start + cols], "weight grad")
        _close(layer.bias.grad, ref.bias.grad, "bias grad (summed over ranks)")

    def mlp():
        fc1, fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)
        ref = nn.Sequential(fc1, nn.GELU(), fc2)
        for alg in ("ring", "sliced:2", "vanilla", "ring:2"):
            for p in ref.parameters():
                p.grad = None
            layer = ParallelMLP.from_linears(fc1, fc2, algorithm=alg)

            def pairs(layer, ref):
                r1, r2 = layer.to_linears()  # the gradients, gathered the same way as the weights
                yield _gathered_grad(layer.fc1, 0, ffn), (fc1.weight.grad, "fc1 weight grad")
                yield _gathered_grad(layer.fc2, 1, ffn), (fc2.weight.grad, "fc2 weight grad")
                yield layer.fc2.bias.grad, (fc2.bias.grad, "fc2 bias grad")

            _check_layer(rank, n, ref, layer, torch.randn(b, s, h), pairs=pairs)

    def attention():
        heads, kv = 12, (4 if n == 4 else 6)
        hd = 48
        q, k, v = nn.Linear(hd, hd, bias=False), nn.Linear(hd, kv * 4, bias=False), nn.Linear(hd, kv * 4, bias=False)
        o = nn.Linear(hd, hd, bias=False)
        for causal in (True, False):
            ref = _RefAttention(q, k, v, o, heads, kv, causal)
            for alg in ("ring", "vanilla", "bidirectional"):
                for p in ref.parameters():
                    p.grad = None
                layer = ParallelAttention.from_linears(q, k, v, o, num_heads=heads, num_kv_heads=kv, causal=causal,
                                                       algorithm=alg)

                def pairs(layer, ref):
                    lq, lk, lv, lo = layer.to_linears()
                    yield _gathered(layer.wq.grad, 0), (q.weight.grad, "wq grad")
                    yield _gathered(layer.wk.grad, 0), (k.weight.grad, "wk grad")
                    yield _gathered(layer.wv.grad, 0), (v.weight.grad, "wv grad")
                    yield _gathered(layer.wo.grad, 1), (o.weight.grad, "wo grad")

                _check_layer(rank, n, ref, layer, torch.randn(b, s, hd), pairs=pairs)

    def ulysses():
        heads, kv = 12, (4 if n == 4 else 6)
        hd = 48
        q, k, v = nn.Linear(hd, hd), nn.Linear(hd, kv * 4), nn.Linear(hd, kv * 4)
        o = nn.Linear(hd, hd)
        ref = _RefAttention(q, k, v, o, heads, kv, True)
        for alg in ("ring", "vanilla", "ring:2"):
            for p in ref.parameters():
                p.grad = None
            layer = UlyssesAttention.from_linears(q, k, v, o, num_heads=heads, num_kv_heads=kv, algorithm=alg)

            def pairs(layer, ref):
                for mine, theirs, name in ((layer.q_proj, q, "q"), (layer.k_proj, k, "k"), (layer.v_proj, v, "v"),
                                           (layer.o_proj, o, "o")):
                    yield mine.weight.grad, (theirs.weight.grad, f"{name} weight grad (summed over ranks)")
                    yield mine.bias.grad, (theirs.bias.grad, f"{name} bias grad")

            _check_layer(rank, n, ref, layer, torch.randn(b, s, hd), pairs=pairs)

    def sharded():
        ref = nn.Linear(h, 12)
        for alg in ("ring", "vanilla", "bidirectional"):
            for p in ref.parameters():
                p.grad = None
            layer = ShardedLinear.from_linear(ref, algorithm=alg)
            rows = 12 // n

            def pairs(layer, ref):
                from torch.distributed.tensor import DTensor

                for mine, theirs, what in ((layer.weight, ref.weight, "weight"), (layer.bias, ref.bias, "bias")):
                    if n > 1:  # a DTensor Shard(0) on the group: its local rows, and the whole on every rank
                        if not isinstance(mine, DTensor) or not isinstance(mine.grad, DTensor):
                            raise AssertionError(f"{what}: {type(mine).__name__} with a {type(mine.grad).__name__} "
                                                 "gradient, not DTensors")
                        yield mine.grad.full_tensor(), (theirs.grad, f"{what} grad (gathered)")
                        yield mine.grad.to_local(), (theirs.grad[rank * rows : (rank + 1) * rows], f"{what} grad")
                    else:
                        yield mine.grad, (theirs.grad, f"{what} grad")

            # each rank its own batch rows; the per-rank loss times n, gradients averaged: equals the whole batch
            _check_layer(rank, n, ref, layer, torch.randn(2 * n, 5, h), dp=True, pairs=pairs)

    def roundtrip():
        lin = nn.Linear(h, ffn)
        for cls in (ColumnParallelLinear, RowParallelLinear, ShardedLinear):
            sharded = h if cls is RowParallelLinear else ffn  # the dim the layer splits over the ranks
            if sharded % n:  # DTensor parameters need even shards: refused, by name
                try:
                    cls.from_linear(lin)
                except cf.errors.CommfuseValueError as e:
                    assert "divisible" in str(e) or "does not divide" in str(e), e
                    continue
                raise AssertionError(f"{cls.__name__} took {sharded} features over {n} ranks")
            back = cls.from_linear(lin).to_linear()
            assert torch.equal(back.weight, lin.weight) and torch.equal(back.bias, lin.bias), cls.__name__
        fc1, fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)
        b1, b2 = ParallelMLP.from_linears(fc1, fc2).to_linears()
        assert torch.equal(b1.weight, fc1.weight) and torch.equal(b2.weight, fc2.weight) and torch.equal(b2.bias, fc2.bias)
        projs = [nn.Linear(48, 48, bias=True), nn.Linear(48, 24), nn.Linear(48, 24), nn.Linear(48, 48)]
        for cls in (ParallelAttention, UlyssesAttention):
            back = cls.from_linears(*projs, num_heads=12, num_kv_heads=6 if n != 4 else 4).to_linears() \
                if n != 4 else None
            if back is not None:
                for x, y in zip(back, projs):
                    assert torch.equal(x.weight, y.weight) and torch.equal(x.bias, y.bias), cls.__name__
        # a state_dict saved from the converted Linear loads into a fresh nn.Linear, bit for bit
        state = ColumnParallelLinear.from_linear(lin).to_linear().state_dict()
        fresh = nn.Linear(h, ffn)
        fresh.load_state_dict(state)
        assert torch.equal(fresh.weight, lin.weight)

    def measure_modes():
        # every layer runs forward + backward with its fused ops' compute or transfers removed (what
        # `commfuse bench` times), gives outputs and gradients of the right shapes, and in comm_only
        # never runs the attention that the Ulysses all-to-all's consumer would compute
        import commfuse.fused.attention as attention_module  # where the attention lives
        from commfuse.runtime import measure

        heads = 2 * n
        hd = 2 * heads
        layers_ = {"mlp": ParallelMLP(hd, 2 * hd), "attention": ParallelAttention(hd, heads),
                   "ulysses": UlyssesAttention(hd, heads), "sharded": ShardedLinear(hd, 2 * n)}
        real_attend, calls = attention_module.attend, []

        def counted(*args, **kwargs):
            calls.append(1)
            return real_attend(*args, **kwargs)

        attention_module.attend = counted
        try:
            for name, layer in layers_.items():
                for mode in ("comm_only", "compute_only", "outside_only"):
                    for alg in ("ring", "vanilla"):
                        layer.algorithm = alg
                        layer.zero_grad()
                        x = torch.randn(b, L, hd, requires_grad=True)
                        with torch.no_grad():
                            want = layer(x).shape
                        calls.clear()
                        with measure(mode):
                            y = layer(x)
                            y.sum().backward()
                        where = f"{name} {alg} under measure({mode!r})"
                        if y.shape != want or x.grad is None or x.grad.shape != x.shape:
                            raise AssertionError(f"{where}: output {list(y.shape)} (want {list(want)}), input grad "
                                                 f"{None if x.grad is None else list(x.grad.shape)}")
                        for pname, p in layer.named_parameters():
                            # comm_only may leave a weight gradient computed inside a removed consumer unset
                            if (p.grad is None and mode == "compute_only") or (p.grad is not None
                                                                              and p.grad.shape != p.shape):
                                raise AssertionError(f"{where}: parameter {pname} has grad "
                                                     f"{None if p.grad is None else list(p.grad.shape)}")
                        # (world size 1 runs no fused op: the attention is plain local compute there)
                        if name == "ulysses" and mode in ("comm_only", "outside_only") and calls and n > 1:
                            raise AssertionError(f"{where}: the attention ran {len(calls)} times; it is the "
                                                 "consumer's compute and should have been removed")
                        if name == "ulysses" and mode == "compute_only" and not calls:
                            raise AssertionError(f"{where}: the attention never ran")
        finally:
            attention_module.attend = real_attend

    def seeded(fn, seed):
        def run():
            torch.manual_seed(seed)  # every rank draws the same reference weights and data
            fn()
        return run

    for seed, (name, fn) in enumerate([("column", column), ("row", row), ("mlp", mlp), ("attention", attention), ("ulysses", ulysses),
                     ("sharded", sharded), ("roundtrip", roundtrip), ("measure-modes", measure_modes)]):
        _run(results, name, seeded(fn, seed))
    for alg in ("ring", "bidirectional", "sliced:2", "vanilla"):
        for keep in (True, False):
            for dim in (0, 1):
                _run(results, f"ops-{alg}-keep{keep}-dim{dim}", lambda: ops_autograd(rank, n, alg, keep, dim))
    return results


def _gathered(grad, dim):
    from commfuse.nn._common import gather_dim

    full = torch.tensor(grad.to_local().shape[dim] if hasattr(grad, "to_local") else grad.shape[dim])
    dist.all_reduce(full)
    return gather_dim(grad, dim, int(full), None)


def _gathered_grad(layer, dim, full):
    from commfuse.nn._common import gather_dim

    return gather_dim(layer.weight.grad, dim, full, None)


class _RefAttention(nn.Module):
    """The unsharded attention the parallel ones must equal."""

    def __init__(self, q, k, v, o, heads, kv, causal):
        super().__init__()
        self.q, self.k, self.v, self.o, self.heads, self.kv, self.causal = q, k, v, o, heads, kv, causal

    def forward(self, x):
        b, s, _ = x.shape
        d = self.q.out_features // self.heads
        out = attend(self.q(x).view(b, s, -1, d), self.k(x).view(b, s, -1, d), self.v(x).view(b, s, -1, d),
                     causal=self.causal)
        return self.o(out.reshape(b, s, -1))


# -- training: the loss curve of a sharded model equals the unsharded one's ------------------------------


def _sgd(params, lr):
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p -= lr * p.grad
                p.grad = None


def _all_reduce_grads(params):
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad)


class _Block(nn.Module):
    def __init__(self, attn, mlp):
        super().__init__()
        self.attn, self.mlp = attn, mlp

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


def _curve(model, data, shard, loss_of, steps, lr, after_backward=lambda: None):
    losses = []
    for step in range(steps):
        x, target = data(step)
        out = model(shard(x))
        loss = loss_of(out, shard(target))
        loss.backward()
        after_backward()
        total = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(total.item())
        _sgd(model.parameters(), lr)
    return losses


def _same_curve(mine, ref, what):
    for step, (a, b) in enumerate(zip(mine, ref)):
        if abs(a - b) > 1e-4 * max(1.0, abs(b)):
            raise AssertionError(f"{what}: step {step} loss {a} vs unsharded {b} (curve {mine} vs {ref})")
    if not ref[-1] < ref[0]:
        raise AssertionError(f"{what}: the reference did not learn ({ref[0]} -> {ref[-1]})")


def training(rank, n):
    results = {}
    h, heads, kv, b, L, steps = 48, 12, (4 if n == 4 else 6), 2, 3, 20
    s = L * n

    def data(step):
        g = torch.Generator().manual_seed(1000)  # one fixed batch: the loss must fall
        return torch.randn(b, s, h, generator=g), torch.randn(b, s, h, generator=g)

    def mse(out, target):  # each rank's share of the global mean squared error
        return ((out - target) ** 2).sum() / (b * s * h)

    def seq_shard(t):
        return t.tensor_split(n, dim=1)[rank]

    def tpsp():
        torch.manual_seed(7)
        q, k, v, o = nn.Linear(h, h), nn.Linear(h, kv * 4), nn.Linear(h, kv * 4), nn.Linear(h, h)
        fc1, fc2 = nn.Linear(h, 2 * h), nn.Linear(2 * h, h)
        ref = _Block(_RefAttention(q, k, v, o, heads, kv, True), nn.Sequential(fc1, nn.GELU(), fc2))
        model = _Block(ParallelAttention.from_linears(q, k, v, o, num_heads=heads, num_kv_heads=kv, algorithm="ring"),
                       ParallelMLP.from_linears(fc1, fc2, algorithm="ring"))
        import copy

        ref_curve = _curve(copy.deepcopy(ref), data, lambda t: t, mse, steps, 0.05)
        if dist.is_initialized():  # the reference is not distributed: undo the all-reduce of its losses
            ref_curve = [v / n for v in ref_curve]
        mine = _curve(model, data, seq_shard, mse, steps, 0.05)
        _same_curve(mine, ref_curve, "TPSP block (query-split attention + MLP)")

    def ulysses():
        torch.manual_seed(8)
        q, k, v, o = nn.Linear(h, h), nn.Linear(h, kv * 4), nn.Linear(h, kv * 4), nn.Linear(h, h)
        fc1, fc2 = nn.Linear(h, 2 * h), nn.Linear(2 * h, h)
        import copy

        ref = _Block(_RefAttention(q, k, v, o, heads, kv, True), nn.Sequential(fc1, nn.GELU(), fc2))
        mlp = copy.deepcopy(nn.Sequential(fc1, nn.GELU(), fc2))
        model = _Block(UlyssesAttention.from_linears(q, k, v, o, num_heads=heads, num_kv_heads=kv, algorithm="ring"),
                       mlp)
        ref_curve = [v / n for v in _curve(copy.deepcopy(ref), data, lambda t: t, mse, steps, 0.05)]
        # the MLP is replicated like in any Ulysses model: its gradients are all-reduced, as DDP would
        mine = _curve(model, data, seq_shard, mse, steps, 0.05, after_backward=lambda: _all_reduce_grads(mlp.parameters()))
        _same_curve(mine, ref_curve, "Ulysses block")

    def fsdp():
        torch.manual_seed(9)
        l1, l2 = nn.Linear(h, 24), nn.Linear(24, 12)
        import copy

        ref = nn.Sequential(copy.deepcopy(l1), nn.ReLU(), copy.deepcopy(l2))
        model = nn.Sequential(ShardedLinear.from_linear(l1, algorithm="ring"), nn.ReLU(),
                              ShardedLinear.from_linear(l2, algorithm="bidirectional"))
        rows = 4 * n

        def dp_data(step):
            g = torch.Generator().manual_seed(2000)
            return torch.randn(rows, h, generator=g), torch.randn(rows, 12, generator=g)

        def mean_sq(out, target):
            return ((out - target) ** 2).mean()

        ref_curve = [v / n for v in _curve(ref, dp_data, lambda t: t, mean_sq, steps, 0.05)]
        # each rank: its rows, its mean; gradients averaged by the reduce-scatter: the whole batch's mean
        mine = [v / n for v in _curve(model, dp_data, lambda t: t.tensor_split(n)[rank], mean_sq, steps, 0.05)]
        _same_curve(mine, ref_curve, "ShardedLinear under data parallelism")

    for name, fn in [("train-tpsp", tpsp), ("train-ulysses", ulysses), ("train-fsdp", fsdp)]:
        _run(results, name, fn)
    return results


def mesh_2d(rank, n):
    """TP x DP on a 2 x 2 DeviceMesh: an MLP over mesh["tp"] and a ShardedLinear over mesh["dp"]."""
    from torch.distributed.device_mesh import init_device_mesh

    results = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()

    def mlp_over_tp():
        torch.manual_seed(3)
        fc1, fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        ref = nn.Sequential(fc1, nn.GELU(), fc2)
        layer = ParallelMLP.from_linears(fc1, fc2, group=mesh["tp"], algorithm="ring")
        x = torch.randn(2, 2, 4, 8)[dp_rank]  # each DP replica its own data
        x_ref = x.clone().unsqueeze(0).requires_grad_()
        out_ref = ref(x_ref)
        out_ref.sum().backward()
        xs = x.unsqueeze(0).tensor_split(2, dim=1)[tp_rank].clone().requires_grad_()
        out = layer(xs)
        _close(out.detach(), out_ref.detach().tensor_split(2, dim=1)[tp_rank], "forward")
        out.sum().backward()
        _close(xs.grad, x_ref.grad.tensor_split(2, dim=1)[tp_rank], "input grad")
        _close(layer.fc2.bias.grad, fc2.bias.grad, "replicated bias grad over tp")

    def sharded_over_dp():
        torch.manual_seed(4)
        lin = nn.Linear(8, 6)
        layer = ShardedLinear.from_linear(lin, group=mesh["dp"], algorithm="ring")
        x = torch.randn(4, 8)
        out = layer(x.tensor_split(2)[dp_rank])
        _close(out.detach(), lin(x.tensor_split(2)[dp_rank]).detach(), "forward")
        round_trip = layer.to_linear()
        assert torch.equal(round_trip.weight, lin.weight)

    def bad_mesh():
        try:
            ParallelMLP(8, 16, group=mesh)
        except Exception as e:
            assert "2-D DeviceMesh" in str(e) and "mesh['dp']" in str(e), e
        else:
            raise AssertionError("a 2-D mesh was accepted as a group")

    for name, fn in [("mesh-mlp-tp", mlp_over_tp), ("mesh-sharded-dp", sharded_over_dp), ("mesh-2d-rejected", bad_mesh)]:
        _run(results, name, fn)
    return results
