"""Hugging Face families sharded by their own plan (``modelpar.hf.plan_for``), trained like one process.

One spawn of 4 CPU processes runs the grid: Llama, Qwen2 (biased projections), Qwen3 (per-head ``q_norm`` /
``k_norm``, replicated with summed gradients), Mistral, OLMo2, Phi-3 and GLM-4 (gathered projections before a
row-wise layer that splits its replicated input: ``rowwise_split_input``) and MiniCPM3 (MLA: ``mla_kv_a_proj``)
at 2 (data) x 2 (tensor), the MoE families Qwen3-MoE, Mixtral, GLM-4-MoE and GPT-OSS (fused experts from
per-expert or fused folders, saved back per expert) with FSDP alone, experts over the tensor-parallel ranks, expert
parallelism and HSDP, and on a 4-rank "expert_parallel" axis, Qwen3 with loss parallelism
and selective activation checkpointing under HSDP 2x1x2, and Llama with loss parallelism at 2x2. Each model is
built on the meta device from its config, set up with ``ModelParallelStrategy(plan_for(model))``, filled with
``load_pretrained`` from a tiny saved folder, and trained for a few AdamW steps next to ``from_pretrained``'s
model on one process with the whole batch: losses, gradients and weights must agree. The plan's refusals are
checked on one process.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

pytest.importorskip("transformers")
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    Glm4Config,
    Glm4MoeConfig,
    GptOssConfig,
    LlamaConfig,
    MiniCPM3Config,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

import modelpar.hf
from harness import run_distributed
from hf_tiny import TINY_SIZES
from modelpar.hf import plan_for
from modelpar.hf._files import file_keys
from modelpar.plans import loss_parallel
from parity import adamw, assert_matches, global_batches, lm_loss, local_slice, make_fabric

FAMILIES: dict[str, Any] = {
    "llama": lambda: LlamaConfig(**TINY_SIZES),
    "qwen2": lambda: Qwen2Config(**TINY_SIZES),
    "qwen3": lambda: Qwen3Config(head_dim=8, **TINY_SIZES),
    "mistral": lambda: MistralConfig(**TINY_SIZES),
    # Gathered attention projections and a row-wise o_proj / down_proj that splits its replicated input.
    "olmo2": lambda: Olmo2Config(**TINY_SIZES),
    "phi3": lambda: Phi3Config(**TINY_SIZES, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "glm4": lambda: Glm4Config(**TINY_SIZES, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Mixtures of experts: their plans' expert styles are refused under TP, so FSDP alone shards the fused experts.
    # Qwen3-MoE and Mixtral folders hold one tensor per expert (two layouts); GPT-OSS's hold them fused.
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **TINY_SIZES, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
    ),
    "mixtral": lambda: MixtralConfig(**TINY_SIZES, num_local_experts=4, num_experts_per_tok=2),
    # A dense first layer, then MoE layers with a shared expert (tensor-parallel like a dense MLP) and sigmoid
    # routing with a score-correction bias (DeepSeek-V3's router, one group).
    "glm4_moe": lambda: Glm4MoeConfig(
        **TINY_SIZES,
        head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        pad_token_id=0,
    ),
    "gpt_oss": lambda: tiny_gpt_oss(),
    # MLA: the rope part of kv_a_proj_with_mqa's output reaches every head, so its gradient is summed.
    "minicpm3": lambda: MiniCPM3Config(
        **TINY_SIZES, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, kv_lora_rank=16, q_lora_rank=16
    ),
}


def tiny_gpt_oss() -> Any:
    """GPT-OSS, whose Hugging Face tensor-parallel plan splits no decoder layer (only the LM head, and from 5.24 the embedding)."""
    rope = {
        "rope_type": "yarn",
        "factor": 1.0,
        "original_max_position_embeddings": TINY_SIZES["max_position_embeddings"],
    }
    return GptOssConfig(**TINY_SIZES, head_dim=8, num_local_experts=2, num_experts_per_tok=1, rope_parameters=rope)


#: Large enough that a per-rank load-balancing loss would fail the gradient comparison.
AUX_COEF = 0.5


def case(folder: Path, dp: int, tp: int, steps: int, **options: Any) -> dict[str, Any]:
    """Meta model -> plan_for -> strategy -> load_pretrained -> AdamW steps, against one process."""
    replicate = options.pop("data_parallel_replicate_size", 1)
    export = options.pop("export", None)
    ep = options.pop("expert_parallel_size", 1)
    reshard_to = options.pop("reshard_to", None)
    aux = options.pop("aux", False)
    fabric, model = sharded_model(folder, dp, tp, replicate, ep, options)
    modelpar.hf.load_pretrained(model, folder)
    out: dict[str, Any] = {"losses": [], "state_bytes": state_bytes(folder, model, dp, tp, replicate, ep, options)}
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    optimizer = fabric.setup_optimizers(adamw(model.parameters(), lr=1e-3, weight_decay=0.1))
    ref_opt = adamw(ref.parameters(), lr=1e-3, weight_decay=0.1)
    assert_matches(model, ref, "param")
    for x, y in global_batches(steps):
        outputs = model(local_slice(fabric, x), output_router_logits=True) if aux else model(local_slice(fabric, x))
        logits = outputs.logits
        out["logits"] = [str(p) for p in logits.placements] if isinstance(logits, DTensor) else "plain"
        with loss_parallel(logits):
            loss = lm_loss(logits, local_slice(fabric, y))
            if aux:  # the router's load-balancing loss over the global batch, as one process computes it
                mesh = fabric.strategy.device_mesh
                loss = loss + AUX_COEF * modelpar.hf.router_aux_loss(outputs.router_logits, model, device_mesh=mesh)
            fabric.backward(loss)
        ref_out = ref(x, output_router_logits=aux)
        ref_loss = lm_loss(ref_out.logits, y) + (AUX_COEF * ref_out.aux_loss if aux else 0)
        ref_loss.backward()
        local = loss.full_tensor() if isinstance(loss, DTensor) else loss
        global_loss = fabric.all_reduce(local.detach().clone())
        torch.testing.assert_close(global_loss, ref_loss.detach(), atol=1e-5, rtol=1e-5)
        assert_matches(model, ref, "grad")
        optimizer.step()
        ref_opt.step()
        optimizer.zero_grad()
        ref_opt.zero_grad()
        assert_matches(model, ref, "param")
        out["losses"].append(global_loss.item())
    q_norm = getattr(model.module.model.layers[0].self_attn, "q_norm", None)
    if q_norm is not None:
        out["q_norm"] = [str(p) for p in q_norm.weight.placements]
    out["mesh"] = tuple(fabric.strategy.device_mesh.shape)
    experts = getattr(model.module.model.layers[-1].mlp, "experts", None)
    if experts is not None:
        out["experts_local"] = list(local_tensor(experts.down_proj).shape)
        out["experts_comms"] = experts_collectives(model.module.model.layers[-1], model.module.config.hidden_size)
    if export is not None:
        out.update(export_and_reload(fabric, model, folder.parent / export))
    if reshard_to is not None:
        # The trained state saved at this layout loads at another (expert_parallel_size, tensor_parallel_size).
        checkpoint = folder.parent / f"ckpt_{folder.name}_{dp}x{tp}_ep{ep}"
        fabric.save(checkpoint, {"model": model})
        fabric, model = sharded_model(folder, *reshard_to, options)
        fabric.load(checkpoint, {"model": model})
        assert_matches(model, ref, "param")
        x, y = next(iter(global_batches(1)))
        loss = lm_loss(model(local_slice(fabric, x)).logits, local_slice(fabric, y))
        out["resharded_loss"] = (fabric.all_reduce(loss.detach()).item(), lm_loss(ref(x).logits, y).item())
        out["resharded_local"] = list(local_tensor(model.module.model.layers[-1].mlp.experts.down_proj).shape)
    return out


def experts_collectives(layer: Any, hidden_size: int) -> dict[str, dict[str, int]]:
    """The collectives of one MoE block's forward and backward (its layer unsharded first, so FSDP's are those of
    the experts' own unit under expert parallelism)."""
    layer.unshard()
    hidden = torch.randn(2, 8, hidden_size, requires_grad=True)
    counts = {}
    with CommDebugMode() as forward:
        out = layer.mlp(hidden)
    with CommDebugMode() as backward:
        (out[0] if isinstance(out, tuple) else out).square().sum().backward()
    for phase, mode in (("forward", forward), ("backward", backward)):
        counts[phase] = {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}
    layer.reshard()
    layer.zero_grad(set_to_none=True)
    return counts


def state_bytes(folder: Path, model: Any, dp: int, tp: int, replicate: int, ep: int, options: dict[str, Any]) -> Any:
    """(bytes this rank's parameter storages hold, what ``estimate_memory`` says of the same layout)."""
    storages = {}
    for p in model.parameters():
        storage = local_tensor(p).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    estimate = modelpar.estimate_memory(
        meta,
        plan=plan_for(meta, **options),
        data_parallel_size=dp,
        tensor_parallel_size=tp,
        data_parallel_replicate_size=replicate,
        expert_parallel_size=ep,
    )
    return sum(storages.values()), estimate.parameters


def local_tensor(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def sharded_model(folder: Path, dp: int, tp: int, replicate: int, ep: int, options: dict[str, Any]) -> Any:
    """A meta-device model of the folder's config, set up by ``plan_for``'s plan at this layout (not loaded)."""
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        plan = plan_for(AutoModelForCausalLM.from_config(config), **options)
    fabric = make_fabric(
        dp, tp, world_size=4, parallelize_fn=plan, data_parallel_replicate_size=replicate, expert_parallel_size=ep
    )
    with fabric.init_module(empty_init=True):
        model = AutoModelForCausalLM.from_config(config)
    return fabric, fabric.setup_module(model)


def export_and_reload(fabric: Any, model: Any, folder: Path) -> dict[str, Any]:
    """save_pretrained of the trained sharded model -> from_pretrained: the same weights and logits."""
    modelpar.hf.save_pretrained(model, folder)
    back = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    saved = back.state_dict()
    for name, param in model.module.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        assert torch.equal(full.detach(), saved[name]), name
    x, _ = next(iter(global_batches(1)))
    with torch.no_grad():
        torch.testing.assert_close(back(local_slice(fabric, x)).logits, model(local_slice(fabric, x)).logits)
    return {"export_names": sorted(file_keys(folder))}


def case_a_plan_sharding_no_layer_is_refused_on_every_rank(dp: int, tp: int) -> dict[str, Any]:
    """plan_for(GPT-OSS) at tensor_parallel_size=2: every rank raises before any collective; the group lives on."""
    with torch.device("meta"):
        plan = plan_for(AutoModelForCausalLM.from_config(tiny_gpt_oss()))
    fabric = make_fabric(dp, tp, world_size=4, parallelize_fn=plan)
    with fabric.init_module(empty_init=True):
        model = AutoModelForCausalLM.from_config(tiny_gpt_oss())
    try:
        fabric.setup_module(model)
    except ValueError as err:
        error = f"{type(err).__name__}: {err}"
    else:
        error = "no error"
    t = torch.ones(())
    dist.all_reduce(t)  # no rank is left inside a collective: the next one runs on all four
    return {"error": error, "sum": t.item()}


def case_experts_sharded_over_an_expert_parallel_axis_load_their_own_blocks(folder: Path) -> dict[str, Any]:
    """Fused experts as DTensors on a 4-rank "expert_parallel" axis (experts, or hidden columns, split) are
    filled from the per-expert folder like ``from_pretrained``'s."""
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("expert_parallel",))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    for layer in model.model.layers:
        experts = layer.mlp.experts
        experts.gate_up_proj = torch.nn.Parameter(
            distribute_tensor(torch.zeros_like(experts.gate_up_proj), mesh, [Shard(0)])
        )
        experts.down_proj = torch.nn.Parameter(distribute_tensor(torch.zeros_like(experts.down_proj), mesh, [Shard(1)]))
    modelpar.hf.load_pretrained(model, folder)
    want = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    for name, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        assert torch.equal(full, want[name]), name
    return {"local": list(model.model.layers[0].mlp.experts.gate_up_proj.to_local().shape)}


def grid(root: Path, only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every case (or the ``only`` ones, to run a few by hand) on this rank; results by case name."""
    cases = {
        "gpt_oss_refused_2x2": lambda: case_a_plan_sharding_no_layer_is_refused_on_every_rank(2, 2),
        "llama_2x2": lambda: case(root / "llama", 2, 2, steps=3),
        "qwen2_2x2": lambda: case(root / "qwen2", 2, 2, steps=2),
        "qwen3_2x2": lambda: case(root / "qwen3", 2, 2, steps=3),
        "mistral_2x2": lambda: case(root / "mistral", 2, 2, steps=2),
        "olmo2_2x2": lambda: case(root / "olmo2", 2, 2, steps=3),
        "phi3_2x2": lambda: case(root / "phi3", 2, 2, steps=3),
        "glm4_2x2": lambda: case(root / "glm4", 2, 2, steps=2),
        "minicpm3_2x2": lambda: case(root / "minicpm3", 2, 2, steps=3),
        "qwen3_moe_4x1": lambda: case(root / "qwen3_moe", 4, 1, steps=3, export="qwen3_moe_export"),
        "gpt_oss_4x1": lambda: case(root / "gpt_oss", 4, 1, steps=2),
        "qwen3_moe_hsdp_2x2x1": lambda: case(root / "qwen3_moe", 4, 1, steps=2, data_parallel_replicate_size=2),
        # Experts split whole: over the tensor-parallel axis ('moe_tp_experts'), over the expert axis, both.
        "qwen3_moe_2x2": lambda: case(root / "qwen3_moe", 2, 2, steps=3, reshard_to=(4, 1, 1, 4), aux=True),
        "mixtral_2x2": lambda: case(root / "mixtral", 2, 2, steps=2),
        "mixtral_ep4": lambda: case(root / "mixtral", 4, 1, steps=2, expert_parallel_size=4),
        "mixtral_hsdp_ep2_2x2x1": lambda: case(
            root / "mixtral", 4, 1, steps=2, data_parallel_replicate_size=2, expert_parallel_size=2
        ),
        "glm4_moe_2x2": lambda: case(root / "glm4_moe", 2, 2, steps=2),
        "glm4_moe_ep4": lambda: case(root / "glm4_moe", 4, 1, steps=2, expert_parallel_size=4),
        "glm4_moe_hsdp_ep2_2x2x1": lambda: case(
            root / "glm4_moe", 4, 1, steps=2, data_parallel_replicate_size=2, expert_parallel_size=2
        ),
        "qwen3_moe_ep2": lambda: case(
            root / "qwen3_moe",
            4,
            1,
            steps=3,
            expert_parallel_size=2,
            reshard_to=(4, 1, 1, 4),
            export="ep2_export",
            aux=True,
        ),
        "qwen3_moe_ep4": lambda: case(root / "qwen3_moe", 4, 1, steps=2, expert_parallel_size=4),
        "mixtral_ep2_tp2": lambda: case(root / "mixtral", 2, 2, steps=2, expert_parallel_size=2, aux=True),
        "gpt_oss_ep2": lambda: case(root / "gpt_oss", 4, 1, steps=2, expert_parallel_size=2),
        "qwen3_moe_hsdp_ep2_2x2x1": lambda: case(
            root / "qwen3_moe", 4, 1, steps=2, data_parallel_replicate_size=2, expert_parallel_size=2
        ),
        "qwen3_moe_expert_axis_4": lambda: case_experts_sharded_over_an_expert_parallel_axis_load_their_own_blocks(
            root / "qwen3_moe"
        ),
        "llama_loss_parallel_2x2": lambda: case(root / "llama", 2, 2, steps=2, loss_parallel=True),
        "qwen3_hsdp_loss_parallel_selective_ac_2x1x2": lambda: case(
            root / "qwen3",
            2,
            2,
            steps=2,
            data_parallel_replicate_size=2,
            loss_parallel=True,
            activation_checkpointing="selective",  # the layers' KV cache is dropped inside the recomputed region
        ),
    }
    results = {}
    for name, run in cases.items():
        if only and name not in only:
            continue
        start = time.perf_counter()
        results[name] = run()
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
    return results


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf_families")
    for name, make_config in FAMILIES.items():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(make_config()).save_pretrained(root / name)
    return root


@pytest.fixture(scope="module")
def results(folders: Path) -> list[dict[str, Any]]:
    return run_distributed(grid, 4, folders, timeout=240)


def test_llama_qwen2_qwen3_and_mistral_train_at_2x2_like_one_process_from_pretrained(results):
    print({name: out["seconds"] for name, out in results[0].items()})
    for r in results:
        for name in ("llama_2x2", "qwen2_2x2", "qwen3_2x2", "mistral_2x2"):
            assert r[name]["mesh"] == (2, 2), name
            assert r[name]["logits"] == "plain", name
            assert r[name]["losses"][-1] < r[name]["losses"][0], name


def test_olmo2_phi3_glm4_and_minicpm3_train_at_2x2_like_one_process_from_pretrained(results):
    # Before: plan_for refused 'rowwise_split_input' (OLMo2, Phi-3, GLM-4) and 'mla_kv_a_proj' (MiniCPM3).
    for r in results:
        for name in ("olmo2_2x2", "phi3_2x2", "glm4_2x2", "minicpm3_2x2"):
            assert r[name]["mesh"] == (2, 2), name
            assert r[name]["logits"] == "plain", name
            assert r[name]["losses"][-1] < r[name]["losses"][0], name


def test_mixture_of_experts_families_train_with_fsdp_alone_like_one_process_from_pretrained(results):
    # Before: plan_for refused Qwen3-MoE whatever the layout ('moe_tp_experts', 'packed_colwise').
    # Mixtral's folder has the other per-expert layout (block_sparse_moe.experts.{e}.w1/w2/w3); GPT-OSS's is fused.
    for r in results:
        for name in ("qwen3_moe_4x1", "gpt_oss_4x1", "qwen3_moe_hsdp_2x2x1"):
            assert r[name]["mesh"] == ((2, 2, 1) if "hsdp" in name else (4, 1)), name
            assert r[name]["losses"][-1] < r[name]["losses"][0], name


def test_moe_families_split_whole_experts_over_tensor_parallel_and_expert_axes_and_train_like_one_process(results):
    # Before: Qwen3-MoE and Mixtral were refused at 2x2 ('moe_tp_experts'), and expert parallelism refused them.
    # Losses, gradients and weights after the AdamW steps matched one process inside each case (assert_matches).
    meshes = {
        "qwen3_moe_2x2": (2, 2),  # experts over TP, FSDP over DP
        "mixtral_2x2": (2, 2),
        "qwen3_moe_ep2": (2, 2, 1),  # expert_data_parallel x expert_parallel x tensor_parallel
        "qwen3_moe_ep4": (1, 4, 1),
        "gpt_oss_ep2": (2, 2, 1),
        "mixtral_ep4": (1, 4, 1),
        "mixtral_hsdp_ep2_2x2x1": (2, 1, 2, 1),
        "glm4_moe_2x2": (2, 2),
        "glm4_moe_ep4": (1, 4, 1),
        "glm4_moe_hsdp_ep2_2x2x1": (2, 1, 2, 1),
        "mixtral_ep2_tp2": (1, 2, 2),  # experts whole on each expert rank, replicated over TP
        "qwen3_moe_hsdp_ep2_2x2x1": (2, 1, 2, 1),
    }
    local_experts = {"mixtral_ep2_tp2": 2, "qwen3_moe_hsdp_ep2_2x2x1": 2, "mixtral_hsdp_ep2_2x2x1": 2}
    local_experts["glm4_moe_hsdp_ep2_2x2x1"] = 2  # 4 experts / 2 expert ranks, no FSDP
    for r in results:
        for name, mesh in meshes.items():
            assert r[name]["mesh"] == mesh, name
            assert r[name]["experts_local"][0] == local_experts.get(name, 1), name
            assert r[name]["losses"][-1] < r[name]["losses"][0], name
        # Fewer experts than shard ranks: sharded evenly on a later dim, not in padded dim-0 chunks (before: GPT-OSS's
        # one local expert at EP=2 lay whole on one of its 2 FSDP ranks, [1, 64, 32] and [0, 64, 32]).
        assert r["gpt_oss_ep2"]["experts_local"] == [1, 32, 32]  # down_proj [E, I, H]: I over 2 ranks
        assert r["gpt_oss_4x1"]["experts_local"] == [2, 16, 32]  # 2 experts over 4 ranks


def test_tensor_parallel_experts_cost_one_all_reduce_forward_and_two_backward(results):
    for r in results:
        for name in ("qwen3_moe_2x2", "mixtral_2x2"):
            assert r[name]["experts_comms"] == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 2}}, name
        # GLM-4-MoE's block adds its shared expert, a dense MLP: one all-reduce forward (row-wise down_proj), two
        # backward (the gradients of the column-wise gate_proj's and up_proj's replicated input).
        assert r["glm4_moe_2x2"]["experts_comms"] == {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 4}}
        # Expert parallelism: counts, dispatch and combine all-to-alls forward; the two token ones backward.
        ep4 = r["qwen3_moe_ep4"]["experts_comms"]
        assert ep4["forward"] == {"alltoall_base_": 3} and ep4["backward"]["alltoall_base_"] == 2
        assert r["qwen3_moe_4x1"]["experts_comms"] == {"forward": {}, "backward": {}}  # FSDP alone: local experts


def test_moe_checkpoints_move_between_tensor_parallel_and_expert_parallel_layouts(results):
    # Trained at 2x2 (experts over TP) and at EP=2, each loaded at EP=4: the one-process weights and loss.
    for r in results:
        for name in ("qwen3_moe_2x2", "qwen3_moe_ep2"):
            got, want = r[name]["resharded_loss"]
            assert abs(got - want) < 1e-5, name
            assert r[name]["resharded_local"][0] == 1, name


def test_the_memory_estimate_equals_the_parameter_bytes_each_rank_holds_for_every_moe_layout(results):
    for r in results:
        for name, out in r.items():
            if "state_bytes" in out:
                held, estimated = out["state_bytes"]
                assert held == estimated, (name, held, estimated)


def test_a_mixture_of_experts_model_saved_sharded_is_written_per_expert_and_reloads_the_same(results, folders):
    # Before: load_pretrained refused the per-expert folder (CheckpointKeyError); save_pretrained wrote the
    # experts fused, unlike transformers. Weights (exactly) and logits were compared on every rank in the grid.
    written = set(results[0]["qwen3_moe_4x1"]["export_names"])
    assert written == set(file_keys(folders / "qwen3_moe"))
    assert set(results[0]["qwen3_moe_ep2"]["export_names"]) == written  # experts split over the expert axis
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in written


def test_fused_experts_sharded_over_an_expert_parallel_axis_load_from_a_per_expert_folder(results):
    # Before: CheckpointKeyError (the fused tensors missing, the per-expert ones unexpected).
    for r in results:
        assert r["qwen3_moe_expert_axis_4"]["local"] == [1, 32, 32]  # one expert per rank


def test_qwen3_per_head_norms_are_replicated_on_the_tensor_parallel_axis(results):
    # FSDP shards them on the data-parallel axis; their gradients matched one process in the grid.
    assert results[0]["qwen3_2x2"]["q_norm"] == [str(Shard(0)), str(Replicate())]
    assert results[0]["qwen3_hsdp_loss_parallel_selective_ac_2x1x2"]["q_norm"] == [
        str(Replicate()),
        str(Shard(0)),
        str(Replicate()),
    ]


def test_loss_parallel_keeps_hugging_face_logits_vocab_sharded_also_under_hsdp(results):
    assert results[0]["llama_loss_parallel_2x2"]["logits"] == [str(Shard(2))]
    hsdp = results[0]["qwen3_hsdp_loss_parallel_selective_ac_2x1x2"]
    assert hsdp["mesh"] == (2, 1, 2) and hsdp["logits"] == [str(Shard(2))]


def test_a_plan_for_gpt_oss_is_refused_with_tensor_parallelism_on_every_rank(results):
    for r in results:
        got = r["gpt_oss_refused_2x2"]
        assert got["sum"] == 4.0
        assert got["error"].startswith(
            "ValueError: tensor_parallel_size=2, but the plan for GptOssForCausalLM shards only 'lm_head'"
        ), got["error"]


def _meta_model(config: Any) -> Any:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_plan_for_maps_the_hugging_face_styles_and_names_the_decoder_layers_as_units():
    plan = plan_for(_meta_model(FAMILIES["qwen3"]()), activation_checkpointing="full", ac_every=2)
    styles = dict(plan.tensor_parallel)
    assert styles["model.layers.*.self_attn.q_proj"] == "colwise"
    assert styles["model.layers.*.mlp.down_proj"] == "rowwise"
    assert styles["lm_head"] == "output"
    assert type(styles["model.layers.*.self_attn.q_norm"]).__name__ == "SequenceParallel"
    assert plan.fsdp_units == ("model.layers.*",)
    assert (plan.activation_checkpointing, plan.ac_every) == ("full", 2)


def test_plan_for_keeps_a_tied_lm_head_replicated_and_refuses_loss_parallel_for_it():
    model = _meta_model(LlamaConfig(**{**TINY_SIZES, "tie_word_embeddings": True}))
    assert "lm_head" not in plan_for(model).tensor_parallel
    with pytest.raises(ValueError, match=r"loss_parallel=True.*shares its weight with the input embeddings"):
        plan_for(model, loss_parallel=True)


def test_plan_for_refuses_an_unknown_style_naming_it_the_pattern_and_the_supported_ones():
    config = FAMILIES["llama"]()
    config.base_model_tp_plan = {**config.base_model_tp_plan, "layers.*.mlp.up_proj": "fancy_colwise"}
    with pytest.raises(ValueError, match=r"'model\.layers\.\*\.mlp\.up_proj' to the style 'fancy_colwise'.*'colwise'"):
        plan_for(_meta_model(config))


def test_plan_for_refuses_sequence_parallel_a_model_without_a_plan_and_a_plain_module():
    with pytest.raises(NotImplementedError, match="sequence_parallel=True"):
        plan_for(_meta_model(FAMILIES["mistral"]()), sequence_parallel=True)
    config = FAMILIES["llama"]()
    config.base_model_tp_plan = {}
    with torch.device("meta"):
        base_model = AutoModel.from_config(config)  # no head, so no class plan either
    with pytest.raises(ValueError, match="LlamaModel has no tensor-parallel plan"):
        plan_for(base_model)
    with pytest.raises(TypeError, match="no `config`"):
        plan_for(torch.nn.Linear(2, 2))


def test_plan_for_head_counts_are_checked_before_anything_is_sharded():
    model = _meta_model(LlamaConfig(**{**TINY_SIZES, "num_key_value_heads": 1}))
    with pytest.raises(ValueError, match=r"does not divide config\.num_key_value_heads=1 \(heads\)"):
        plan_for(model).check(model, 2)


def test_plan_for_a_model_whose_hugging_face_plan_shards_no_decoder_layer_is_refused_with_tensor_parallelism():
    """GPT-OSS's Hugging Face plan splits no decoder layer (5.23: only ``lm_head``; 5.24 adds ``embed_tokens``):
    what holds is the behaviour, whatever the class plan lists outside the layers."""
    model = _meta_model(tiny_gpt_oss())
    plan = plan_for(model)
    assert plan.tensor_parallel.get("lm_head") == "output" and plan.fsdp_units == ("model.layers.*",)
    assert not [name for name in plan.tensor_parallel if name.startswith("model.layers.")]
    plan.check(model, 1)  # FSDP alone replicates nothing: fine
    with pytest.raises(ValueError) as err:
        plan.check(model, 2)
    covered = ", ".join(map(repr, sorted(plan.tensor_parallel)))
    message = str(err.value)
    assert message.startswith(
        f"tensor_parallel_size=2, but the plan for GptOssForCausalLM shards only {covered} across the"
        " tensor-parallel ranks and no decoder layer ('model.layers.*'): every layer would be replicated on each of"
        " the 2 ranks, so memory per rank grows with the tensor-parallel size instead of shrinking."
    ), message
    if not model.config.base_model_tp_plan:  # then the message shows where the plan came from
        assert (
            " The model's own Hugging Face tensor-parallel plan, which `modelpar.hf.plan_for` reads, covers no decoder"
            f" layer either (`config.base_model_tp_plan`: {{}}, `GptOssForCausalLM._tp_plan`:"
            f" {type(model)._tp_plan})." in message
        ), message
    assert message.endswith(
        " Use `tensor_parallel_size=1` (FSDP over all ranks), or write a `modelpar.plans.ParallelPlan` whose"
        " `tensor_parallel` splits the layers' projections (e.g. {'model.layers.*.self_attn.q_proj': 'colwise',"
        " 'model.layers.*.self_attn.o_proj': 'rowwise', ...})."
    ), message
    # A hand-written plan that splits the attention projections of the same model is accepted.
    plan.replace(tensor_parallel={**plan.tensor_parallel, "model.layers.*.self_attn.q_proj": "colwise"}).check(model, 2)
