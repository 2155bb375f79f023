"""Meta-device init on CPU meshes, checked shard by shard against the model one process builds.

Every rank's local shard must be its slice of the single-process model from the same seed, bit for bit, on
every layout: 2x2 (FSDP over TP: strided shards), 1x4 and 4x1 through Fabric, HSDP 2x2x1 and 2x1x2 built
with torch directly. Comparing gathered ``full_tensor()`` values would not do: they are equal on all ranks by
construction, whatever each rank holds. The expected slice is computed by chunk arithmetic (TP shards the
tensor first, FSDP the TP-local part), independent of the ``distribute_tensor`` the implementation uses.

Also: a root ``init_weights`` that initializes DTensors of other modules (in-place ``nn.init`` and random
``Tensor`` methods, outermost and nested); ranks seeded differently (rank 0's state is used, with a
warning); a set-up and trained model keeps its weights bit-exactly when a new meta submodule is
materialized; a tensor no initializer wrote (a parent's ``reset_parameters()`` forgets it) is named in one
warning on rank 0 only, and a root ``init_weights()`` that leaves a tensor alone does not overwrite what
``reset_parameters()`` wrote. The plan's logits must not be a view, and torch's "DTensor random operators"
warning must not appear. One spawn of 4 processes runs everything; one of 6 checks 3x2 and 2x3 with sizes that
do not divide, against what FSDP2 itself holds.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from harness import run_distributed
from modelpar._init.materialize import materialize_module
from modelpar.models import Llama
from modelpar.models.moe import GroupedExperts
from modelpar.plans import llama_tp_plan
from parity import CFG, assert_matches, global_batches, lm_loss, local_slice, make_fabric, reference_model

CPU = torch.device("cpu")
HSDP_AXES = ("data_parallel_replicate", "data_parallel_shard", "tensor_parallel")


class HookedLlama(Llama):
    """A root ``init_weights`` over other modules' (sharded) tensors, called last as in eager construction."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.init_weights()

    def init_weights(self) -> None:
        for layer in self.layers:
            nn.init.trunc_normal_(layer.attention.wq.weight, std=0.02)  # nested: its normal_ is seen
            nn.init.kaiming_uniform_(layer.attention.wo.weight, a=1.0)  # dispatched whole, outermost
            layer.feed_forward.w1.weight.data.normal_(0.0, 0.02)  # a Tensor method, through .data
            nn.init.xavier_uniform_(layer.feed_forward.w3.weight)
            nn.init.zeros_(layer.feed_forward.w2.weight)
        nn.init.normal_(self.tok_embeddings.weight, std=0.5)
        nn.init.uniform_(self.output.weight, -0.1, 0.1)


class Scale(nn.Module):
    """Owns a tensor and has no ``reset_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(8))


class Forgetful(nn.Module):
    """A parent ``reset_parameters`` that forgets a child's tensor; a root tensor ``init_weights`` leaves alone."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.empty(8))
        self.proj = nn.Linear(8, 8)
        self.covered = Scale()
        self.forgotten = Scale()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gain)
        nn.init.uniform_(self.covered.scale)

    def init_weights(self) -> None:
        nn.init.ones_(self.proj.bias)


def case_unwritten_tensors_on_fsdp_and_tp() -> dict[str, Any]:
    """2x2 FSDP + TP: rank 0 names the forgotten tensor; what was written equals the one-process build.

    ``gain`` is written by the root's ``reset_parameters()`` and not by its ``init_weights()`` (whose stand-in
    must not overwrite it); ``forgotten.scale`` by nobody: NaN in every rank's shard.
    """
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Forgetful()
    parallelize_module(model, mesh["tensor_parallel"], {"proj": ColwiseParallel()})
    fully_shard(model, mesh=mesh["data_parallel"])
    _, messages = recorded(lambda: materialize_module(model, CPU))
    torch.manual_seed(0)
    with torch.device("meta"):
        ref = Forgetful()
    materialize_module(ref, CPU)  # one process, plain tensors
    for name, p in model.named_parameters():
        local = p.to_local()
        if name == "forgotten.scale":
            assert torch.isnan(local).all(), local
        else:
            want = expected_local(ref.get_parameter(name), p)
            torch.testing.assert_close(local, want, atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    return {"messages": messages}


def expected_local(ref: torch.Tensor, p: DTensor) -> torch.Tensor:
    """This rank's slice of ``ref`` as the plans lay it out: the TP axis chunks first, then the data axes."""
    mesh = p.device_mesh
    names = list(mesh.mesh_dim_names or ())
    axes = list(range(mesh.ndim))
    if "tensor_parallel" in names:
        axes.remove(tp := names.index("tensor_parallel"))
        axes.insert(0, tp)
    coords = mesh.get_coordinate()
    assert coords is not None
    local = ref
    for axis in axes:
        dim = getattr(p.placements[axis], "dim", None)  # Shard and _StridedShard; Replicate has none
        if dim is not None:
            local = torch.chunk(local, mesh.size(axis), dim=dim)[coords[axis]]
    return local


def check_local_shards(model: nn.Module, ref: nn.Module) -> list[str]:
    """Compare every rank's local shard with its slice of ``ref``; return the placements seen."""
    model = getattr(model, "module", model)  # unwrap Fabric's _FabricModule
    ref_state = ref.state_dict()
    placements = set()
    for name, t in model.state_dict().items():
        want = ref_state[name]
        if isinstance(t, DTensor):
            placements.update(type(pl).__name__ for pl in t.placements)
            got, want = t.to_local(), expected_local(want, t)
        else:
            got = t
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    return sorted(placements)


def recorded(fn: Any) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in caught]


def case_fabric_layout(dp: int, tp: int, world_size: int = 4, replicate: int = 1) -> dict[str, Any]:
    """Meta init through Fabric equals the reference shard by shard; logits take in-place ops; grads match."""
    fabric = make_fabric(dp, tp, world_size=world_size, data_parallel_replicate_size=replicate)
    torch.manual_seed(0)  # the seed reference_model(0) uses, on every rank
    with fabric.init_module(empty_init=True):
        model = Llama(CFG)
    model, messages = recorded(lambda: fabric.setup_module(model))
    ref = reference_model(0)
    placements = check_local_shards(model, ref)
    x, y = global_batches(1)[0]
    logits = model(local_slice(fabric, x))
    assert logits._base is None, "the logits are a view"
    logits.mul_(2.0)  # raised "a view ... is being modified inplace" when the plan returned a view
    fabric.backward(lm_loss(logits, local_slice(fabric, y)))
    lm_loss(ref(x) * 2.0, y).backward()
    assert_matches(model, ref, "grad")
    if (dp, tp) == (2, 2):
        check_trained_weights_survive_a_new_meta_submodule(fabric, model, x)
    return {"messages": messages, "placements": placements}


def check_trained_weights_survive_a_new_meta_submodule(fabric: Any, model: Any, x: torch.Tensor) -> None:
    """A set-up model, trained one step, then given a meta submodule and materialized again, is unchanged."""
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer.step()
    optimizer.zero_grad()
    module = model.module
    before = {n: (p, p.to_local().clone()) for n, p in module.named_parameters()}
    with torch.no_grad():
        logits_before = model(local_slice(fabric, x))
    with torch.device("meta"):
        module.extra = nn.Linear(4, 4)
    # A meta buffer beside a trained sharded weight: the Linear's reset_parameters runs, its weight comes back.
    module.layers[0].attention.wq.register_buffer("mask", torch.empty(2, device="meta"))
    materialize_module(module, CPU)
    assert not module.extra.weight.is_meta and not module.layers[0].attention.wq.mask.is_meta
    for name, (p, value) in before.items():
        assert module.get_parameter(name) is p, name
        torch.testing.assert_close(p.to_local(), value, atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    with torch.no_grad():  # FSDP still gathers the same weights
        torch.testing.assert_close(model(local_slice(fabric, x)), logits_before, atol=0, rtol=0)


def case_hsdp_layout(shape: tuple[int, int, int], seed: int = 0, model_cls: type[Llama] = Llama) -> list[str]:
    """HSDP (replicate x shard) with optional TP, built with torch directly, against the reference."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=HSDP_AXES)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = model_cls(CFG)
    tp_mesh = mesh["tensor_parallel"]
    if tp_mesh.size() > 1:
        top = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        }
        parallelize_module(model, tp_mesh, top)
        for block in model.layers:
            parallelize_module(block, tp_mesh, llama_tp_plan())
    dp_mesh = mesh["data_parallel_replicate", "data_parallel_shard"]
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    materialize_module(model, CPU)
    torch.manual_seed(seed)
    return check_local_shards(model, model_cls(CFG))


def _hf_shard(model: nn.Module, device_mesh: Any) -> nn.Module:
    """FSDP over all four ranks: the HF model's own init (root ``init_weights``) then reaches other modules' DTensors."""
    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=device_mesh["data_parallel"])
    fully_shard(model, mesh=device_mesh["data_parallel"])
    return model


def case_hugging_face_init_weights() -> dict[str, Any]:
    """A Hugging Face model's ``init_weights`` (guarded ``nn.init`` wrappers) gives each rank its slice of one process."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    fabric = make_fabric(4, 1, world_size=4, parallelize_fn=_hf_shard)
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        model = AutoModelForCausalLM.from_config(config)
    model, messages = recorded(lambda: fabric.setup_module(model))
    torch.manual_seed(0)
    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(config)
    materialize_module(ref, CPU)  # one process, plain tensors: the same hooks in the same order
    check_local_shards(model, ref)
    std = float(ref.model.layers[0].self_attn.q_proj.weight.std())
    assert abs(std - config.initializer_range) < 0.005, f"HF's normal(0, 0.02) init did not run: std {std}"
    return {"messages": messages}


def case_ranks_seeded_differently(rank: int) -> dict[str, Any]:
    """Unseeded ranks still build one model: rank 0's, and each rank's own stream is left as it was."""
    fabric = make_fabric(2, 2, world_size=4)
    torch.manual_seed(rank)
    with fabric.init_module(empty_init=True):
        model = Llama(CFG)
    own_state = torch.get_rng_state()
    model, messages = recorded(lambda: fabric.setup_module(model))
    assert torch.equal(torch.get_rng_state(), own_state), "the rank's own random stream was changed"
    check_local_shards(model, reference_model(0))
    return {"messages": messages}


def grid() -> dict[str, Any]:
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for dp, tp in ((2, 2), (1, 4), (4, 1)):
        out[f"fabric {dp}x{tp}"] = case_fabric_layout(dp, tp)
    for dp, tp in ((4, 1), (2, 2)):  # through the strategy: HSDP 2x2x1 and 2x1x2
        out[f"fabric hsdp 2x{dp // 2}x{tp}"] = case_fabric_layout(dp, tp, replicate=2)
    for shape in ((2, 2, 1), (2, 1, 2)):
        out["hsdp " + "x".join(map(str, shape))] = {"placements": case_hsdp_layout(shape)}
    out["root init_weights 2x1x2"] = {"placements": case_hsdp_layout((2, 1, 2), model_cls=HookedLlama)}
    out["seeded differently"] = case_ranks_seeded_differently(dist.get_rank())
    out["hugging face"] = case_hugging_face_init_weights()
    out["unwritten"] = case_unwritten_tensors_on_fsdp_and_tp()
    return out


def test_meta_init_gives_every_rank_its_slice_of_the_single_process_model_on_every_layout() -> None:
    results: list[dict[str, Any]] = run_distributed(grid, 4)
    for rank, rank_result in enumerate(results):
        for case, result in rank_result.items():
            noisy = [
                m
                for m in result.get("messages", [])
                if "DTensor random operators" in m or "returned a view tensor" in m
            ]
            assert not noisy, f"rank {rank}, {case}: {noisy}"
        # FSDP over TP shards a TP-sharded dim again: the strided placement is covered.
        assert "_StridedShard" in rank_result["fabric 2x2"]["placements"]
        assert "_StridedShard" in rank_result["hsdp 2x1x2"]["placements"]
        assert "Replicate" in rank_result["hsdp 2x2x1"]["placements"]
    unwritten = [[m for m in r["unwritten"]["messages"] if "initialization incomplete" in m] for r in results]
    assert len(unwritten[0]) == 1 and not any(unwritten[1:]), unwritten  # one warning, on rank 0
    assert "`forgotten.scale` (Scale)" in unwritten[0][0] and "covered" not in unwritten[0][0], unwritten[0]
    assert "gain" not in unwritten[0][0] and "proj" not in unwritten[0][0], unwritten[0]
    rank0 = results[0]["seeded differently"]["messages"]
    assert any("ranks had different random states" in m and "rank 0's state was used" in m for m in rank0), rank0
    agreed = [m for case, r in results[0].items() if case != "seeded differently" for m in r.get("messages", [])]
    assert not [m for m in agreed if "different random states" in m]
    # every tensor of the other models was written by some initializer: no false alarm
    assert not [
        m for case, r in results[0].items() if case != "unwritten" for m in r.get("messages", []) if "incomplete" in m
    ]


class Uneven(nn.Module):
    """Dims 7, 9, 13 (none divides by 2 or 3), so FSDP over TP leaves pieces of different sizes.

    Also fused experts, drawn a few experts at a time (``modelpar._init.expert_blocks``): 7 experts of 48 elements
    (one a block), FSDP on the expert dim and TP on the other, and 40 of 15 elements (blocks of 16 and 24 experts)
    under a root ``init_weights`` that draws them with ``normal_`` (Box-Muller 16 at a time) and ``trunc_normal_``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(9, 7)  # column-parallel: (7, 9) cut on dim 0 by TP, then by FSDP
        self.mid = nn.Linear(7, 13)  # column-parallel: (13, 7)
        self.down = nn.Linear(13, 9)  # row-parallel: (9, 13) on dim 1 by TP, on dim 0 by FSDP
        self.experts = GroupedExperts(8, 6, 7)  # w1, w3 [7, 6, 8] and w2 [7, 8, 6]
        self.fused = nn.Parameter(torch.empty(40, 3, 5))
        self.fused_truncated = nn.Parameter(torch.empty(40, 3, 5))
        self.init_weights()

    def init_weights(self) -> None:
        nn.init.normal_(self.fused, std=0.02)
        nn.init.trunc_normal_(self.fused_truncated, std=0.02)


def _experts_on_tp(name: str, module: nn.Module, mesh: Any) -> None:
    """TP on the experts' non-expert dims: w1 and w3 on their rows, w2 on its columns."""
    if isinstance(module, GroupedExperts):
        for weight, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
            sharded = distribute_tensor(getattr(module, weight).data, mesh, [Shard(dim)])
            module.register_parameter(weight, nn.Parameter(sharded))


def shard_uneven(model: nn.Module, mesh: Any) -> nn.Module:
    plan = {"up": ColwiseParallel(), "mid": ColwiseParallel(), "down": RowwiseParallel()}
    parallelize_module(model, mesh["tensor_parallel"], plan)
    distribute_module(model.experts, mesh["tensor_parallel"], _experts_on_tp)
    fully_shard(model.experts, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def uneven_grid() -> dict[str, Any]:
    """3x2 and 2x3: each rank's shard is what FSDP2 holds of the eager model, and ``full_tensor()`` is that model."""
    out: dict[str, Any] = {}
    for dp, tp in ((3, 2), (2, 3)):
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
        torch.manual_seed(0)
        held = shard_uneven(Uneven(), mesh)  # FSDP2 shards the eager model's values itself: the truth per rank
        torch.manual_seed(0)
        eager = Uneven()
        torch.manual_seed(0)
        with torch.device("meta"):
            model = shard_uneven(Uneven(), mesh)
        materialize_module(model, CPU)
        held_state = held.state_dict()
        placements = set()
        for name, p in model.state_dict().items():
            placements.update(type(pl).__name__ for pl in p.placements)
            want, where = held_state[name].to_local(), f"{dp}x{tp} {name} {p.placements}"
            assert p.to_local().shape == want.shape, f"{where}: {tuple(p.to_local().shape)}, FSDP2 holds {want.shape}"
            torch.testing.assert_close(p.to_local(), want, atol=0, rtol=0, msg=lambda m, w=where: f"{w}: {m}")
            full = p.full_tensor()
            torch.testing.assert_close(
                full, eager.state_dict()[name], atol=0, rtol=0, msg=lambda m, w=where: f"{w}: {m}"
            )
        out[f"{dp}x{tp}"] = sorted(placements)
    return out


def test_meta_init_on_uneven_3x2_and_2x3_gives_every_rank_the_block_fsdp2_holds() -> None:
    """Where ``distribute_tensor`` reads FSDP over TP differently from FSDP2 (sizes that do not divide)."""
    results: list[dict[str, Any]] = run_distributed(uneven_grid, 6)
    assert "_StridedShard" in results[0]["3x2"]
