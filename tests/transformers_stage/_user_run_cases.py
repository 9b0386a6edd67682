"""Rank-side bodies of test_user_run_gloo.py: a transformers model trained as a user trains it, on a dp x tp mesh
of 4 gloo ranks: commfuse's block styles (or, where commfuse refuses a module, its per-linear styles) over tp,
FSDP2 (``fully_shard``) over dp per decoder layer and the root, activation checkpointing as transformers turns
it on (non-reentrant), then bf16 autocast and a round trip through ``torch.distributed.checkpoint``."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

import _zoo_cases as zoo


def _build(name: str, mesh, dtype: torch.dtype, ac: bool = True):
    """The family's model under the zoo's block plan on ``mesh["tp"]`` (per-linear where commfuse refuses a
    module, as the zoo expects), checkpointing each decoder layer, each layer and the root sharded by FSDP2
    over ``mesh["dp"]``."""
    from torch.distributed.fsdp import fully_shard

    fall_back = frozenset(path for run, path in zoo.FAMILIES[name].refused if run == "block")
    model = zoo.parallelized(name, "block", mesh["tp"], fall_back).to(dtype)
    if ac:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _batches(steps: int, dp: int) -> list[list[torch.Tensor]]:
    """Each step's token ids of each dp rank (the tp ranks of a dp rank share them)."""
    g = torch.Generator().manual_seed(300)
    return [[torch.randint(3, zoo.VOCAB, (1, zoo.SEQ), generator=g) for _ in range(dp)] for _ in range(steps)]


def _whole(t):
    """The whole tensor (a 2-D DTensor's ``full_tensor()``; DTensor logs that it gathers a ``_StridedShard`` in
    two steps, which only this comparison does: not logged)."""
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    return t.full_tensor() if isinstance(t, DTensor) else t


def against_one_process(rank: int, n: int, name: str, ac: bool = True, steps: int = 2) -> list[str]:
    """float64, no autocast: the losses and every gradient of ``steps`` AdamW steps on dp x tp = 2 x n/2, each dp
    rank with its own batch, equal the model's in one process on the mean of the dp ranks' losses (FSDP2
    averages over dp)."""
    from torch.distributed.device_mesh import init_device_mesh

    problems = []
    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    model = _build(name, mesh, torch.float64, ac)
    reference = zoo.model_of(name)
    pairs = zoo._counterparts(model, reference, name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    tolerance = zoo.FAMILIES[name].tolerance
    for step, ids in enumerate(_batches(steps, 2)):
        model.train()
        loss = model(input_ids=ids[dp], labels=ids[dp], use_cache=False).loss
        loss.backward()
        want = [reference(input_ids=t, labels=t, use_cache=False).loss for t in ids]
        (sum(want) / len(want)).backward()
        checks = [zoo._relative(_whole(loss), want[dp], f"step {step}: loss")]
        for key, p in model.named_parameters():
            source, view = pairs[key]
            if p.grad is None:
                problems.append(f"step {step}: {key} has no gradient")
                continue
            checks.append(zoo._relative(_whole(p.grad), view(source.grad), f"step {step}: {key} gradient"))
        problems += [f"{what}: relative difference {err:.3g}" for err, what in checks if err > tolerance]
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    return problems


def checkpoint_round_trip(rank: int, n: int, name: str, path: str, ac: bool = True, steps: int = 3) -> list[str]:
    """bf16 autocast: a model trained one step (its loss within bfloat16's reach of the model's in one process,
    in float32), saved with torch.distributed.checkpoint (the model's and the optimizer's state), and trained
    on; a fresh model of other weights that loads the checkpoint takes the next steps with the same losses and
    ends with the same parameters, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    problems = []
    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    batches = _batches(steps, 2)

    def step(model, opt, ids) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids[dp], labels=ids[dp], use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    model = _build(name, mesh, torch.float32, ac)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = step(model, opt, batches[0])
    with torch.no_grad():
        want = zoo.model_of(name).float()(input_ids=batches[0][dp], labels=batches[0][dp], use_cache=False).loss
    if (err := zoo._relative(first, want, "")[0]) > 3e-2:
        problems.append(f"step 0 under bf16 autocast: loss {first.item():.5g}, the model's in one process (float32) "
                        f"{want.item():.5g}: a relative difference of {err:.3g}")
    state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": state, "optim": optim_state}, checkpoint_id=path)
    losses = [step(model, opt, ids) for ids in batches[1:]]

    torch.manual_seed(1)  # other weights, which the checkpoint must replace
    again = _build(name, mesh, torch.float32, ac)
    with torch.no_grad():
        for p in again.parameters():
            p.add_(1.0)
    opt_again = torch.optim.AdamW(again.parameters(), lr=1e-3)
    state, optim_state = get_state_dict(again, opt_again)
    loaded = {"model": state, "optim": optim_state}
    dcp.load(loaded, checkpoint_id=path)
    set_state_dict(again, opt_again, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    for i, ids in enumerate(batches[1:]):
        got = step(again, opt_again, ids)
        if not torch.equal(got, losses[i]):
            problems.append(f"step {i + 1} after loading: loss {got.item()!r}, the unsaved model's "
                            f"{losses[i].item()!r}")
    for (key, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        if not torch.equal(_whole(p.detach()), _whole(q.detach())):
            problems.append(f"after {steps} steps: {key} differs from the unsaved model's")
    return problems


def user_runs(rank: int, n: int, names: tuple, path: str, ac: bool = True) -> dict:
    """:func:`against_one_process` and :func:`checkpoint_round_trip` for each family in ``names``, in one launch:
    the problems of each, by family and body."""
    import traceback

    out = {}
    for name in names:
        for body in (against_one_process, checkpoint_round_trip):
            args = (name, ac) if body is against_one_process else (name, f"{path}-{name}", ac)
            try:
                out[name, body.__name__] = body(rank, n, *args)
            except Exception as e:  # noqa: BLE001 - handed to the pytest side, with its traceback
                out[name, body.__name__] = [f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=12)}"]
    return out
