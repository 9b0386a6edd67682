"""Rank-side bodies of test_moe_params_gloo.py (run inside ``commfuse.launch`` processes): MoE's parameters
in the loops users run (checkpoints, DDP, FSDP2 on a dp x ep mesh, autocast)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from commfuse.errors import CommfuseError, CommfuseTypeError, CommfuseValueError
from commfuse.nn import MoE, moe_reference
from commfuse.nn._common import local

HIDDEN, FFN = 8, 12


def _whole(experts: int, seed: int = 3):
    """A whole layer's weights (router, w13, w2), the same on every rank, every expert different."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(experts, HIDDEN, generator=g) / HIDDEN ** 0.5,
            torch.randn(experts, HIDDEN, 2 * FFN, generator=g) / HIDDEN ** 0.5,
            torch.randn(experts, FFN, HIDDEN, generator=g) / FFN ** 0.5)


def _tokens(ranks: int, step: int, rows: int = 6) -> list[torch.Tensor]:
    """Every rank's tokens at ``step`` (global rank q's are ``[q]``), the same list on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(rows, HIDDEN, generator=g) for _ in range(ranks)]


def _loss_weights(q: int, y: torch.Tensor) -> torch.Tensor:
    return torch.linspace(-1, 1, y.numel()).reshape(y.shape) * (q + 1)


def _loss(q: int, y: torch.Tensor) -> torch.Tensor:
    """Rank q's own loss of its output (its mean-like reduction: a weighted sum over its tokens)."""
    return (y.float() * _loss_weights(q, y)).sum() / y.shape[0]


def _scale(t: torch.Tensor) -> float:
    return max(t.abs().max().item(), 1.0) if t.numel() else 1.0


def _differs(got: torch.Tensor, want: torch.Tensor, tol: float) -> str | None:
    """None when ``got`` equals ``want`` within ``tol`` of the latter's magnitude (and has its dtype and shape)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{got.dtype} {list(got.shape)} where {want.dtype} {list(want.shape)} was expected"
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    return None if err <= tol * _scale(want) else f"max diff {err:.3g} (tolerance {tol * _scale(want):.3g})"


# -- checkpoints ---------------------------------------------------------------------------------------------------


def dcp_round_trip(rank: int, n: int, path: str) -> list[str]:
    """Train a step, save layer and AdamW state with torch.distributed.checkpoint, load into a fresh layer with
    another init: every rank gets its own experts, the router and the optimizer state back bit-exactly, the
    checkpoint holds the whole layer, and the two layers compute and step alike."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    problems: list[str] = []
    experts = 2 * n
    torch.manual_seed(0)
    moe = MoE(HIDDEN, FFN, experts, 2, algorithm="ring").load_experts(*_whole(experts))
    opt = torch.optim.AdamW(moe.parameters(), lr=1e-2)
    _loss(rank, moe(_tokens(n, 0)[rank])).backward()
    opt.step()
    opt.zero_grad()
    saved = {name: local(p).detach().clone() for name, p in moe.named_parameters()}
    saved_moments = {name: local(opt.state[p]["exp_avg"]).clone() for name, p in moe.named_parameters()}
    model_state, optim_state = get_state_dict(moe, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)

    whole = {"router": [experts, HIDDEN], "w13": [experts, HIDDEN, 2 * FFN], "w2": [experts, FFN, HIDDEN]}
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for name, size in whole.items():
        got = list(meta[f"model.{name}"].size) if f"model.{name}" in meta else None
        if got != size:
            problems.append(f"the checkpoint holds model.{name} of size {got}, the whole layer's is {size}")

    torch.manual_seed(12345)  # another init: the load must replace it
    fresh = MoE(HIDDEN, FFN, experts, 2, algorithm="ring")
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    if torch.equal(local(fresh.w13), saved["w13"]):
        problems.append("the fresh layer starts with the saved experts: the test would prove nothing")
    model_state, optim_state = get_state_dict(fresh, fresh_opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for name, p in fresh.named_parameters():
        if not torch.equal(local(p).detach(), saved[name]):
            problems.append(f"rank {rank}: {name} is not what this rank saved (max diff "
                            f"{(local(p).detach() - saved[name]).abs().max().item():.3g})")
        moment = fresh_opt.state.get(p, {}).get("exp_avg")
        if moment is None or not torch.equal(local(moment), saved_moments[name]):
            problems.append(f"rank {rank}: AdamW's exp_avg of {name} is not what this rank saved")

    x = _tokens(n, 1)[rank]
    y_saved, y_loaded = moe(x), fresh(x)
    if not torch.equal(y_saved, y_loaded):
        problems.append(f"rank {rank}: the loaded layer's forward differs from the saved one's")
    _loss(rank, y_saved).backward()
    _loss(rank, y_loaded).backward()
    opt.step()
    fresh_opt.step()
    for (name, a), (_, b) in zip(moe.named_parameters(), fresh.named_parameters()):
        if not torch.equal(local(a).detach(), local(b).detach()):
            problems.append(f"rank {rank}: after one more step {name} differs between saved and loaded layer")
    return problems


# -- DDP over the expert-parallel group --------------------------------------------------------------------------


def ddp_over_experts(rank: int, n: int, how: str) -> dict:
    """DDP over the expert-parallel group, built with a process group or with a sub-mesh (DDP's DTensor path):
    what DDP's construction and the first forward did, and whether this rank's experts are still its own."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (1, n), mesh_dim_names=("dp", "ep"))
    experts = 2 * n
    torch.manual_seed(0)
    moe = MoE(HIDDEN, FFN, experts, 2, group=mesh["ep"], algorithm="ring").load_experts(*_whole(experts))
    mine = [local(p).detach().clone() for p in (moe.w13, moe.w2)]
    out = {"built": None, "forward": None, "refused": None}
    try:
        ddp = DDP(moe, process_group=mesh["ep"].get_group()) if how == "process_group" else \
            DDP(moe, device_mesh=mesh["ep"])
    except Exception as e:  # noqa: BLE001 - torch's own refusal
        out["built"] = f"{type(e).__name__}: {e}"[:400]
    else:
        try:
            y = ddp(_tokens(n, 0)[rank])
            _loss(rank, y).backward()
            out["forward"] = "ran"
        except CommfuseError as e:
            out["refused"] = f"{type(e).__name__}: {e}"
    kept = all(torch.equal(local(p).detach(), m) for p, m in zip((moe.w13, moe.w2), mine))
    out["experts_kept"] = kept
    return out


# -- a dp x ep mesh ------------------------------------------------------------------------------------------------


def dp_by_ep(rank: int, n: int, wrapper: str, steps: int = 3) -> list[str]:
    """MoE on ``mesh["ep"]`` of a 2 x 2 (dp, ep) mesh, wrapped over ``mesh["dp"]`` (torch's fully_shard or DDP),
    trained a few AdamW steps on each rank's own tokens, against one process that holds every expert and
    trains on the mean of the four ranks' losses: losses, gradients (the whole of each) and parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    problems: list[str] = []
    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "ep"))
    experts = 2 * (n // 2)
    weights = _whole(experts)
    moe = MoE(HIDDEN, FFN, experts, 2, group=mesh["ep"], algorithm="ring").load_experts(*weights)
    if wrapper == "fully_shard":
        from torch.distributed.fsdp import fully_shard

        model = torch.nn.Sequential(moe)  # the layer not the root: FSDP2 frees its weights after the forward
        fully_shard(moe, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(moe, device_mesh=mesh["dp"])
    # the parameters the wrapper left registered (DDP's DTensor path swaps the module's attributes for
    # DTensors made from them in each forward): what the optimizer steps and the gradients land on
    params = list(moe.parameters())
    ref = [w.clone().requires_grad_() for w in weights]
    opt = torch.optim.AdamW(params, lr=1e-2)
    opt_ref = torch.optim.AdamW(ref, lr=1e-2)
    names = ("router", "w13", "w2")
    start, stop = moe.expert_range

    def whole(t):
        """A parameter's or gradient's whole, or this rank's experts' share of the reference's."""
        return t.full_tensor() if isinstance(t, DTensor) else t

    def mine(name, t):  # what of the reference's whole this rank's tensor (a local one under DDP) holds
        return t if name == "router" or wrapper == "fully_shard" else t[start:stop]

    for step in range(steps):
        xs = _tokens(n, step)
        loss = _loss(rank, model(xs[rank]))
        loss.backward()
        ref_losses = [_loss(q, moe_reference(x, *ref, 2)) for q, x in enumerate(xs)]
        (sum(ref_losses) / n).backward()
        if (err := _differs(loss.detach(), ref_losses[rank].detach(), 1e-5)) is not None:
            problems.append(f"step {step}: loss {err}")
        for name, p, r in zip(names, params, ref):
            if (err := _differs(whole(p.grad), mine(name, r.grad), 2e-5)) is not None:
                problems.append(f"step {step}: {name} gradient {err}")
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    for name, p, r in zip(names, params, ref):
        if (err := _differs(whole(p.detach()), mine(name, r.detach()), 2e-5)) is not None:
            problems.append(f"after {steps} AdamW steps: {name} {err}")
    return problems


# -- mixed precision -------------------------------------------------------------------------------------------------


def autocast_matches_reference(rank: int, n: int, dtype_name: str) -> list[str]:
    """Under torch.autocast(cpu, dtype): the exchanges carry ``dtype`` (every floating message posted), and the
    output, the input gradient and the parameters' gradients have moe_reference's dtypes under the same
    autocast and its values within that dtype's tolerance; an fp32 and a low-precision input alike. Outside
    autocast a low-precision input into the fp32 layer is refused by name on every rank, and the group stays
    usable."""
    from commfuse.runtime.c10d import C10dBackend

    dtype = getattr(torch, dtype_name)
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]  # about one ulp of each at the scale
    problems: list[str] = []
    be = C10dBackend()
    posted: list[torch.dtype] = []
    real_post = be.post

    def recording(sends, recvs):
        posted.extend(t.dtype for _, t in (*sends, *recvs) if t.is_floating_point())
        return real_post(sends, recvs)

    be.post = recording
    experts = 2 * n
    weights = _whole(experts)
    for algorithm in ("ring", "ring:2"):
        for input_dtype in (torch.float32, dtype):
            where = f"{algorithm}, {input_dtype} input"
            moe = MoE(HIDDEN, FFN, experts, 2, algorithm=algorithm).load_experts(*weights)
            moe.backend = be
            xs = [x.to(input_dtype) for x in _tokens(n, 0, rows=16)]
            x = xs[rank].clone().requires_grad_()
            posted.clear()
            with torch.autocast("cpu", dtype=dtype):
                y = moe(x)
            _loss(rank, y).backward()
            if not posted or set(posted) != {dtype}:
                problems.append(f"{where}: the exchanges carried {sorted(set(map(str, posted)))}, not {dtype}")
            ref = [w.clone().requires_grad_() for w in weights]
            xr = [t.clone().requires_grad_() for t in xs]
            with torch.autocast("cpu", dtype=dtype):
                yr = [moe_reference(t, *ref, 2) for t in xr]
            sum(_loss(q, t) for q, t in enumerate(yr)).backward()  # each input's grad of its own rank's loss
            checks = [("output", y.detach(), yr[rank].detach()), ("input gradient", x.grad, xr[rank].grad)]
            start, stop = moe.expert_range
            for name, p, r in zip(("router", "w13", "w2"), (moe.router, moe.w13, moe.w2), ref):
                want = r.grad / n  # the mean of the ranks' losses
                checks.append((f"{name} gradient", local(p.grad), want if name == "router" else want[start:stop]))
            for what, got, want in checks:
                if (err := _differs(got, want, tol)) is not None:
                    problems.append(f"{where}: {what}: {err}")
    # outside autocast: refused by name on every rank, before any exchange; the next call runs
    moe = MoE(HIDDEN, FFN, experts, 2, algorithm="ring").load_experts(*weights)
    try:
        moe(_tokens(n, 0)[rank].to(dtype))
        problems.append(f"a {dtype} input into the float32 layer ran outside autocast")
    except CommfuseTypeError as e:
        if dtype_name not in str(e) or "float32" not in str(e) or f"rank {rank}" not in str(e):
            problems.append(f"the refusal does not name the dtypes and the rank: {e}")
    y = moe(_tokens(n, 0)[rank])
    if y.dtype != torch.float32:
        problems.append(f"the next float32 call gave {y.dtype}")
    return problems


# -- group= and initialisation -----------------------------------------------------------------------------------


def groups_and_init(rank: int, n: int) -> list[str]:
    """A 1-D mesh given as group is the parameters' mesh; a ProcessGroup gets a 1-D mesh over it; a 2-D mesh
    is refused by name. clip_grad_norm_ takes the whole layer's norm. Seeded alike, every rank has the same
    router and experts of its own, which are those of the same layer built on one rank (the experts do not
    depend on the world size)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    problems: list[str] = []
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("ep",))
    for label, group in (("1-D mesh", mesh), ("process group", mesh.get_group())):
        torch.manual_seed(0)
        moe = MoE(HIDDEN, FFN, 2 * n, 2, group=group, algorithm="ring")
        for name, placement in (("router", Replicate()), ("w13", Shard(0)), ("w2", Shard(0))):
            p = getattr(moe, name)
            if not isinstance(p, DTensor):
                problems.append(f"{label}: {name} is a {type(p).__name__}, not a DTensor")
                continue
            if tuple(p.placements) != (placement,):
                problems.append(f"{label}: {name} is placed {p.placements}, not ({placement},)")
            if label == "1-D mesh" and p.device_mesh is not mesh:
                problems.append(f"{label}: {name} is on {p.device_mesh}, not the mesh given as group")
            if dist.get_process_group_ranks(p.device_mesh.get_group()) != list(range(n)):
                problems.append(f"{label}: {name}'s mesh is not over the group")
        if list(moe.w13.shape) != [2 * n, HIDDEN, 2 * FFN]:
            problems.append(f"{label}: w13 is {list(moe.w13.shape)}, not the whole layer's")
    two_d = init_device_mesh("cpu", (1, n), mesh_dim_names=("dp", "ep"))
    try:
        MoE(HIDDEN, FFN, 2 * n, 2, group=two_d)
        problems.append("a 2-D mesh was taken as group")
    except CommfuseValueError as e:
        if "2-D DeviceMesh" not in str(e):
            problems.append(f"the 2-D mesh's refusal does not say why: {e}")

    torch.manual_seed(0)
    moe = MoE(HIDDEN, FFN, 2 * n, 2, algorithm="ring")
    # clip_grad_norm_ sees the whole layer: the router's gradient once, every rank's experts'
    _loss(rank, moe(_tokens(n, 0)[rank])).backward()
    grads = [local(p.grad) for p in (moe.router, moe.w13, moe.w2)]
    experts_sq = (grads[1].square().sum() + grads[2].square().sum()).reshape(1)
    dist.all_reduce(experts_sq)
    want = (grads[0].square().sum() + experts_sq[0]).sqrt()
    got = torch.nn.utils.clip_grad_norm_(moe.parameters(), 1e9)
    got = got.full_tensor() if isinstance(got, DTensor) else got
    if not torch.allclose(got, want, rtol=1e-5):
        problems.append(f"clip_grad_norm_ gave {got.item():.6g}, the whole layer's gradient norm is {want.item():.6g}")
    router, w13 = (local(p).detach() for p in (moe.router, moe.w13))
    routers = [torch.empty_like(router) for _ in range(n)]
    shards = [torch.empty_like(w13) for _ in range(n)]
    dist.all_gather(routers, router.contiguous())
    dist.all_gather(shards, w13.contiguous())
    if not all(torch.equal(r, routers[0]) for r in routers):
        problems.append("ranks seeded alike have different routers")
    if any(torch.equal(shards[q], shards[p]) for p in range(n) for q in range(p)):
        problems.append("ranks seeded alike have the same experts")
    alone = [dist.new_group([q]) for q in range(n)]  # every rank makes every group
    torch.manual_seed(0)
    one = MoE(HIDDEN, FFN, 2 * n, 2, group=alone[rank])
    whole = torch.cat(shards)
    if not torch.equal(local(one.w13).detach(), whole) or not torch.equal(local(one.router).detach(), router):
        problems.append("the layer built on one rank with the same seed has other experts")
    return problems
