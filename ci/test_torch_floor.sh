#!/usr/bin/env bash
# The torch floor: tests/unit, tests/conformance and the version-sensitive gloo tests again on the oldest
# torch pyproject.toml admits, in an environment of its own (ci/setup_floor.sh: torch 2.9.0 with the NVIDIA
# libraries it needs to import, without torch-xla), with commfuse from this working tree.
# tests/unit/test_packaging.py holds pyproject's floor to the torch pinned there.
#
# Which gloo tests: the ones whose outcome depends on torch's version, not on commfuse's code alone. The
# rest of tests/distributed exercises commfuse's own ring, checks and layers over gloo's send and receive,
# which torch 2.9 and 2.13 run alike; the main stage runs all of it on torch 2.13. The files here touch the
# torch APIs commfuse looks up with a fallback or builds on, whose behaviour moved between 2.9 and 2.13:
#   test_tp_gloo.py                 DTensor and torch's ColwiseParallel/RowwiseParallel, side by side with
#                                   commfuse.tp's styles
#   test_compile_gloo.py            torch.compile (inductor on CPU), torch.library's custom ops and opcheck
#   test_checkpoint_gloo.py         torch.utils.checkpoint, checkpoint_wrapper, composable checkpoint and
#                                   selective checkpoint policies
#   test_fsdp_gloo.py               FSDP2 (fully_shard) and clip_grad_norm_ over DTensor gradients
#   test_moe_params_gloo.py         DTensor experts through torch.distributed.checkpoint, DDP, fully_shard
#   test_moe_model_gloo.py          commfuse.ep's FSDP2 and DDP recipes, and torch's clip_grad_norm_ refusing
#                                   such a model (its error text is torch's)
#   test_pairwise_all_to_all_gloo.py  gloo's whole all-to-all, which torch 2.9's gloo refuses
#   test_ring_attention_gloo.py::test_ring_attention_equals_torch_ring_attention
#                                   torch's own ring attention, private internals
#                                   (torch.distributed.tensor.experimental._attention) that change by release
# Extra arguments go to pytest.
#   COMMFUSE_FLOOR_VENV  the environment (default: ~/.cache/commfuse/venv-floor)
set -euo pipefail
cd "$(dirname "$0")/.."
export COMMFUSE_LAUNCH_START="${COMMFUSE_LAUNCH_START:-forkserver}"
source ci/common.sh
set_up floor setup_floor.sh
venv="${COMMFUSE_FLOOR_VENV:-$HOME/.cache/commfuse/venv-floor}"
"$venv/bin/python" -c 'import commfuse, torch; print("torch floor:", torch.__version__, "commfuse from", commfuse.__file__)'
gloo=(
    tests/distributed/test_tp_gloo.py
    tests/distributed/test_compile_gloo.py
    tests/distributed/test_checkpoint_gloo.py
    tests/distributed/test_fsdp_gloo.py
    tests/distributed/test_moe_params_gloo.py
    tests/distributed/test_moe_model_gloo.py
    tests/distributed/test_pairwise_all_to_all_gloo.py
    tests/distributed/test_ring_attention_gloo.py::test_ring_attention_equals_torch_ring_attention
)
# Of a case parametrized by world size, the 2-rank run: what torch's version changes shows there, and the main
# stage runs every world size on 2.13. A case with no 2-rank twin (a 2 x 2 mesh) runs as it is. Left to the main
# stage: whole layers, styles and a checkpointed block compiled by inductor (each 1.5 to 3 minutes here); on the
# floor opcheck checks every op's registration, inductor and aot_eager compile the functional ops, and what does
# not compile is refused by name.
collected="$("$venv/bin/python" -m pytest --collect-only -q -p no:cacheprovider "${gloo[@]}")"  # fails on an error
mapfile -t cases < <(printf '%s\n' "$collected" | "$venv/bin/python" -c '
import re, sys
left = ("test_tp_styles_compile_to_one_graph_of_fused_ops",
        "test_layers_compile_to_one_graph_and_train_as_eager",
        "test_layers_compile_on_the_fake_group_at_world_size_8",
        "test_compiled_with_inductor_under_the_selective_policy_equals_eager")
ids = [line.strip() for line in sys.stdin if "::" in line]
def twin(i):
    m = re.match(r"(.*[\[-])([34])\]$", i)
    return m and m.group(1) + "2]" in ids
print("\n".join(i for i in ids if not twin(i) and i.split("::")[1].split("[")[0] not in left))')
if [ "${#cases[@]}" -lt 50 ]; then
    echo "torch floor: only ${#cases[@]} gloo cases collected from ${gloo[*]}" >&2
    exit 1
fi
echo "torch floor: ${#cases[@]} gloo cases of ${gloo[*]}"
"$venv/bin/python" -m pytest -p no:cacheprovider "${parallel[@]}" tests/unit tests/conformance "${cases[@]}" "$@"
