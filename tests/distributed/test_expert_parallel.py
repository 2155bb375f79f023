"""Expert parallelism through the strategies, against one process: the MoE Llama variant, checkpoints, pre-flight.

The grid runs in the 4-process spawn shared with context parallelism (``conftest.py``). Each training case builds the single-process MoE model from the same
seed, feeds it the whole global batch, and checks that the sharded run gives the same loss (cross-entropy plus the
auxiliary load-balancing and z-losses over the global batch), the same gradients and, after AdamW steps, the same
weights: FSDP over 4 ranks with no expert axis, EP=2 (dp=4), EP=4 (one expert per rank, top_k above it), EP=2 x
TP=2 on attention, EP=2 under HSDP. A checkpoint saved at EP=2 loads at EP=4 and at EP=1, exactly. Bad layouts are
refused on every rank before any collective.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from modelpar import estimate_memory
from modelpar.models import Llama, LlamaConfig
from modelpar.models.moe import MoE
from modelpar.plans import LLAMA_MOE_PLAN, LLAMA_PLAN, ParallelPlan
from parity import adamw, assert_matches, error_text, fsdp_blocks_only, full_state, local_slice, make_fabric

STEPS = 3
SEQ = 8
BATCH = 8
CFG = LlamaConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=SEQ, n_experts=4, top_k=2
)
# Larger coefficients than the defaults, so the auxiliary losses move the router measurably.
CFG_AUX = LlamaConfig(**{**CFG.__dict__, "aux_loss_coef": 0.1, "z_loss_coef": 0.01})


def batches(steps: int, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, CFG.vocab_size, (BATCH, 1), generator=g)
        step = torch.randint(1, 5, (BATCH, 1), generator=g)
        seq = (start + step * torch.arange(SEQ + 1)) % CFG.vocab_size
        out.append((seq[:, :-1].clone(), seq[:, 1:].clone()))
    return out


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def case_moe_trains_like_one_process(dp: int, tp: int, ep: int, **kw: Any) -> dict[str, Any]:
    """Loss (aux included), router statistics, gradients, clipping and weights after AdamW steps equal one process."""
    fabric = make_fabric(dp, tp, world_size=4, parallelize_fn=LLAMA_MOE_PLAN, expert_parallel_size=ep, **kw)
    torch.manual_seed(0)
    ref = Llama(CFG_AUX)
    model = fabric.setup_module(copy.deepcopy(ref))
    optimizer = fabric.setup_optimizers(adamw(model.parameters(), lr=1e-2, weight_decay=0.1))
    ref_opt = adamw(ref.parameters(), lr=1e-2, weight_decay=0.1)
    w1 = model.module.layers[0].moe.experts.w1
    out: dict[str, Any] = {
        "axes": fabric.strategy.device_mesh.mesh_dim_names,
        "expert_mesh": w1.device_mesh.mesh_dim_names,
        "local_experts": w1.to_local().shape[0],
        "expert_placements": str(w1.placements),
        "losses": [],
    }
    for step, (x, y) in enumerate(batches(STEPS)):
        logits = model(local_slice(fabric, x))
        aux = model.aux_loss
        loss = lm_loss(logits, local_slice(fabric, y)) + aux
        fabric.backward(loss)
        ref_logits = ref(x)
        ref_loss = lm_loss(ref_logits, y) + ref.aux_loss
        ref_loss.backward()
        torch.testing.assert_close(aux.detach(), ref.aux_loss.detach(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(
            model.module.layers[0].moe.expert_counts, ref.layers[0].moe.expert_counts, atol=0, rtol=0
        )
        global_loss = fabric.all_reduce(loss.detach().clone())  # mean over the data-parallel ranks
        torch.testing.assert_close(global_loss, ref_loss.detach(), atol=1e-5, rtol=1e-5)
        assert_matches(model, ref, "grad")
        if step == STEPS - 1:
            got = fabric.clip_gradients(model, optimizer, max_norm=0.05)
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        optimizer.step()
        ref_opt.step()
        optimizer.zero_grad()
        ref_opt.zero_grad()
        # AdamW divides by the root of the second moment: a near-zero gradient that differs in the 7th digit (another
        # summation order under TP) moves its weight by a visible fraction of lr, hence 1e-4 on weights.
        out["worst_param_diff"] = assert_matches(model, ref, "param", atol=1e-4)
        out["losses"].append(global_loss.item())
        out["aux"] = aux.item()
    # what this rank holds, for estimate_memory's expert-parallel arithmetic (test_estimate_counts.py style)
    states = getattr(optimizer, "optimizer", optimizer).state.values()
    out["param_bytes"] = sum(_local_bytes(p) for p in model.parameters())
    out["adam_bytes"] = sum(_local_bytes(v) for state in states for k, v in state.items() if k != "step")
    experts = model.module.layers[0].moe.experts
    if ep > 1:  # the experts' own FSDP unit, gathered over the ranks holding the same experts
        experts.unshard()
        out["gathered_experts"] = sum(_local_bytes(p) for p in experts.parameters())
        experts.reshard()
    return out


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def case_moe_activations(ep: int) -> dict[str, int]:
    """What autograd saves in a MoE Llama step (after FSDP2's warm-up step), beside estimate_memory's activations.

    Each storage once, counted after the step: the experts' gathered weights (``to_local()`` views that autograd
    saves) are freed by FSDP2's reshard after forward and count 0; parameters (leaves) are excluded.
    """
    fabric = make_fabric(4, 1, world_size=4, parallelize_fn=LLAMA_MOE_PLAN, expert_parallel_size=ep)
    torch.manual_seed(0)
    model = fabric.setup_module(Llama(CFG))
    x, y = batches(1)[0]
    x, y = local_slice(fabric, x), local_slice(fabric, y)
    fabric.backward(lm_loss(model(x), y))  # FSDP2's lazy initialization allocates once, on the first forward
    model.zero_grad(set_to_none=True)
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if not (base.is_leaf and base.requires_grad):
            local = t.to_local() if isinstance(t, DTensor) else t
            saved.setdefault(local.untyped_storage().data_ptr(), local)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(x)
        loss = lm_loss(logits, y)
    measured = sum(t.untyped_storage().nbytes() for t in saved.values()) + logits.numel() * logits.element_size()
    fabric.backward(loss)
    with torch.device("meta"):
        meta = Llama(CFG)
    estimate = estimate_memory(
        meta, plan=LLAMA_MOE_PLAN, data_parallel_size=4, expert_parallel_size=ep, seq_len=SEQ, micro_batch_size=2
    )
    return {"measured": measured, "estimated": estimate.stored_activations}


class OnlyMoE(torch.nn.Module):
    """One MoE layer alone, so that CommDebugMode sees what a MoE layer costs and nothing else."""

    def __init__(self) -> None:
        super().__init__()
        self.moe = MoE(CFG.dim, CFG.ffn_hidden, CFG.n_experts, CFG.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x).clone()  # FSDP2 warns about a root returning a view


def case_collectives_of_one_moe_layer(ep: int) -> dict[str, Any]:
    """What one MoE layer's forward and backward cost (CommDebugMode: FSDP's collectives and the dispatch's)."""
    plan = ParallelPlan(experts=("moe",))
    fabric = make_fabric(4, 1, world_size=4, parallelize_fn=plan, expert_parallel_size=ep)
    torch.manual_seed(0)
    model = fabric.setup_module(OnlyMoE())
    x = torch.randn(BATCH, SEQ, CFG.dim, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with CommDebugMode() as forward:
        out = model(local_slice(fabric, x))
        loss = out.square().mean() + model.moe.load_balance_loss
    with CommDebugMode() as backward:
        fabric.backward(loss)
    return {
        "forward": {str(k).split(".")[-1]: v for k, v in forward.get_comm_counts().items()},
        "backward": {str(k).split(".")[-1]: v for k, v in backward.get_comm_counts().items()},
    }


# -- checkpoints across expert-parallel sizes ----------------------------------------------------------------
def case_checkpoints_move_between_expert_parallel_sizes(root: str) -> dict[str, Any]:
    """Saved at EP=2 (dp=4), loaded at EP=4, saved again, loaded at EP=1 x TP=2: every tensor equal, exactly."""
    diffs: dict[str, float] = {}
    snapshots = []
    for index, (dp, tp, ep) in enumerate([(4, 1, 2), (4, 1, 4), (2, 2, 1)]):
        fabric = make_fabric(dp, tp, world_size=4, parallelize_fn=LLAMA_MOE_PLAN, expert_parallel_size=ep)
        torch.manual_seed(index)  # a different init each time: only the checkpoint can make them equal
        model = fabric.setup_module(Llama(CFG))
        optimizer = fabric.setup_optimizers(adamw(model.parameters(), lr=1e-2))
        state = {"model": model, "optimizer": optimizer}
        if index == 0:
            x, y = batches(1)[0]
            fabric.backward(lm_loss(model(local_slice(fabric, x)), local_slice(fabric, y)) + model.aux_loss)
            optimizer.step()
        else:
            fabric.load(f"{root}/ckpt{index - 1}", state)
            loaded = full_state(model, optimizer)
            diffs[f"ep{ep}"] = max((loaded[k] - snapshots[-1][k]).abs().max().item() for k in snapshots[-1])
        snapshots.append(full_state(model, optimizer))
        fabric.save(f"{root}/ckpt{index}", state)
    return diffs


# -- bad input -----------------------------------------------------------------------------------------------
def case_bad_input_is_refused_on_every_rank() -> dict[str, str]:
    from modelpar import ModelParallelStrategy

    errors: dict[str, str] = {}
    three = LlamaConfig(**{**CFG.__dict__, "n_experts": 6, "top_k": 2})
    for name, (fn, cfg, ep, dp, tp) in {
        "experts_not_divisible": (LLAMA_MOE_PLAN, three, 4, 4, 1),
        "plan_without_experts": (LLAMA_PLAN.replace(tensor_parallel={}), CFG, 2, 4, 1),
        "fsdp_only": (fsdp_blocks_only, CFG, 2, 4, 1),
    }.items():
        fabric = make_fabric(dp, tp, world_size=4, parallelize_fn=fn, expert_parallel_size=ep)
        errors[name] = error_text(lambda f=fabric, c=cfg: f.setup_module(Llama(c)))
    errors["axis_does_not_fit"] = error_text(
        lambda: make_fabric(2, 2, world_size=4, parallelize_fn=LLAMA_MOE_PLAN, expert_parallel_size=4)
    )
    errors["axis_does_not_fit_hsdp"] = error_text(
        lambda: make_fabric(
            4, 1, world_size=4, parallelize_fn=LLAMA_MOE_PLAN, expert_parallel_size=4, data_parallel_replicate_size=2
        )
    )
    errors["not_a_size"] = error_text(lambda: ModelParallelStrategy(LLAMA_MOE_PLAN, expert_parallel_size=0))
    t = torch.ones(())
    dist.all_reduce(t)  # no rank was left inside a collective
    errors["sum"] = str(t.item())
    return errors


def grid(root: str) -> dict[str, Any]:
    return {
        "fsdp4_ep1": case_moe_trains_like_one_process(4, 1, 1),
        "ep2": case_moe_trains_like_one_process(4, 1, 2),
        "ep4": case_moe_trains_like_one_process(4, 1, 4),
        "ep2_tp2": case_moe_trains_like_one_process(2, 2, 2),
        "ep2_hsdp": case_moe_trains_like_one_process(4, 1, 2, data_parallel_replicate_size=2),
        "activations_ep1": case_moe_activations(1),
        "activations_ep2": case_moe_activations(2),
        "comm_ep1": case_collectives_of_one_moe_layer(1),
        "comm_ep2": case_collectives_of_one_moe_layer(2),
        "checkpoints": case_checkpoints_move_between_expert_parallel_sizes(root),
        "errors": case_bad_input_is_refused_on_every_rank(),
    }


@pytest.fixture(scope="module")
def results(context_parallel_spawn: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This module's part of the shared 4-rank spawn (``tests/distributed/conftest.py``)."""
    return [rank["experts"] for rank in context_parallel_spawn]


_LAYOUTS = {
    "fsdp4_ep1": {"data_parallel_size": 4, "expert_parallel_size": 1},
    "ep2": {"data_parallel_size": 4, "expert_parallel_size": 2},
    "ep4": {"data_parallel_size": 4, "expert_parallel_size": 4},
    "ep2_tp2": {"data_parallel_size": 2, "tensor_parallel_size": 2, "expert_parallel_size": 2},
    "ep2_hsdp": {"data_parallel_size": 4, "data_parallel_replicate_size": 2, "expert_parallel_size": 2},
}


@pytest.mark.parametrize("case", list(_LAYOUTS))
def test_estimate_memory_counts_the_parameters_and_adam_states_each_rank_holds(results, case):
    with torch.device("meta"):
        model = Llama(CFG_AUX)
    estimate = estimate_memory(model, plan=LLAMA_MOE_PLAN, optimizer="adamw", **_LAYOUTS[case])
    for rank in results:  # every shard is even here, so FSDP2's padding adds nothing
        assert (rank[case]["param_bytes"], rank[case]["adam_bytes"]) == (
            estimate.parameters,
            estimate.optimizer_states,
        )
        if case != "fsdp4_ep1":  # n_experts / ep whole experts, the largest unit of this model
            assert estimate.largest_unit == "layers.0.moe.experts"
            assert rank[case]["gathered_experts"] == estimate.gathered_unit


@pytest.mark.parametrize("case", ["activations_ep1", "activations_ep2"])
def test_estimated_moe_activations_match_what_autograd_saves_on_average_over_the_ranks(results, case):
    # Real routing is not balanced: under expert parallelism a rank keeps the activations of the tokens its experts
    # received, which the estimate takes as the mean (tokens x top_k per rank); the mean over the ranks is that.
    measured = [rank[case]["measured"] for rank in results]
    estimated = results[0][case]["estimated"]
    assert abs(sum(measured) / len(measured) - estimated) <= 0.10 * estimated, (measured, estimated)


@pytest.mark.parametrize("case", ["fsdp4_ep1", "ep2", "ep4", "ep2_tp2", "ep2_hsdp"])
def test_the_moe_llama_trains_like_one_process_with_expert_parallelism(results, case):
    got = results[0][case]
    assert len(got["losses"]) == STEPS and got["losses"][0] > got["losses"][-1]
    # each rank holds n_experts / (the ranks that shard a replica) experts: ep splits whole experts, FSDP the rest
    shard_ranks = {"ep2_tp2": 2, "ep2_hsdp": 2}.get(case, 4)
    assert got["local_experts"] == CFG.n_experts // shard_ranks
    if case != "fsdp4_ep1":
        assert "expert_parallel" in got["axes"]
        assert got["expert_mesh"][-2:] == ("expert_data_parallel", "expert_parallel")
    else:
        assert got["expert_mesh"] == ("data_parallel",)


def test_one_moe_layer_costs_three_all_to_alls_forward_two_backward_and_one_statistics_all_reduce_each_way(results):
    ep1, ep2 = results[0]["comm_ep1"], results[0]["comm_ep2"]
    # no expert axis: FSDP's own collectives, plus the all-reduce of the 2E + 2 router statistics (and its backward)
    assert ep1 == {
        "forward": {"_allgather_base_": 1, "allreduce_": 1},
        "backward": {"allreduce_": 1, "_reduce_scatter_base_": 1},
    }
    # EP=2: the counts and the two token all-to-alls forward, the two token ones backward; the experts are an FSDP
    # unit of their own (one all-gather and one reduce-scatter more, and a re-gather for backward)
    assert ep2 == {
        "forward": {"_allgather_base_": 2, "alltoall_base_": 3, "allreduce_": 1},
        "backward": {"_allgather_base_": 1, "allreduce_": 1, "alltoall_base_": 2, "_reduce_scatter_base_": 2},
    }


def test_checkpoints_load_exactly_across_expert_parallel_sizes(results):
    for result in results:
        assert result["checkpoints"] == {"ep4": 0.0, "ep1": 0.0}


def test_bad_layouts_are_refused_on_every_rank_with_the_fix(results):
    for result in results:
        errors = result["errors"]
        assert errors["experts_not_divisible"].startswith(
            "ValueError: `expert_parallel_size=4` must divide the number of experts, but 'layers.0.moe' has 6"
        ), errors
        assert "[1, 2, 3, 6]" in errors["experts_not_divisible"]
        assert errors["plan_without_experts"].startswith("ValueError: Expert parallelism (`expert_parallel_size=2`)")
        assert "experts=('layers.*.moe',)" in errors["plan_without_experts"]
        assert errors["fsdp_only"].startswith("ValueError: Expert parallelism was asked for"), errors
        assert "parallelize_experts" in errors["fsdp_only"]
        assert errors["axis_does_not_fit"].startswith(
            "MeshSizeError: `expert_parallel_size=4` must divide the data-parallel size (2)"
        )
        assert "Choose it among [1, 2]" in errors["axis_does_not_fit"]
        assert "`data_parallel_replicate_size=2` = 2" in errors["axis_does_not_fit_hsdp"]
        assert errors["not_a_size"].startswith("MeshSizeError: `expert_parallel_size=0` is not a valid size")
        assert errors["sum"] == "4.0"


def context_and_expert_grids(root: str) -> dict[str, Any]:
    """The body of the shared 4-rank session spawn (``context_parallel_spawn`` in ``conftest.py``)."""
    from test_context_parallel import kernel_and_strategy_grid
    from test_hf_router_loss import case_hf_router_loss_is_the_global_batch_one

    return {
        **kernel_and_strategy_grid(root),
        "experts": grid(f"{root}/experts"),
        "hf_router_loss": case_hf_router_loss_is_the_global_batch_one(),
    }
