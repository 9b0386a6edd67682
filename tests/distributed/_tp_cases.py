"""Rank-side bodies of the commfuse.tp tests: each model parallelized twice, with torch's styles and with
commfuse's, from the same weights and data; outputs, gradients, clipped norms, optimizer steps and state
dicts must agree."""

from __future__ import annotations

import logging
import traceback

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

import commfuse as cf
from commfuse import tp

TOL = dict(rtol=1e-4, atol=1e-5)  # fp32, summed in another order


def expect(call, kind, *words) -> str:
    """``call()`` must raise ``kind`` with every one of ``words`` in its message; returns the message."""
    try:
        call()
    except kind as e:
        missing = [w for w in words if w not in str(e)]
        if missing:
            raise AssertionError(f"the error does not say {missing}: {e}") from e
        return str(e)
    else:
        raise AssertionError(f"no {kind.__name__} naming {words}")


def _run(results, name, fn):
    try:
        fn()
        results[name] = None
    except Exception as e:
        results[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _close(got, want, what, **tol):
    got, want = _full(got).detach(), _full(want).detach()
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {list(got.shape)} != {list(want.shape)}")
    if not torch.allclose(got, want, **(tol or TOL)):
        raise AssertionError(f"{what}: max diff {(got - want).abs().max().item():.3g}")


class MLP(nn.Module):
    """RMSNorm, up projection, SiLU, down projection, residual: a transformer's feed-forward half."""

    def __init__(self, hidden: int = 16, ffn: int = 32, bias: bool = True) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.w1 = nn.Linear(hidden, ffn, bias=bias)
        self.w2 = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x):
        h = self.w2(nn.functional.silu(self.w1(self.norm(x))))
        return x + h


def _pair(seed, mesh, plan_torch, plan_cf, make=MLP):
    """The same model twice, parallelized with torch's styles and with commfuse's."""
    torch.manual_seed(seed)
    base = make()
    state = {k: v.clone() for k, v in base.state_dict().items()}
    ours = make()
    ours.load_state_dict(state)
    return parallelize_module(base, mesh, plan_torch), parallelize_module(ours, mesh, plan_cf)


def _plans(algorithm="ring"):
    theirs = {"norm": SequenceParallel(), "w1": TorchColwise(input_layouts=Shard(1)),
              "w2": TorchRowwise(output_layouts=Shard(1))}
    ours = {"norm": SequenceParallel(), "w1": tp.ColwiseParallel(input_layouts=Shard(1), algorithm=algorithm),
            "w2": tp.RowwiseParallel(output_layouts=Shard(1), algorithm=algorithm)}
    return theirs, ours


class _Counted:
    """The fused ops as commfuse.tp sees them (its functional ops and its fused attention ring), counted while
    the block runs (each call goes through to the real one): a style that fell back to DTensor's moves would
    still match torch, so the tests also check that the fusion happened."""

    FUSED = ("all_gather_matmul", "matmul_reduce_scatter", "produce_reduce_scatter", "attention_reduce_scatter")

    def __init__(self):
        from commfuse import tp as tp_module

        self.module = tp_module
        self.calls = {"all_gather_matmul": 0, "matmul_reduce_scatter": 0}

    def __enter__(self):
        self.saved = {name: getattr(self.module, name) for name in ("ops", "fused_attention")}
        calls, fused = self.calls, self.FUSED

        class Counting:
            def __init__(self, real):
                self.real = real

            def __getattr__(self, name):
                got = getattr(self.real, name)
                if name not in fused:
                    return got

                def counted(*args, **kwargs):
                    calls[name] = calls.get(name, 0) + 1
                    return got(*args, **kwargs)

                return counted

        for name, real in self.saved.items():
            setattr(self.module, name, Counting(real))
        return self.calls

    def __exit__(self, *exc):
        for name, real in self.saved.items():
            setattr(self.module, name, real)


def sequence_parallel_mlp(rank, n):
    """The Megatron TPSP MLP with norms in SequenceParallel: 5 AdamW steps with clipping, side by side."""
    results = {}
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))

    for algorithm in ("ring", "vanilla", "auto"):
        def train(algorithm=algorithm):
            theirs, ours = _pair(5, mesh, *_plans(algorithm), make=lambda: MLP(16, 8 * n))
            opt_t = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
            opt_o = torch.optim.AdamW(ours.parameters(), lr=1e-2)
            g = torch.Generator().manual_seed(11)
            for step in range(5):
                x = torch.randn(2, 4 * n, 16, generator=g)
                local = x.tensor_split(n, dim=1)[rank]
                xt, xo = local.clone().requires_grad_(), local.clone().requires_grad_()
                yt = theirs(xt)
                with _Counted() as calls:
                    yo = ours(xo)
                if calls != {"all_gather_matmul": 1, "matmul_reduce_scatter": 1}:
                    raise AssertionError(f"the forward did not take both fused ops once: {calls}")
                _close(yo, yt, f"{algorithm} step {step} output")
                (yt.square().sum()).backward()
                (yo.square().sum()).backward()
                _close(xo.grad, xt.grad, f"{algorithm} step {step} input grad")
                for (name, pt), (_, po) in zip(theirs.named_parameters(), ours.named_parameters()):
                    if not isinstance(po, DTensor):
                        raise AssertionError(f"{name} is a {type(po).__name__}, not a DTensor")
                    if po.placements != pt.placements:
                        raise AssertionError(f"{name}: placements {po.placements} != torch's {pt.placements}")
                    _close(po.grad, pt.grad, f"{algorithm} step {step} {name} grad")
                nt = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0)
                no = torch.nn.utils.clip_grad_norm_(ours.parameters(), 1.0)
                _close(no, nt, f"{algorithm} step {step} clipped norm")
                every = [torch.zeros(()) for _ in range(n)]
                torch.distributed.all_gather(every, _full(no).detach().reshape(()))
                if len({float(v) for v in every}) != 1:
                    raise AssertionError(f"clip_grad_norm_ differs between ranks: {[float(v) for v in every]}")
                opt_t.step(), opt_o.step()
                opt_t.zero_grad(), opt_o.zero_grad()
            for (name, pt), (_, po) in zip(theirs.named_parameters(), ours.named_parameters()):
                _close(po, pt, f"{algorithm} {name} after 5 AdamW steps")
            st, so = theirs.state_dict(), ours.state_dict()
            if list(st) != list(so):
                raise AssertionError(f"state_dict keys {list(so)} != torch's {list(st)}")
            for k in st:
                if so[k].shape != st[k].shape:
                    raise AssertionError(f"state_dict[{k!r}] has global shape {list(so[k].shape)}, torch's "
                                         f"{list(st[k].shape)}")

        _run(results, f"sp-mlp-{algorithm}", train)
    return results


def layouts(rank, n):
    """Each style with other layouts, against torch's style with the same ones: replicated input, DTensor
    output, a replicated (all-reduced) output, uneven shards, no bias."""
    results = {}
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))

    def one(name, colwise, rowwise, x_full, shard_input, bias=True):
        def body():
            torch.manual_seed(7)
            lin1, lin2 = nn.Linear(16, 8 * n, bias=bias), nn.Linear(8 * n, 12, bias=bias)
            pairs = []
            for style1, style2 in ((colwise[0], rowwise[0]), (colwise[1], rowwise[1])):
                a, b = nn.Linear(16, 8 * n, bias=bias), nn.Linear(8 * n, 12, bias=bias)
                a.load_state_dict(lin1.state_dict()), b.load_state_dict(lin2.state_dict())
                pairs.append((parallelize_module(a, mesh, style1), parallelize_module(b, mesh, style2)))
            outs, unsharded = [], False
            for a, b in pairs:
                x = shard_input(x_full).requires_grad_() if shard_input else x_full.clone().requires_grad_()
                try:
                    y = b(a(x))
                except RuntimeError as e:
                    # torch's own styles on an uneven sequence shard, in torch 2.9: its redistribute to
                    # Replicate leaves a non-contiguous local tensor that nn.Linear's view refuses (pytorch
                    # issue 143748). Where torch cannot run the layout, commfuse's styles are held to the
                    # unsharded modules instead: the same output, input gradient and parameter gradients.
                    if outs or "view size is not compatible" not in str(e):
                        raise
                    x, unsharded = x_full.clone().requires_grad_(), True
                    y, a, b = lin2(lin1(x)), lin1, lin2
                _full(y).square().sum().backward()
                outs.append((x, y, a, b))
            (xt, yt, at, bt), (xo, yo, ao, bo) = outs
            if unsharded:  # the output torch's row-wise style asks for, as torch's would have had it
                style, local = rowwise[0], rowwise[0].use_local_output
                if isinstance(yo, DTensor) == local or (not local and yo.placements != tuple(style.output_layouts)):
                    asked = "a local tensor" if local else f"a DTensor {tuple(style.output_layouts)}"
                    raise AssertionError(f"output is {type(yo).__name__} {getattr(yo, 'placements', '')}, torch's "
                                         f"style asks for {asked}")
            elif isinstance(yt, DTensor) != isinstance(yo, DTensor):
                raise AssertionError(f"output is {type(yo).__name__}, torch's {type(yt).__name__}")
            elif isinstance(yt, DTensor) and yt.placements != yo.placements:
                raise AssertionError(f"output placements {yo.placements} != torch's {yt.placements}")
            _close(yo, yt, "output")
            _close(_full(xo.grad), _full(xt.grad), "input grad")
            for m_o, m_t, which in ((ao, at, "colwise"), (bo, bt, "rowwise")):
                for (pn, po), (_, pt) in zip(m_o.named_parameters(), m_t.named_parameters()):
                    _close(po.grad, pt.grad, f"{which} {pn} grad")

        _run(results, name, body)

    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4 * n, 16, generator=g)
    seq = lambda t: t.tensor_split(n, dim=1)[rank].clone()  # noqa: E731
    # replicated input (torch's default): no gather to fuse; the output all-reduced (torch's default)
    one("replicated-in-replicated-out", (TorchColwise(), tp.ColwiseParallel()),
        (TorchRowwise(), tp.RowwiseParallel()), x, None)
    # DTensor output kept (use_local_output=False), sequence-sharded
    one("dtensor-out", (TorchColwise(input_layouts=Shard(1)), tp.ColwiseParallel(input_layouts=Shard(1))),
        (TorchRowwise(output_layouts=Shard(1), use_local_output=False),
         tp.RowwiseParallel(output_layouts=Shard(1), use_local_output=False)), x, seq)
    # the gathered input is the batch dim (dim 0), and no bias
    xb = torch.randn(2 * n, 3, 16, generator=g)
    one("batch-dim-no-bias", (TorchColwise(input_layouts=Shard(0)), tp.ColwiseParallel(input_layouts=Shard(0))),
        (TorchRowwise(output_layouts=Shard(0)), tp.RowwiseParallel(output_layouts=Shard(0))), xb,
        lambda t: t.tensor_split(n, dim=0)[rank].clone(), bias=False)
    # a sequence the ranks cannot split evenly, handed in as a DTensor: commfuse falls back to DTensor's moves
    xu = torch.randn(2, 4 * n + 1, 16, generator=g)

    def uneven(t):
        return DTensor.from_local(torch.chunk(t, n, dim=1)[rank].clone(), mesh, [Shard(1)], run_check=False,
                                  shape=t.shape, stride=t.stride())

    def uneven_leaf(t):
        d = uneven(t)
        return d.detach()

    one("uneven-dtensor-in", (TorchColwise(input_layouts=Shard(1)), tp.ColwiseParallel(input_layouts=Shard(1))),
        (TorchRowwise(output_layouts=Shard(1), use_local_output=False),
         tp.RowwiseParallel(output_layouts=Shard(1), use_local_output=False)), xu, uneven_leaf)
    return results


def errors_and_log(rank, n):
    """Honest errors: a DTensor handed to a functional op, a style on a module it cannot parallelize, a 2-D
    mesh; and the DEBUG log of a layout with nothing to fuse."""
    results = {}
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))

    def dtensor_to_op():
        w = DTensor.from_local(torch.randn(8, 4), mesh, [Replicate()], run_check=False)
        a = DTensor.from_local(torch.randn(3, 8), mesh, [Shard(0)], run_check=False)
        for call in (lambda: cf.all_gather_matmul(a, w.to_local()), lambda: cf.all_gather_matmul(a.to_local(), w),
                     lambda: cf.matmul_reduce_scatter(a.to_local().repeat(n, 1), w)):
            try:
                call()
            except cf.errors.CommfuseTypeError as e:
                if "DTensor" not in str(e) or "to_local()" not in str(e) or "commfuse.tp" not in str(e):
                    raise AssertionError(f"the error does not say what to do: {e}") from e
            else:
                raise AssertionError("a DTensor was taken by a functional op")
        # the same shapes as plain tensors first, then as a DTensor: the remembered signature must not let it by
        plain = torch.randn(3, 8)
        cf.all_gather_matmul(plain, w.to_local())
        try:
            cf.all_gather_matmul(plain, w)
        except cf.errors.CommfuseTypeError:
            pass
        else:
            raise AssertionError("a DTensor weight was taken after a plain call of the same shapes")

    def wrong_module():
        try:
            parallelize_module(nn.Conv1d(2, 2, 1), mesh, tp.ColwiseParallel())
        except cf.errors.CommfuseTypeError as e:
            assert "nn.Linear" in str(e), e
        else:
            raise AssertionError("ColwiseParallel took a Conv1d")
        lin = parallelize_module(nn.Linear(4, 2 * n), mesh, tp.ColwiseParallel())
        try:
            tp.ColwiseParallel()._apply(lin, mesh)
        except cf.errors.CommfuseValueError as e:
            assert "once" in str(e), e
        else:
            raise AssertionError("a module was parallelized twice")
        try:
            tp.RowwiseParallel(output_layouts=(Shard(0), Shard(1)))
        except cf.errors.CommfuseTypeError as e:
            assert "1-D" in str(e), e
        else:
            raise AssertionError("two placements were taken for a 1-D mesh")

    def debug_log():
        records = []

        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())

        logger = logging.getLogger("commfuse")
        handler, level = Keep(), logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        try:
            lin = parallelize_module(nn.Linear(16, 4 * n), mesh, tp.RowwiseParallel(input_layouts=Replicate()))
            lin(torch.randn(2, 3, 16))
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        if not any("RowwiseParallel" in m and "Replicate" in m for m in records):
            raise AssertionError(f"no DEBUG record says why nothing was fused: {records}")

    _run(results, "dtensor-to-functional-op", dtensor_to_op)
    _run(results, "wrong-module-or-layout", wrong_module)
    _run(results, "debug-log-of-a-fallback", debug_log)
    return results


def with_fsdp(rank, n):
    """TP over mesh['tp'] then fully_shard over mesh['dp'] (2 x 2): commfuse's styles against torch's."""
    from torch.distributed.fsdp import fully_shard

    results = {}
    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "tp"))
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    dp_rank, tp_rank, t = dp_mesh.get_local_rank(), tp_mesh.get_local_rank(), tp_mesh.size()

    def train():
        theirs, ours = _pair(9, tp_mesh, *_plans("ring"), make=lambda: MLP(16, 8 * t))
        fully_shard(theirs, mesh=dp_mesh)
        fully_shard(ours, mesh=dp_mesh)
        opt_t = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
        opt_o = torch.optim.AdamW(ours.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(13)
        for step in range(4):
            x = torch.randn(2, 2, 4 * t, 16, generator=g)[dp_rank]  # each DP replica its own batch
            local = x.tensor_split(t, dim=1)[tp_rank]
            yt = theirs(local.clone())
            with _Counted() as calls:
                yo = ours(local.clone())
            if calls != {"all_gather_matmul": 1, "matmul_reduce_scatter": 1}:
                raise AssertionError(f"the forward under fully_shard did not take both fused ops once: {calls}")
            _close(yo, yt, f"step {step} output")
            yt.square().sum().backward()
            yo.square().sum().backward()
            for (name, pt), (_, po) in zip(theirs.named_parameters(), ours.named_parameters()):
                _close(po.grad, pt.grad, f"step {step} {name} grad")
            nt = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0)
            no = torch.nn.utils.clip_grad_norm_(ours.parameters(), 1.0)
            _close(no, nt, f"step {step} clipped norm")
            opt_t.step(), opt_o.step()
            opt_t.zero_grad(), opt_o.zero_grad()
        for (name, pt), (_, po) in zip(theirs.named_parameters(), ours.named_parameters()):
            _close(po, pt, f"{name} after 4 AdamW steps")

    def nn_mlp():
        """commfuse.nn's ParallelMLP built on mesh['tp'] under fully_shard on mesh['dp'] (2-D, as with torch's
        styles): against the unsharded MLP with the whole batch."""
        from commfuse.nn import ParallelMLP

        torch.manual_seed(17)
        fc1, fc2 = nn.Linear(16, 8 * t), nn.Linear(8 * t, 16)
        ref = nn.Sequential(fc1, nn.GELU(), fc2)
        mlp = ParallelMLP.from_linears(fc1, fc2, group=tp_mesh, algorithm="ring")
        fully_shard(mlp, mesh=dp_mesh)
        x = torch.randn(2, 2, 4 * t, 16)  # dp replica r's batch is x[r]
        (ref(x.flatten(0, 1)).square().sum() / 2).backward()  # FSDP averages the replicas' gradients
        local = x[dp_rank].tensor_split(t, dim=1)[tp_rank].clone()
        mlp(local).square().sum().backward()
        for (name, pr), (_, pm) in zip(ref.named_parameters(), mlp.named_parameters()):
            _close(pm.grad, pr.grad, f"ParallelMLP under fully_shard: {name} grad")
        _close(torch.nn.utils.clip_grad_norm_(mlp.parameters(), 1e9),
               torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9), "clip_grad_norm_")

    _run(results, "tp-then-fully-shard", train)
    _run(results, "nn-mlp-under-fully-shard", nn_mlp)
    return results


def nn_layers(rank, n):
    """commfuse.nn's tensor-parallel layers hold DTensor parameters: clip_grad_norm_ is the whole model's on
    every rank, the state dict has the whole layer's shapes, and sizes that do not split evenly are refused."""
    from commfuse.nn import ColumnParallelLinear, ParallelAttention, ParallelMLP

    results = {}

    def norms():
        torch.manual_seed(3)
        fc1, fc2 = nn.Linear(16, 8 * n), nn.Linear(8 * n, 16)
        ref_mlp = nn.Sequential(fc1, nn.GELU(), fc2)
        mlp = ParallelMLP.from_linears(fc1, fc2, algorithm="ring")
        # attention: 2n heads of 4 over 8n features, n key/value heads (grouped-query)
        hd = 8 * n
        q, k, v, o = nn.Linear(hd, hd), nn.Linear(hd, 4 * n), nn.Linear(hd, 4 * n), nn.Linear(hd, hd)
        attn = ParallelAttention.from_linears(q, k, v, o, num_heads=2 * n, num_kv_heads=n, causal=True)
        x = torch.randn(2, 3 * n, 16)
        ref_mlp(x).square().sum().backward()
        mlp(x.tensor_split(n, dim=1)[rank]).square().sum().backward()
        got = torch.nn.utils.clip_grad_norm_(mlp.parameters(), 1e9)
        want = torch.nn.utils.clip_grad_norm_(ref_mlp.parameters(), 1e9)
        _close(got, want, "ParallelMLP clip_grad_norm_ against the unsharded MLP's")
        every = [torch.zeros(()) for _ in range(n)]
        torch.distributed.all_gather(every, _full(got).detach().reshape(()))
        if len({round(float(v), 5) for v in every}) != 1:
            raise AssertionError(f"clip_grad_norm_ differs between ranks: {[float(v) for v in every]}")
        state = mlp.state_dict()
        for key, want_shape in (("fc1.weight", fc1.weight.shape), ("fc1.bias", fc1.bias.shape),
                                ("fc2.weight", fc2.weight.shape), ("fc2.bias", fc2.bias.shape)):
            if state[key].shape != want_shape:
                raise AssertionError(f"state_dict[{key!r}] has shape {list(state[key].shape)}, the layer's "
                                     f"{list(want_shape)}")
            _close(state[key], dict(fc1=fc1, fc2=fc2)[key[:3]].state_dict()[key[4:]], f"state_dict[{key!r}]")
        attn(torch.randn(2, 3 * n, hd).tensor_split(n, dim=1)[rank]).sum().backward()
        for name, p in attn.named_parameters():
            if n > 1 and not isinstance(p, DTensor):
                raise AssertionError(f"ParallelAttention.{name} is a {type(p).__name__}, not a DTensor")
        if attn.state_dict()["wq"].shape != q.weight.shape:
            raise AssertionError(f"ParallelAttention wq in the state dict: {list(attn.state_dict()['wq'].shape)}")

    def uneven():
        if n == 1:
            return
        try:
            ColumnParallelLinear(16, 8 * n + 1)
        except cf.errors.CommfuseValueError as e:
            assert "does not divide" in str(e) and "commfuse.tp" in str(e), e
        else:
            raise AssertionError("an out_features that does not split evenly was taken")

    _run(results, "clip-norm-and-state-dict", norms)
    _run(results, "uneven-refused", uneven)
    return results


def block_styles(rank, n):
    """The block styles with a replicated (all-reduced) output, where nothing is fused into the reduction,
    against torch's styles; and the errors they give for blocks they cannot parallelize."""
    from torch.distributed.tensor.parallel import PrepareModuleInput

    from commfuse.models import llama as llama_block

    results = {}
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    cache = llama_block.rope_cache(8, 4 * n)

    def replicated_out():
        for which in ("feed_forward", "attention"):
            torch.manual_seed(4)
            base = llama_block.Block(dim=8 * n, n_heads=n, n_kv_heads=n, ffn=8 * n)
            ours = llama_block.Block(dim=8 * n, n_heads=n, n_kv_heads=n, ffn=8 * n)
            ours.load_state_dict(base.state_dict())
            if which == "feed_forward":
                theirs_plan = {"feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                                  desired_input_layouts=(Replicate(),)),
                               "feed_forward.w1": TorchColwise(), "feed_forward.w3": TorchColwise(),
                               "feed_forward.w2": TorchRowwise()}
                ours_plan = {"feed_forward": tp.SwiGLUParallel(output_layouts=Replicate())}
            else:
                theirs_plan = {"attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                               desired_input_layouts=(Replicate(), None)),
                               "attention.wq": TorchColwise(), "attention.wk": TorchColwise(),
                               "attention.wv": TorchColwise(), "attention.wo": TorchRowwise()}
                ours_plan = {"attention": tp.AttentionParallel(head_dim=8, rope=llama_block.apply_rope,
                                                               output_layouts=Replicate())}
            parallelize_module(base, mesh, theirs_plan)
            parallelize_module(ours, mesh, ours_plan)
            x = torch.randn(2, 4 * n, 8 * n).tensor_split(n, dim=1)[rank]
            outs = []
            for block in (base, ours):
                xi = x.clone().requires_grad_()
                sub = getattr(block, which)
                y = sub(xi, cache) if which == "attention" else sub(xi)
                y.square().sum().backward()
                outs.append((xi, y, sub))
            (xt, yt, st), (xo, yo, so) = outs
            _close(yo, yt, f"{which} output (replicated)")
            _close(xo.grad, xt.grad, f"{which} input grad")
            for (name, pt), (_, po) in zip(st.named_parameters(), so.named_parameters()):
                _close(po.grad, pt.grad, f"{which}.{name} grad")

    def errors():
        for make, kind, words in ((lambda: tp.AttentionParallel(head_dim=0), cf.errors.CommfuseValueError,
                                   "head_dim"),
                                  (lambda: tp.AttentionParallel(head_dim=8, rope=3), cf.errors.CommfuseTypeError,
                                   "rope"),
                                  (lambda: parallelize_module(nn.Sequential(nn.Linear(4, 4)), mesh,
                                                              tp.SwiGLUParallel()), cf.errors.CommfuseValueError,
                                   "Sequential has no submodule 'w1' (the w1= argument"),
                                  (lambda: parallelize_module(llama_block.Attention(8 * n, 2 * n + 1, 1), mesh,
                                                              tp.AttentionParallel(head_dim=1)),
                                   cf.errors.CommfuseValueError, "whole heads")):
            try:
                make()
            except kind as e:
                assert words in str(e), e
            else:
                raise AssertionError(f"no {kind.__name__} naming {words}")

    def auto_computes_each_slice_once():
        # AttentionParallel with algorithm="auto" and gradients: each query slice's attention runs once in the
        # forward (one attention core per slice, n of them); deciding "auto" must not produce one early
        torch.manual_seed(4)
        block = llama_block.Block(dim=8 * n, n_heads=n, n_kv_heads=n, ffn=8 * n)
        parallelize_module(block, mesh, {"attention": tp.AttentionParallel(head_dim=8, rope=llama_block.apply_rope,
                                                                           algorithm="auto")})
        x = torch.randn(2, 4 * n, 8 * n).tensor_split(n, dim=1)[rank].requires_grad_()
        functional = torch.nn.functional
        real, calls = functional.scaled_dot_product_attention, []

        def counted(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)

        functional.scaled_dot_product_attention = counted
        try:
            for grad in (True, False):
                calls.clear()
                with torch.set_grad_enabled(grad):
                    y = block.attention(x, cache)
                if len(calls) != n:
                    raise AssertionError(f"grad={grad}: the forward ran {len(calls)} attention cores for {n} "
                                         f"query slices")
            y = block.attention(x, cache)
            y.square().sum().backward()
        finally:
            functional.scaled_dot_product_attention = real
        assert x.grad is not None and x.grad.shape == x.shape

    _run(results, "block-styles-replicated-out", replicated_out)
    _run(results, "block-styles-errors", errors)
    _run(results, "attention-auto-computes-each-slice-once", auto_computes_each_slice_once)
    return results


# -- torchtitan's shapes: nested projections, one fused wqkv, a RoPE module per layer, a DTensor residual ----------


class _RoPE(nn.Module):
    """A rotary module as torchtitan keeps one per attention layer: its own cache, called rope(xq, xk, positions)."""

    def __init__(self, head_dim: int, max_seq: int) -> None:
        super().__init__()
        from commfuse.models import llama

        cos, sin = llama.rope_cache(head_dim, max_seq)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, xq, xk, positions=None):
        from commfuse.models import llama

        at = torch.arange(xq.shape[1]) if positions is None else positions
        return llama.apply_rope(xq, xk, (self.cos[at], self.sin[at]))


class _QKVLinear(nn.Module):
    """torchtitan's QKVLinear: three projections, one level down (``qkv_linear.wq``)."""

    def __init__(self, dim, n_heads, n_kv_heads, head_dim):
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        return tuple(w(x).view(b, s, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))


class _FusedQKVLinear(nn.Module):
    """torchtitan's FusedQKVLinear: one ``wqkv`` whose rows are (n_kv_heads, heads_per_kv + 2, head_dim), split
    per key/value group as its forward splits it."""

    def __init__(self, dim, n_heads, n_kv_heads, head_dim):
        super().__init__()
        self.head_dim, self.heads_per_kv = head_dim, n_heads // n_kv_heads
        self.wqkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * head_dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        hpk, hd = self.heads_per_kv, self.head_dim
        qkv = self.wqkv(x).view(b, s, -1, hpk + 2, hd)
        q, k, v = torch.split(qkv, [hpk, 1, 1], dim=-2)
        return q.reshape(b, s, -1, hd), k.reshape(b, s, -1, hd), v.reshape(b, s, -1, hd)


class _TitanAttention(nn.Module):
    """torchtitan's GQAttention: ``qkv_linear`` (three projections or one fused), a RoPE module, causal
    grouped-query attention, ``wo``; ``forward(x, attention_masks, positions=None)``."""

    def __init__(self, dim=16, n_heads=8, n_kv_heads=4, fused=True):
        super().__init__()
        hd = dim // n_heads * 2
        self.qkv_linear = (_FusedQKVLinear if fused else _QKVLinear)(dim, n_heads, n_kv_heads, hd)
        self.rope = _RoPE(hd, 64)
        self.wo = nn.Linear(n_heads * hd, dim, bias=False)

    def forward(self, x, attention_masks, positions=None):
        assert attention_masks is None
        q, k, v = self.qkv_linear(x)
        q, k = self.rope(q, k, positions)
        group = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        o = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       is_causal=True)
        return self.wo(o.transpose(1, 2).flatten(2))


class _NestedFeedForward(nn.Module):
    """A SwiGLU feed-forward one level down: its projections are ``mlp.w1``, ``mlp.w2``, ``mlp.w3``."""

    def __init__(self, dim, hidden):
        super().__init__()
        from commfuse.models import llama

        self.mlp = llama.FeedForward(dim, hidden)

    def forward(self, x):
        return self.mlp(x)


def _fused_from_separate(wq, wk, wv, n_kv_heads):
    """torchtitan's merge of wq, wk, wv rows into wqkv's (n_kv_heads, heads_per_kv + 2, head_dim) layout."""
    hd = wk.shape[0] // n_kv_heads
    q, k, v = (w.reshape(n_kv_heads, -1, hd, w.shape[1]) for w in (wq, wk, wv))
    return torch.cat([q, k, v], dim=1).reshape(-1, wq.shape[1])


def _rope_with_module(seen):
    """A rope hook that takes the block (``rope_takes_module=True``) and calls the block's own RoPE module."""

    def rope(q, k, positions=None, *, module):
        seen.append(module)
        return module.rope(q, k, positions)

    return rope


def torchtitan_shapes(rank, n):
    """The block styles on torchtitan's shapes: projections named by dotted paths, one fused wqkv, the rope
    hook given the block (its RoPE module), and a block's output added to a DTensor residual stream."""
    from torch.distributed.tensor.parallel import PrepareModuleInput

    from commfuse.models import llama

    results = {}
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    b, s, dim, heads, kv_heads = 2, 4 * n, 16, 4 * n, 2 * n  # every rank holds 2 key/value groups of 2 queries
    hd = dim // heads * 2
    x = torch.randn(b, s, dim, generator=torch.Generator().manual_seed(3))
    g = torch.randn(b, s, dim, generator=torch.Generator().manual_seed(4))
    positions = torch.arange(s).flip(0) + 3  # not arange: the positions must reach the block's RoPE module
    local = x.tensor_split(n, dim=1)[rank]
    local_g = g.tensor_split(n, dim=1)[rank]

    def titan(fused, seed=5):
        torch.manual_seed(seed)
        return _TitanAttention(dim, heads, kv_heads, fused=fused)

    def run(block, *args):
        xi = local.clone().requires_grad_()
        y = block(xi, *args)
        (y * local_g).sum().backward()
        return xi, y

    def against_torch(theirs, ours, seen, what):
        """Both blocks run with the positions: ours by one gather and one fused attention, its rope hook given
        the block; output and input gradient as torch's plan's. Returns ours (input, output)."""
        xt, yt = run(theirs, None, positions)
        with _Counted() as calls:
            xo, yo = run(ours, None, positions)
        if calls.get("all_gather_matmul") != 1 or calls.get("attention_reduce_scatter") != 1:
            raise AssertionError(f"the {what} did not take one gather and one fused attention: {calls}")
        if len(seen) != 1 or seen[0] is not ours:
            raise AssertionError(f"the rope hook got {seen}, not the block it was applied to")
        _close(yo, yt, f"{what} output against torch's plan")
        _close(xo.grad, xt.grad, f"{what} input grad against torch's plan")
        return xo, yo

    def dotted_names():
        # projections one level down (qkv_linear.wq, ...): against torch's plan on the same block, whose keys
        # name them so too; the rope hook takes the block and calls its RoPE module with the positions
        theirs, ours = titan(False), titan(False)
        ours.load_state_dict(theirs.state_dict())
        keys = {k: v.shape for k, v in ours.state_dict().items()}
        parallelize_module(theirs, mesh, PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                            desired_input_layouts=(Replicate(), None, None)))
        parallelize_module(theirs, mesh, {"qkv_linear.wq": TorchColwise(), "qkv_linear.wk": TorchColwise(),
                                          "qkv_linear.wv": TorchColwise(), "wo": TorchRowwise(output_layouts=Shard(1))})
        seen = []
        parallelize_module(ours, mesh, tp.AttentionParallel(
            head_dim=hd, wq="qkv_linear.wq", wk="qkv_linear.wk", wv="qkv_linear.wv", rope=_rope_with_module(seen),
            rope_takes_module=True, algorithm="ring"))
        against_torch(theirs, ours, seen, "nested block")
        for (name, pt), (_, po) in zip(theirs.named_parameters(), ours.named_parameters()):
            if not isinstance(po, DTensor) or po.placements != pt.placements:
                raise AssertionError(f"{name}: {type(po).__name__} {getattr(po, 'placements', '')}, torch's "
                                     f"{pt.placements}")
            _close(po.grad, pt.grad, f"{name} grad against torch's plan")
        if {k: v.shape for k, v in ours.state_dict().items()} != keys:
            raise AssertionError(f"the state dict changed: {list(ours.state_dict())} against {list(keys)}")
        # the feed-forward with its projections one level down, against the same weights one level up
        torch.manual_seed(6)
        flat, nested = llama.FeedForward(dim, 4 * n), _NestedFeedForward(dim, 4 * n)
        nested.mlp.load_state_dict(flat.state_dict())
        parallelize_module(flat, mesh, tp.SwiGLUParallel(algorithm="ring"))
        parallelize_module(nested, mesh, tp.SwiGLUParallel(w1="mlp.w1", w2="mlp.w2", w3="mlp.w3", algorithm="ring"))
        (xa, ya), (xb, yb) = run(flat), run(nested)
        _close(yb, ya, "nested SwiGLU output")
        _close(xb.grad, xa.grad, "nested SwiGLU input grad")
        for name in ("w1", "w2", "w3"):
            _close(getattr(nested.mlp, name).weight.grad, getattr(flat, name).weight.grad, f"mlp.{name} grad")
        if list(nested.state_dict()) != ["mlp.w1.weight", "mlp.w2.weight", "mlp.w3.weight"]:
            raise AssertionError(f"nested SwiGLU state dict keys: {list(nested.state_dict())}")

    def fused_qkv():
        # one fused wqkv: against torch's ColwiseParallel/RowwiseParallel plan on the same block, and against the
        # unsharded attention with separate q/k/v projections built from the same (reordered) rows
        theirs, ours, separate = titan(True), titan(True), titan(False)
        ours.load_state_dict(theirs.state_dict())
        wqkv = theirs.qkv_linear.wqkv.weight.detach()
        rows = wqkv.reshape(kv_heads, heads // kv_heads + 2, hd, dim)
        for name, part in (("wq", rows[:, :-2]), ("wk", rows[:, -2]), ("wv", rows[:, -1])):
            getattr(separate.qkv_linear, name).weight = nn.Parameter(part.reshape(-1, dim).clone())
        separate.wo.weight = nn.Parameter(theirs.wo.weight.detach().clone())
        if not torch.equal(_fused_from_separate(*(getattr(separate.qkv_linear, w).weight for w in ("wq", "wk", "wv")),
                                                kv_heads), wqkv):
            raise AssertionError("the test's reordering of wqkv's rows is not torchtitan's merge")
        parallelize_module(theirs, mesh, PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                            desired_input_layouts=(Replicate(), None, None)))
        parallelize_module(theirs, mesh, {"qkv_linear.wqkv": TorchColwise(),
                                          "wo": TorchRowwise(output_layouts=Shard(1))})
        seen = []
        parallelize_module(ours, mesh, tp.AttentionParallel(head_dim=hd, qkv="qkv_linear.wqkv",
                                                            rope=_rope_with_module(seen), rope_takes_module=True,
                                                            algorithm="ring"))
        xo, yo = against_torch(theirs, ours, seen, "fused QKV block")
        for name in ("qkv_linear.wqkv.weight", "wo.weight"):
            po, pt = ours.get_parameter(name), theirs.get_parameter(name)
            if po.placements != pt.placements:
                raise AssertionError(f"{name}: placements {po.placements} != torch's {pt.placements}")
            _close(po.grad, pt.grad, f"{name} grad against torch's plan")
        if ours.state_dict()["qkv_linear.wqkv.weight"].shape != wqkv.shape:
            raise AssertionError(f"wqkv in the state dict: {list(ours.state_dict()['qkv_linear.wqkv.weight'].shape)}")
        xs = x.clone().requires_grad_()
        ys = separate(xs, None, positions)
        (ys * g).sum().backward()
        _close(yo, ys.tensor_split(n, dim=1)[rank], "fused QKV output against separate projections")
        _close(xo.grad, xs.grad.tensor_split(n, dim=1)[rank], "fused QKV input grad against separate projections")
        grads = [getattr(separate.qkv_linear, w).weight.grad for w in ("wq", "wk", "wv")]
        _close(ours.qkv_linear.wqkv.weight.grad, _fused_from_separate(*grads, kv_heads),
               "wqkv grad against separate projections' grads, merged")
        _close(ours.wo.weight.grad, separate.wo.weight.grad, "wo grad against separate projections")

    def refused():
        error, kind_error = cf.errors.CommfuseValueError, cf.errors.CommfuseTypeError
        expect(lambda: parallelize_module(titan(False), mesh, tp.AttentionParallel(head_dim=hd)), error,
               "_TitanAttention has no submodule 'wq'", "wq= argument", "query projection")
        expect(lambda: parallelize_module(titan(True), mesh, tp.AttentionParallel(head_dim=hd, qkv="qkv_linear.wkv")),
               error, "'qkv_linear.wkv'", "qkv= argument")
        expect(lambda: parallelize_module(titan(True), mesh, tp.AttentionParallel(head_dim=hd, qkv="rope")),
               error, "_RoPE, not an nn.Linear", "'rope'", "qkv= argument")
        expect(lambda: tp.AttentionParallel(head_dim=hd, qkv="qkv_linear.wqkv", wk="wk"), error,
               "wk='wk'", "one or the other")
        # n + 1 key/value groups cannot be whole on each of n ranks
        expect(lambda: parallelize_module(_TitanAttention(dim, n + 1, n + 1), mesh,
                                          tp.AttentionParallel(head_dim=dim // (n + 1) * 2, qkv="qkv_linear.wqkv")),
               error, f"n_kv_heads = {n + 1}", "'qkv_linear.wqkv'", "whole groups")
        odd = titan(True)
        odd.wo = nn.Linear(heads * hd + hd, dim, bias=False)  # wo's heads do not fit wqkv's rows
        expect(lambda: parallelize_module(odd, mesh, tp.AttentionParallel(head_dim=hd, qkv="qkv_linear.wqkv")),
               error, "'qkv_linear.wqkv'", "FusedQKVLinear", "n_heads = 9")
        expect(lambda: tp.AttentionParallel(head_dim=hd, rope=llama.apply_rope, rope_takes_module=True), kind_error,
               "apply_rope", "takes no keyword 'module'")
        expect(lambda: tp.AttentionParallel(head_dim=hd, rope_takes_module=True), kind_error, "no rope hook")

    def dtensor_residual():
        # a residual stream of DTensors, x + block(x): with use_local_output=False (torch's RowwiseParallel needs
        # the same), against torch's plan for the block with its row-parallel projection's use_local_output=False
        for kind, style in ((tp.ColwiseParallel, TorchColwise), (tp.RowwiseParallel, TorchRowwise),
                            (tp.SwiGLUParallel, TorchRowwise), (tp.AttentionParallel, TorchRowwise)):
            ours = kind(head_dim=hd) if kind is tp.AttentionParallel else kind()
            if ours.use_local_output != style().use_local_output:
                raise AssertionError(f"{kind.__name__}'s use_local_output defaults to {ours.use_local_output}, "
                                     f"torch's {style.__name__} to {style().use_local_output}")
        for which in ("feed_forward", "attention"):
            torch.manual_seed(8)
            base = llama.Block(dim=8 * n, n_heads=n, n_kv_heads=n, ffn=8 * n)
            blocks = {"torch": base, "commfuse": llama.Block(dim=8 * n, n_heads=n, n_kv_heads=n, ffn=8 * n),
                      "default": llama.Block(dim=8 * n, n_heads=n, n_kv_heads=n, ffn=8 * n)}
            for block in blocks.values():
                block.load_state_dict(base.state_dict())
            cache = llama.rope_cache(8, 4 * n)
            if which == "feed_forward":
                parallelize_module(base, mesh, {
                    "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                    "feed_forward.w1": TorchColwise(), "feed_forward.w3": TorchColwise(),
                    "feed_forward.w2": TorchRowwise(output_layouts=Shard(1), use_local_output=False)})
                parallelize_module(blocks["commfuse"], mesh,
                                   {"feed_forward": tp.SwiGLUParallel(use_local_output=False)})
                parallelize_module(blocks["default"], mesh, {"feed_forward": tp.SwiGLUParallel()})
            else:
                parallelize_module(base, mesh, {
                    "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                    desired_input_layouts=(Replicate(), None)),
                    "attention.wq": TorchColwise(), "attention.wk": TorchColwise(), "attention.wv": TorchColwise(),
                    "attention.wo": TorchRowwise(output_layouts=Shard(1), use_local_output=False)})
                parallelize_module(blocks["commfuse"], mesh, {"attention": tp.AttentionParallel(
                    head_dim=8, rope=llama.apply_rope, use_local_output=False)})
                parallelize_module(blocks["default"], mesh, {"attention": tp.AttentionParallel(
                    head_dim=8, rope=llama.apply_rope)})
            xr = torch.randn(2, 4 * n, 8 * n, generator=torch.Generator().manual_seed(9))
            outs = {}
            for name, block in blocks.items():
                xd = DTensor.from_local(xr.tensor_split(n, dim=1)[rank].clone(), mesh, [Shard(1)]).requires_grad_()
                sub = getattr(block, which)
                try:
                    y = xd + (sub(xd, cache) if which == "attention" else sub(xd))  # the residual stream
                except RuntimeError as e:
                    if name != "default" or "mixed torch.Tensor and DTensor" not in str(e):
                        raise
                    continue  # the default hands on a local output, as torch's RowwiseParallel does
                else:
                    if name == "default":
                        raise AssertionError(f"{which}: the default output added to a DTensor residual: a local "
                                             "output (use_local_output=True) must not pass as a DTensor")
                if not isinstance(y, DTensor) or y.placements != (Shard(1),):
                    raise AssertionError(f"{which} ({name}): the residual is {type(y).__name__} "
                                         f"{getattr(y, 'placements', '')}, not a DTensor Shard(1)")
                y.full_tensor().square().sum().backward()
                outs[name] = (xd, y, sub)
            (xt, yt, st), (xo, yo, so) = outs["torch"], outs["commfuse"]
            _close(yo, yt, f"{which}: x + block(x) on a DTensor residual")
            _close(xo.grad, xt.grad, f"{which}: input grad through the DTensor residual")
            for (pn, pt), (_, po) in zip(st.named_parameters(), so.named_parameters()):
                _close(po.grad, pt.grad, f"{which}.{pn} grad through the DTensor residual")

    _run(results, "dotted-projection-names", dotted_names)
    _run(results, "fused-qkv", fused_qkv)
    _run(results, "refused-by-name", refused)
    _run(results, "dtensor-residual", dtensor_residual)
    return results
