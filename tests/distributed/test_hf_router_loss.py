"""A Hugging Face MoE model's router loss under data parallelism equals one process's (``modelpar.hf.router_aux_loss``).

A tiny Qwen3-MoE, FSDP over 4 data-parallel ranks (``fully_shard`` on the 1-D ``"data_parallel"`` mesh), each rank a
quarter of the batch, some rows padded: the global aux loss equals one process's ``outputs.aux_loss`` on the whole
batch, and the gradients of ``with_global_router_loss`` after FSDP's average equal the one-process gradients of
``cross_entropy + coef x aux_loss``. The model's own per-rank loss is checked to differ in both, so the case can fail.
Runs inside the shared 4-rank spawn (``context_and_expert_grids`` in test_expert_parallel.py): a case, not a spawn.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from harness import PG_TIMEOUT
from hf_tiny import TINY_SIZES
from modelpar._mesh.layout import MeshLayout
from modelpar._mesh.submeshes import token_mesh
from parity import error_text

COEF = 1.0  # large, so the aux loss moves the router gradients well above the tolerance
ROWS, SEQ = 8, 6
TOL = 1e-6  # absolute, on gradients of scale ~0.05 (measured: 1.5e-8)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[name] = g.detach().clone()
    return out


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], only: str = "") -> float:
    return max((got[k] - want[k]).abs().max().item() for k in want if only in k)


def case_hf_router_loss_is_the_global_batch_one() -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from modelpar.hf import router_aux_loss, with_global_router_loss

    config = Qwen3MoeConfig(
        **{**TINY_SIZES, "num_hidden_layers": 1},
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=12,
        router_aux_loss_coef=COEF,
        output_router_logits=True,
    )
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config)
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, config.vocab_size, (ROWS, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 4:], mask[2, 2:], mask[6, 5:] = 0, 0, 0  # padding on ranks 0, 1 and 3: uneven real-token counts

    want = ref(ids, attention_mask=mask, labels=ids)
    want.loss.backward()
    ref_grads = _grads(ref)

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("data_parallel",))  # the default group, if none yet
    world, rank = mesh.size(), mesh.get_local_rank()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    per = ROWS // world
    mine = slice(rank * per, (rank + 1) * per)

    counts: dict[str, int] = {}

    def step(global_loss: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor, Any]:
        model.zero_grad(set_to_none=True)
        out = model(ids[mine], attention_mask=mask[mine], labels=ids[mine])
        with CommDebugMode() as comm:
            aux = router_aux_loss(out.router_logits, model, device_mesh=mesh, attention_mask=mask[mine])
        counts.update({str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()})
        loss = (
            with_global_router_loss(out, model, device_mesh=mesh, attention_mask=mask[mine])
            if global_loss
            else out.loss
        )
        loss.backward()
        return _grads(model), aux.detach(), out

    other_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    per_rank_grads, _, local = step(global_loss=False)
    grads, global_aux, _ = step(global_loss=True)
    # The strategy's own meshes: HSDP ("data_parallel" a flattened axis, 4 token ranks), dp=2 x tp=2 (the TP peers
    # hold the same tokens: 2 token ranks), dp=2 x cp=2 (4 token ranks, over the flattened data x context axis). Each
    # token rank passes its share of the one-process router logits (any split of the tokens gives the same sums).
    layouts = {
        "hsdp_2x2": MeshLayout(data_parallel_size=4, tensor_parallel_size=1, data_parallel_replicate_size=2),
        "dp2_tp2": MeshLayout(data_parallel_size=2, tensor_parallel_size=2),
        "dp2_cp2": MeshLayout(data_parallel_size=2, tensor_parallel_size=1, context_parallel_size=2),
    }
    ref_logits = [layer.detach() for layer in want.router_logits]
    on_layouts = {}
    for name, layout in layouts.items():
        strategy_mesh = layout.build("cpu", "gloo", PG_TIMEOUT)
        tokens = token_mesh(strategy_mesh)
        n, r = tokens.size(), tokens.get_local_rank()
        rows = slice(r * ROWS // n * SEQ, (r + 1) * ROWS // n * SEQ)
        on_layouts[name] = router_aux_loss(
            [layer[rows] for layer in ref_logits],
            config,
            device_mesh=strategy_mesh,
            attention_mask=mask[r * ROWS // n : (r + 1) * ROWS // n],
        ).item()
    mean_local = local.aux_loss.detach().clone()
    dist.all_reduce(mean_local)
    return {
        "global_aux": global_aux.item(),
        "one_process_aux": want.aux_loss.item(),
        "mean_of_per_rank_aux": mean_local.item() / world,
        "grad_diff": _worst(grads, ref_grads),
        "router_grad_diff": _worst(grads, ref_grads, "mlp.gate"),
        "per_rank_router_grad_diff": _worst(per_rank_grads, ref_grads, "mlp.gate"),
        "collectives": counts,
        "strategy_meshes": on_layouts,
        "no_mesh": error_text(lambda: router_aux_loss(local.router_logits, model, device_mesh=None)),
        "other_mesh": error_text(lambda: router_aux_loss(local.router_logits, model, device_mesh=other_mesh)),
    }


# -- the tests, on the shared spawn's results ------------------------------------------------------------------
def test_the_global_router_loss_of_an_hf_moe_is_one_process_s_and_the_per_rank_one_is_not(context_parallel_spawn):
    for rank in context_parallel_spawn:
        got = rank["hf_router_loss"]
        assert abs(got["global_aux"] - got["one_process_aux"]) <= 1e-6, got
        # transformers' per-rank loss, averaged over the ranks, is not the one-process loss (a product of means)
        assert abs(got["mean_of_per_rank_aux"] - got["one_process_aux"]) > 1e-3, got
        assert got["collectives"] == {"allreduce_": 1}  # the 2E + 1 sums, once per forward
        for layout, value in got["strategy_meshes"].items():  # flattened axes; TP peers left out
            assert abs(value - got["one_process_aux"]) <= 1e-6, (layout, got)


def test_the_gradients_with_the_global_loss_are_one_process_s_and_with_the_per_rank_loss_are_not(
    context_parallel_spawn,
):
    for rank in context_parallel_spawn:
        got = rank["hf_router_loss"]
        assert got["grad_diff"] <= TOL, got  # every parameter
        assert got["router_grad_diff"] <= TOL, got
        assert got["per_rank_router_grad_diff"] > 1000 * TOL, got


def test_without_the_mesh_on_several_processes_it_refuses_on_every_rank(context_parallel_spawn):
    for rank in context_parallel_spawn:
        assert rank["hf_router_loss"]["no_mesh"].startswith(
            "ValueError: router_aux_loss(device_mesh=None) with 4 processes would give each rank the loss of its own"
        )
        assert rank["hf_router_loss"]["other_mesh"].startswith(
            "ValueError: The mesh has axes ['dp'], but router_aux_loss sums over its `data_parallel` axis"
        )
