"""Expert parallelism without a process group: the mesh layout's arithmetic, the plan's pre-flight, the strategies.

The expert axis borrows the inner ranks of the data-parallel shard ranks; everything here is decided from sizes,
names and shapes every rank knows, so each rank raises the same error before any collective.
"""

from __future__ import annotations

import pytest
import torch

from modelpar import MeshLayout, MeshSizeError, ModelParallelStrategy
from modelpar.models import Llama, LlamaConfig
from modelpar.moe._apply import sum_reduction_needed
from modelpar.plans import LLAMA_MOE_PLAN, LLAMA_PLAN
from modelpar.trainer import ModelParallelStrategy as TrainerStrategy

MOE = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=6, top_k=2)


def test_public_surface_is_what_we_mean():
    import modelpar.models
    import modelpar.moe

    assert sorted(modelpar.moe.__all__) == [
        "ExpertParallel",
        "all_to_all",
        "check_moe_module",
        "expert_fsdp_mesh",
        "expert_parallel_mesh",
        "parallelize_experts",
        "sum_over_group",
    ]
    assert sorted(modelpar.models.__all__) == ["Llama", "LlamaConfig"]


def resolve(dp, tp, ep, world=8, replicate=1, cp=1):
    return MeshLayout.resolve(
        dp,
        tp,
        world_size=world,
        num_nodes=1,
        devices_per_node=world,
        data_parallel_replicate_size=replicate,
        context_parallel_size=cp,
        expert_parallel_size=ep,
    )


@pytest.mark.parametrize(
    ("dp", "tp", "ep", "replicate", "axes", "shape"),
    [
        (8, 1, 2, 1, ("expert_data_parallel", "expert_parallel", "tensor_parallel"), (4, 2, 1)),
        (8, 1, 8, 1, ("expert_data_parallel", "expert_parallel", "tensor_parallel"), (1, 8, 1)),
        (4, 2, 2, 1, ("expert_data_parallel", "expert_parallel", "tensor_parallel"), (2, 2, 2)),
        ("auto", 2, 4, 1, ("expert_data_parallel", "expert_parallel", "tensor_parallel"), (1, 4, 2)),
        (
            8,
            1,
            2,
            2,
            ("data_parallel_replicate", "expert_data_parallel", "expert_parallel", "tensor_parallel"),
            (2, 2, 2, 1),
        ),
        (4, 2, 1, 1, ("data_parallel", "tensor_parallel"), (4, 2)),
    ],
)
def test_the_expert_axis_splits_the_shard_ranks_inside_data_and_outside_tensor_parallel(
    dp, tp, ep, replicate, axes, shape
):
    layout = resolve(dp, tp, ep, replicate=replicate)
    assert (layout.axes, layout.shape) == (axes, shape)
    assert layout.world_size == 8  # borrowed ranks: the world size does not change
    assert layout.expert_shard_size * ep * layout.data_parallel_replicate_size == layout.data_parallel_size


def test_an_expert_axis_that_does_not_fit_names_the_values_and_the_fix():
    with pytest.raises(MeshSizeError, match=r"`expert_parallel_size=3` must divide the data-parallel size \(4\)"):
        resolve(4, 2, 3)
    with pytest.raises(MeshSizeError, match=r"Choose it among \[1, 2, 4\]"):
        resolve(4, 2, 8)
    with pytest.raises(
        MeshSizeError, match=r"replica \(`data_parallel_size=8` / `data_parallel_replicate_size=4` = 2\)"
    ):
        resolve(8, 1, 4, replicate=4)
    with pytest.raises(MeshSizeError, match=r"with `context_parallel_size=2` is not supported yet"):
        resolve(2, 1, 2, cp=2)


@pytest.mark.parametrize("bad", [0, -2, 1.5, "auto", True])
def test_both_strategies_refuse_an_expert_parallel_size_that_is_not_a_positive_int(bad):
    for strategy in (
        lambda: ModelParallelStrategy(LLAMA_MOE_PLAN, expert_parallel_size=bad),
        lambda: TrainerStrategy(expert_parallel_size=bad),
    ):
        with pytest.raises(MeshSizeError, match=rf"`expert_parallel_size={bad!r}` is not a valid size"):
            strategy()


def test_the_plan_checks_experts_against_the_expert_axis_before_sharding():
    with torch.device("meta"):
        model = Llama(MOE)
    LLAMA_MOE_PLAN.check(model, 1, expert_parallel_size=3)  # 6 experts over 3 ranks: 2 each
    LLAMA_MOE_PLAN.check(model, 1, expert_parallel_size=6)  # one expert per rank, top_k=2 above it: dropless, fine
    with pytest.raises(
        ValueError,
        match=r"`expert_parallel_size=4` must divide the number of experts, but"
        r" 'layers.0.moe' has 6.*Choose it among \[1, 2, 3, 6\]",
    ):
        LLAMA_MOE_PLAN.check(model, 1, expert_parallel_size=4)
    with pytest.raises(ValueError, match=r"the plan names none"):
        LLAMA_MOE_PLAN.replace(experts=()).check(model, 1, expert_parallel_size=2)
    with pytest.raises(ValueError, match=r"ParallelPlan.experts: the pattern 'layers.\*.mlp' matches no submodule"):
        LLAMA_MOE_PLAN.replace(experts=("layers.*.mlp",)).check(model, 1, expert_parallel_size=2)
    with pytest.raises(ValueError, match=r"'layers.0.attention' \(Attention\) is named as a MoE module"):
        LLAMA_MOE_PLAN.replace(experts=("layers.*.attention",)).check(model, 1)
    with pytest.raises(ValueError, match=r"'layers.\*.feed_forward' matches no submodule.*'layers.\*.moe'"):
        LLAMA_PLAN.check(model, 2)  # the dense plan does not fit a model whose every block is a MoE


def test_a_moe_module_whose_top_k_exceeds_its_experts_is_refused():
    from modelpar.models.moe import MoE
    from modelpar.moe import check_moe_module

    moe = MoE(8, 8, 4, 2)
    moe.top_k = 5  # a module built elsewhere, without MoE's own check
    with pytest.raises(ValueError, match=r"'blocks.0.moe': top_k=5 is more than its 4 experts"):
        check_moe_module("blocks.0.moe", moe, 2)


def test_a_plan_refuses_experts_given_as_a_bare_string():
    with pytest.raises(TypeError, match=r"ParallelPlan\(experts='layers.\*.moe'\) must be a tuple"):
        LLAMA_PLAN.replace(experts="layers.*.moe")


@pytest.mark.parametrize(
    ("backend", "shard_ranks", "expected"),
    [("nccl", 4, False), ("gloo", 4, True), ("gloo", 1, False), ("nccl", 1, False), ("xccl", 2, True)],
)
def test_expert_gradients_are_divided_apart_from_the_reduction_where_premul_sum_is_missing(
    backend, shard_ranks, expected
):
    assert sum_reduction_needed(backend, shard_ranks) is expected
