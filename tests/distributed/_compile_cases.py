"""Rank-side bodies of the compile tests: torch.ops.commfuse under opcheck, and the functional ops and the
commfuse.nn layers under torch.compile(fullgraph=True), against eager on the same ranks and inputs."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tp_cases import _run  # noqa: E402  (the shared rank-side runner of the DTensor tests)

TOL = dict(rtol=1e-5, atol=1e-5)  # fp32: the compiled graph may fuse the elementwise work around the ops


def _fresh_inductor_cache() -> None:
    # inductor's FX-graph cache does not key on a custom op's fake kernel: a stale entry would test old code
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="commfuse-inductor-")


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _close(got, want, what, exact=False):
    got, want = _local(got).detach(), _local(want).detach()
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {list(got.shape)} != {list(want.shape)}")
    if exact and not torch.equal(got, want):
        raise AssertionError(f"{what}: not equal (max diff {(got - want).abs().max().item():.3g})")
    if not torch.allclose(got, want, **TOL):
        raise AssertionError(f"{what}: max diff {(got - want).abs().max().item():.3g}")


def _one_graph(fn, *args) -> None:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    if explained.graph_count != 1 or explained.graph_break_count != 0:
        raise AssertionError(f"{explained.graph_count} graphs, {explained.graph_break_count} breaks: "
                             f"{[str(b.reason)[:300] for b in explained.break_reasons]}")
    torch._dynamo.reset()


def _matches_eager(model, args, backend, want_ops=()) -> None:
    """``model(*args)`` compiled with fullgraph=True: one graph, no break, the ops ``want_ops`` in it, and a
    training step that gives eager's output, input gradient (of ``args[0]``) and parameter gradients."""
    _one_graph(model, *args)

    def step(fn):
        for p in model.parameters():
            p.grad = None
        x = args[0].clone().requires_grad_()
        y = fn(x, *args[1:])
        _local(y).pow(2).sum().backward()
        return y, x.grad, [p.grad for p in model.parameters()]

    want = step(model)
    seen: set = set()
    got = step(torch.compile(model, fullgraph=True, backend=_recording(seen, backend)))
    missing = [op for op in want_ops if not any(op in t for t in seen)]
    if missing:
        raise AssertionError(f"the compiled graph lacks {missing}: {sorted(seen)}")
    _close(got[0], want[0], "output")
    _close(got[1], want[1], "input grad")
    for (name, _), g, w in zip(model.named_parameters(), got[2], want[2]):
        _close(g, w, f"{name}.grad")


def opcheck(rank, n):
    """torch.library.opcheck on every op: schema, autograd registration, fake kernel, AOT dispatch (which runs
    the backward ops too)."""
    from commfuse import library

    results = {}
    g = library.group_name(None)
    torch.manual_seed(0)

    def check(name, op, args):
        def body():
            got = torch.library.opcheck(op, args)
            bad = {k: v for k, v in got.items() if v != "SUCCESS"}
            if bad:
                raise AssertionError(f"{name}: {bad}")

        _run(results, name, body)

    d = torch.float64
    a = torch.randn(2, 3, 8, dtype=d, requires_grad=True)
    w1, w2 = torch.randn(8, 6, dtype=d, requires_grad=True), torch.randn(8, 4, dtype=d, requires_grad=True)
    ops = torch.ops.commfuse
    check("all_gather_matmul", ops.all_gather_matmul.default, (a, [w1, w2], 1, g, "ring", None, True))
    check("all_gather_matmul-dim0-bidirectional", ops.all_gather_matmul.default,
          (torch.randn(4, 8, dtype=d, requires_grad=True), [w1], 0, g, "bidirectional", None, True))
    check("all_gather_matmul-transposed-weight", ops.all_gather_matmul.default,
          (a, [torch.randn(6, 8, dtype=d).t().requires_grad_()], 1, g, "ring", None, True))
    x = torch.randn(2, 4 * n, 8, dtype=d, requires_grad=True)
    check("matmul_reduce_scatter", ops.matmul_reduce_scatter.default, (x, w1, 1, g, "ring", "sum"))
    check("matmul_reduce_scatter-avg-vanilla", ops.matmul_reduce_scatter.default, (x, w1, 1, g, "vanilla", "avg"))
    q = torch.randn(2, 2 * n, 2, 4, dtype=d, requires_grad=True)
    k = torch.randn(2, 2 * n, 1, 4, dtype=d, requires_grad=True)
    v = torch.randn(2, 2 * n, 1, 4, dtype=d, requires_grad=True)
    wo = torch.randn(8, 8, dtype=d, requires_grad=True)
    check("attention_reduce_scatter", ops.attention_reduce_scatter.default, (q, k, v, wo, True, g, "ring"))
    w = torch.randn(4, 8, dtype=d, requires_grad=True)
    b = torch.randn(4, dtype=d, requires_grad=True)
    check("sharded_linear", ops.sharded_linear.default, (a, w, b, g, "ring", "avg", None))
    check("sharded_linear-no-bias-sum", ops.sharded_linear.default, (a, w, None, g, "ring", "sum", None))
    check("replicated", ops.replicated.default, (b, g))
    return results


def functional(rank, n, backend):
    """cf.all_gather_matmul and cf.matmul_reduce_scatter inside a compiled function, forward and backward."""
    import commfuse as cf

    _fresh_inductor_cache()
    results = {}
    torch.manual_seed(1)
    a = torch.randn(2, 3, 8)
    w1, w2 = torch.randn(8, 6), torch.randn(8, 4)
    x, w3 = torch.randn(2, 2 * n, 8), torch.randn(8, 5)

    def f(a, w1, w2, x, w3):
        gathered, (y1, y2) = cf.all_gather_matmul(a, [w1, w2], gather_dim=1, algorithm="ring",
                                                  return_gathered=True)
        z = cf.matmul_reduce_scatter(x, w3, scatter_dim=1, algorithm="ring")
        return gathered, y1, y2, z

    def step(fn):
        leaves = [t.clone().requires_grad_() for t in (a, w1, w2, x, w3)]
        out = fn(*leaves)
        (out[1].sin().sum() + out[2].pow(2).sum() + out[3].pow(2).sum()).backward()
        return out, [t.grad for t in leaves]

    def body():
        _one_graph(f, a, w1, w2, x, w3)
        want, want_grads = step(f)
        got, got_grads = step(torch.compile(f, fullgraph=True, backend=backend))
        for i, what in enumerate(("gathered", "y1", "y2")):
            _close(got[i], want[i], what, exact=True)  # all-gather results: exactly
        _close(got[3], want[3], "z")
        for name, g, w in zip(("da", "dw1", "dw2", "dx", "dw3"), got_grads, want_grads):
            _close(g, w, name)

    _run(results, f"functional-{backend}", body)

    def no_grad_body():
        with torch.no_grad():
            want = f(a, w1, w2, x, w3)
            got = torch.compile(f, fullgraph=True, backend=backend)(a, w1, w2, x, w3)
        for i, what in enumerate(("gathered", "y1", "y2", "z")):
            _close(got[i], want[i], what, exact=i < 3)

    _run(results, f"functional-no-grad-{backend}", no_grad_body)
    return results


def _layers(n):
    from commfuse.nn import ParallelAttention, ParallelMLP, ShardedLinear

    return {
        "mlp": (lambda: ParallelMLP(16, 32, algorithm="ring"), (2, 4, 16)),
        "mlp-auto": (lambda: ParallelMLP(16, 32, activation="silu", algorithm="auto"), (2, 4, 16)),
        # grouped-query: 2 query heads and 1 key/value head per rank, head_dim 4
        "attention": (lambda: ParallelAttention(8 * n, 2 * n, num_kv_heads=n, bias=True, algorithm="ring"),
                      (2, 4, 8 * n)),
        "attention-full-mha": (lambda: ParallelAttention(8 * n, 2 * n, causal=False, algorithm="bidirectional"),
                               (2, 4, 8 * n)),
        "sharded": (lambda: ShardedLinear(16, 4 * n, algorithm="ring"), (2, 4, 16)),
        "sharded-sum-no-bias": (lambda: ShardedLinear(16, 4 * n, bias=False, reduce="sum", algorithm="vanilla"),
                                (3, 16)),
    }


def layers(rank, n, backend):
    """Each layer's forward and backward compiled with fullgraph=True: one graph, no break, and what eager
    gives (outputs and every gradient)."""
    _fresh_inductor_cache()
    results = {}
    for name, (make, shape) in _layers(n).items():
        def body(make=make, shape=shape):
            torch.manual_seed(2)
            _matches_eager(make(), (torch.randn(*shape),), backend)

        _run(results, f"{name}-{backend}", body)
    return results


def refusals(rank, n):
    """What cannot be compiled says so, and with fullgraph=False runs eagerly."""
    import commfuse as cf
    from commfuse.fsdp import no_sync
    from commfuse.nn import ShardedLinear

    results = {}
    a, w = torch.randn(4, 8), torch.randn(8, 3)

    def expect(fn, args, text):
        torch._dynamo.reset()
        try:
            torch.compile(fn, fullgraph=True, backend="eager")(*args)
        except Exception as e:  # torch wraps the error raised while tracing; its message carries ours
            if text not in str(e):
                raise AssertionError(f"the error does not say {text!r}: {str(e)[:600]}") from e
            return
        raise AssertionError("compiled without an error")

    _run(results, "option-refused", lambda: expect(
        lambda a, w: cf.all_gather_matmul(a, w, timeout=5.0), (a, w), "timeout=5.0 cannot be given"))
    _run(results, "consume-refused-in-fullgraph", lambda: expect(
        lambda a: cf.all_gather_consume(a, lambda t, s: t * s), (a,), "takes a Python callable"))

    def consume_eagerly():
        def f(a):
            parts = cf.all_gather_consume(a * 2, lambda t, s: t + s, algorithm="ring")
            return torch.cat(parts) + 1

        torch._dynamo.reset()
        got = torch.compile(f, backend="eager")(a)
        _close(got, f(a), "all_gather_consume through a graph break", exact=True)

    _run(results, "consume-runs-eagerly-at-a-graph-break", consume_eagerly)

    def ulysses_eagerly():
        from commfuse.nn import UlyssesAttention

        torch.manual_seed(7)
        layer = UlyssesAttention(8 * n, 2 * n, algorithm="ring")
        x = torch.randn(2, 4, 8 * n)
        expect(layer, (x,), "cannot be part of a torch.compile graph")
        torch._dynamo.reset()
        xx = x.clone().requires_grad_()
        got = torch.compile(layer, backend="eager")(xx)
        got.pow(2).sum().backward()
        want_x = x.clone().requires_grad_()
        grads = [p.grad.clone() for p in layer.parameters()]
        for p in layer.parameters():
            p.grad = None
        want = layer(want_x)
        want.pow(2).sum().backward()
        _close(got, want, "UlyssesAttention through a graph break", exact=True)
        _close(xx.grad, want_x.grad, "its input gradient", exact=True)
        for (name, p), g in zip(layer.named_parameters(), grads):
            _close(g, p.grad, f"{name}.grad", exact=True)

    _run(results, "ulysses-refused-then-runs-eagerly", ulysses_eagerly)

    def no_sync_refused():
        torch.manual_seed(3)
        layer = ShardedLinear(8, 2 * n)
        with no_sync(layer):
            expect(layer, (torch.randn(3, 8),), "gradient sync off")

    _run(results, "sharded-no-sync-refused", no_sync_refused)
    return results


def fake_group(n: int) -> dict:
    """The layers compiled on torch's fake process group (rank 0 of n; transfers complete at once, received
    data is whatever the buffers held): one graph, no break, forward and backward run with the right shapes."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _fresh_inductor_cache()
    torch.set_num_threads(1)
    os.environ["COMMFUSE_CHECK"] = "0"  # received data is garbage: a fingerprint could never agree
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    results = {}
    for name, (make, shape) in _layers(n).items():
        def body(make=make, shape=shape):
            torch.manual_seed(4)
            layer = make()
            x = torch.randn(*shape)
            _one_graph(layer, x)
            want = layer(x)
            xx = x.clone().requires_grad_()
            y = torch.compile(layer, fullgraph=True)(xx)
            if y.shape != want.shape:
                raise AssertionError(f"compiled output {list(y.shape)}, eager {list(want.shape)}")
            y.sum().backward()
            if xx.grad is None or xx.grad.shape != xx.shape:
                raise AssertionError("no input gradient of the right shape")
            for pname, p in layer.named_parameters():
                if p.grad is None or _local(p.grad).shape != _local(p).shape:
                    raise AssertionError(f"{pname}: no gradient of its shard's shape")

        _run(results, name, body)
    dist.destroy_process_group()
    return results


def _recording(targets: set, then=None):
    """A torch.compile backend that records the ops of every graph it is given (then compiles with ``then``)."""
    def backend(gm, inputs):
        targets.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        if then is None:
            return gm.forward
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(then)(gm, inputs)

    return backend


def styles(rank, n, backend):
    """commfuse.tp's styles compiled: the Llama block (AttentionParallel with RoPE, SwiGLUParallel) and an MLP
    of ColwiseParallel / RowwiseParallel under sequence parallelism: one graph, no break, the fused ops in it,
    and what eager gives."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from commfuse import tp
    from commfuse.models import llama

    _fresh_inductor_cache()
    results = {}
    mesh = init_device_mesh("cpu", (n,))

    def block():
        torch.manual_seed(5)
        heads, head_dim, seq = 2 * n, 32 // (2 * n), 4 * n  # 2 query heads and 1 key/value head per rank
        model = llama.Block(dim=32, n_heads=heads, n_kv_heads=n, ffn=16 * n)
        parallelize_module(model, mesh, llama.commfuse_plan(head_dim=head_dim, algorithm="ring"))
        x = torch.randn(2, seq, 32).tensor_split(n, dim=1)[rank].clone()
        fused = ("commfuse.all_gather_matmul", "commfuse.attention_reduce_scatter", "commfuse.matmul_reduce_scatter")
        _matches_eager(model, (x, llama.rope_cache(head_dim, seq)), backend, fused)

    _run(results, f"llama-block-{backend}", block)

    def mlp():
        torch.manual_seed(6)
        model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        parallelize_module(model, mesh, {"0": tp.ColwiseParallel(input_layouts=Shard(1), algorithm="ring"),
                                         "2": tp.RowwiseParallel(output_layouts=Shard(1), algorithm="ring")})
        x = torch.randn(2, 4 * n, 16).tensor_split(n, dim=1)[rank].clone()
        _matches_eager(model, (x,), backend,
                       ("commfuse.all_gather_matmul", "commfuse.matmul_reduce_scatter", "commfuse.replicated"))

    _run(results, f"colwise-rowwise-mlp-{backend}", mlp)
    return results


def transformers_attention(rank, n, backend):
    """AttentionParallel() on transformers attention modules compiled, called as the model calls them: Gemma 2's
    (a soft-cap, its own scale, the sliding layer's mask) and Qwen3's (QK-norm): one graph, no break, the fused
    attention in it, and what eager gives."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import _hf_styles_cases as hf
    from commfuse import tp

    _fresh_inductor_cache()
    results = {}
    mesh = init_device_mesh("cpu", (n,))

    class Called(nn.Module):
        """The attention module called with what the model handed it, the input in its place."""

        def __init__(self, attention, kwargs):
            super().__init__()
            self.attention, self.kwargs = attention, kwargs

        def forward(self, x):
            return self.attention(**{**self.kwargs, "hidden_states": x})[0]

    for family in ("gemma2", "qwen3"):
        def body(family=family):
            model = hf.model_of(family)
            _, kwargs = hf.captured_calls(model)[(0, "self_attn")]
            parallelize_module(model, mesh, {"model.layers.*.self_attn": tp.AttentionParallel(algorithm="ring")})
            x = kwargs["hidden_states"].tensor_split(n, dim=1)[rank].clone()
            _matches_eager(Called(model.model.layers[0].self_attn, kwargs), (x,), backend,
                           ("commfuse.all_gather_matmul", "commfuse.attention_reduce_scatter"))

        _run(results, f"{family}-{backend}", body)
    return results


def llama_fsdp(rank, n, backend):
    """torchtitan's order on a dp 2 x tp 2 mesh: commfuse's styles, torch.compile(fullgraph=True) of the block,
    then FSDP2's fully_shard on dp; AdamW steps with clipping give the losses, norms and parameters of the same
    block run eagerly."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from commfuse.models import llama

    _fresh_inductor_cache()
    results = {}
    mesh = init_device_mesh("cpu", (n // 2, 2), mesh_dim_names=("dp", "tp"))
    dp, tpm = mesh["dp"], mesh["tp"]
    cache = llama.rope_cache(8, 8)

    def shard(x):
        mine = x.tensor_split(dp.size())[dp.get_local_rank()]
        return mine.tensor_split(2, dim=1)[tpm.get_local_rank()].clone()

    def train(compiled):
        torch.manual_seed(0)
        block = llama.Block()
        parallelize_module(block, tpm, llama.commfuse_plan(algorithm="ring"))
        if compiled:
            block = torch.compile(block, fullgraph=True, backend=backend)
        fully_shard(block, mesh=dp)
        opt = torch.optim.AdamW(block.parameters(), lr=1e-2)
        losses, norms = [], []
        for step in range(4):
            g = torch.Generator().manual_seed(1000 + step)
            x, target = torch.randn(2 * dp.size(), 8, 32, generator=g), torch.randn(2 * dp.size(), 8, 32, generator=g)
            loss = (block(shard(x), cache) - shard(target)).square().mean()
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(block.parameters(), 0.5))
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses, norms, [p for p in block.parameters()]

    def body():
        eager, compiled = train(False), train(True)
        for step, (lc, le) in enumerate(zip(compiled[0], eager[0])):
            _close(lc, le, f"step {step} loss")
        for step, (nc, ne) in enumerate(zip(compiled[1], eager[1])):
            _close(nc.full_tensor() if hasattr(nc, "full_tensor") else nc,
                   ne.full_tensor() if hasattr(ne, "full_tensor") else ne, f"step {step} clipped norm")
        for i, (pc, pe) in enumerate(zip(compiled[2], eager[2])):
            _close(pc, pe, f"parameter {i} after 4 steps")

    _run(results, f"llama-fsdp-{backend}", body)
    return results
