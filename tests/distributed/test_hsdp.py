"""HSDP (replicate x shard x tensor parallel) and the FSDP2 options of the Fabric strategy, against one process.

One spawn of 4 processes laid out as two simulated nodes of two, so ``data_parallel_replicate_size="auto"``
has nodes to replicate across. Each case runs in every rank and raises on a mismatch.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.debug import CommDebugMode

from harness import PG_TIMEOUT, run_distributed
from modelpar.plans import parallelize_llama
from parity import (
    CFG,
    assert_matches,
    global_batches,
    lightning_style_fsdp,
    lm_loss,
    local_slice,
    make_fabric,
    reference_model,
    setup_pair,
)

STEPS = 3
HSDP_AXES = ("data_parallel_replicate", "data_parallel_shard", "tensor_parallel")


def _error(fn: Any) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    raise AssertionError("no ValueError raised")


# ---------------------------------------------------------------------------------------------------
# cases (run inside every rank)
# ---------------------------------------------------------------------------------------------------
def case_hsdp_training_matches_reference(dp: int, tp: int, replicate: Any) -> dict[str, Any]:
    """Losses, gradients, weights after AdamW steps and clipping equal one process; HSDP really shards and replicates."""
    fabric = make_fabric(dp, tp, world_size=4, num_nodes=2, data_parallel_replicate_size=replicate)
    mesh = fabric.strategy.device_mesh
    model, optimizer, ref, ref_opt = setup_pair(fabric)
    wq = model.layers[0].attention.wq.weight
    assert isinstance(wq, DTensor) and wq.placements[0] == Replicate(), wq.placements  # replicated across replicas
    for step, (x, y) in enumerate(global_batches(STEPS)):
        loss = lm_loss(model(local_slice(fabric, x)), local_slice(fabric, y))
        fabric.backward(loss)
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        torch.testing.assert_close(fabric.all_reduce(loss.detach().clone()), ref_loss.detach(), atol=1e-5, rtol=1e-5)
        assert_matches(model, ref, "grad")
        if step == STEPS - 1:  # mesh-aware clipping on the 3-D mesh
            got = fabric.clip_gradients(model, optimizer, max_norm=0.05)
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            assert got is not None and float(want) > 0.05
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        optimizer.step()
        ref_opt.step()
        optimizer.zero_grad()
        ref_opt.zero_grad()
        assert_matches(model, ref, "param")
    # all_reduce by axis name, including the flattened data-parallel axis
    one = torch.ones(1)
    sizes = {
        axis: int(fabric.all_reduce(one.clone(), group=axis, reduce_op="sum")) for axis in (*HSDP_AXES, "data_parallel")
    }
    return {
        "shape": tuple(mesh.shape),
        "axes": mesh.mesh_dim_names,
        "sampler": fabric.strategy.distributed_sampler_kwargs,
        "sizes": sizes,
    }


def _fsdp_groups(model: nn.Module) -> list[Any]:
    # No public API says what FSDP2 keeps between micro-batches; the test reads its param groups directly.
    return [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]


def _kept_gradient_numel(model: nn.Module) -> int:
    """Gradient elements this rank holds between micro-batches: sharded grads, partial HSDP sums, unsharded grads."""
    total = sum(p.grad.to_local().numel() for p in model.parameters() if p.grad is not None)
    for group in _fsdp_groups(model):
        if group is None:
            continue
        if group._partial_reduce_output is not None:
            total += group._partial_reduce_output.numel()
        for fp in group.fsdp_params:
            if fp.unsharded_accumulated_grad is not None:
                total += fp.unsharded_accumulated_grad.numel()
            elif fp._unsharded_param.grad is not None if hasattr(fp, "_unsharded_param") else False:
                total += fp._unsharded_param.grad.numel()
    return total


def case_accumulation_modes(dp: int, tp: int, replicate: int, mode: str) -> dict[str, Any]:
    """Both modes match the reference; which collectives run on a non-final micro-batch, and what stays in memory."""
    fabric = make_fabric(
        dp, tp, world_size=4, num_nodes=2, data_parallel_replicate_size=replicate, gradient_accumulation=mode
    )
    model, _opt, ref, _ = setup_pair(fabric)
    batches = global_batches(3)
    comms = []
    with fabric.no_backward_sync(model, enabled=True):
        for x, y in batches[:2]:
            loss = lm_loss(model(local_slice(fabric, x)), local_slice(fabric, y))
            with CommDebugMode() as counter:  # backward only: the gradient reductions
                fabric.backward(loss)
            comms.append({str(k): v for k, v in counter.get_comm_counts().items()})
        kept = _kept_gradient_numel(model)
    x, y = batches[2]
    loss = lm_loss(model(local_slice(fabric, x)), local_slice(fabric, y))
    with CommDebugMode() as counter:
        fabric.backward(loss)
    final = {str(k): v for k, v in counter.get_comm_counts().items()}
    for x, y in batches:
        lm_loss(ref(x), y).backward()
    assert_matches(model, ref, "grad")
    model_numel = sum(p.numel() for p in ref.parameters())
    return {"comms": comms, "final": final, "kept": kept, "model_numel": model_numel}


def _capture_forward_state(model: nn.Module) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def hook(module: nn.Module, args: Any) -> None:
        seen["param_dtype"] = module.weight.dtype
        seen["autocast"] = torch.is_autocast_enabled("cpu")

    model.layers[0].attention.wq.register_forward_pre_hook(hook)  # type: ignore[union-attr, index]
    return seen


def case_policies_observed() -> dict[str, Any]:
    """Each FSDP2 option, as the module shows it: param dtype and autocast in forward, grad dtype, offload, resharding."""
    out: dict[str, Any] = {}
    x, y = global_batches(1)[0]
    for name, precision, kwargs, fn in (
        ("bf16_policy", "bf16-mixed", {}, None),
        ("bf16_autocast", "bf16-mixed", {"mixed_precision": MixedPrecisionPolicy()}, None),
        ("bf16_lightning_fn", "bf16-mixed", {}, lightning_style_fsdp),
        ("offload_no_reshard", "32-true", {"cpu_offload": True, "reshard_after_forward": False}, None),
    ):
        extra = {"parallelize_fn": fn} if fn is not None else {}
        fabric = make_fabric(4, 1, world_size=4, num_nodes=2, precision=precision, **kwargs, **extra)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = fabric.setup_module(reference_model())
        seen = _capture_forward_state(model)
        logits = model(local_slice(fabric, x))
        wq = model.module.layers[0].attention.wq.weight
        after_forward = tuple(wq.shape) if not isinstance(wq, DTensor) else tuple(wq.to_local().shape)
        fabric.backward(lm_loss(logits, local_slice(fabric, y)))
        group = _fsdp_groups(model.module.layers[0])[0]
        out[name] = {
            "param_dtype": str(seen["param_dtype"]),
            "autocast": seen["autocast"],
            "grad_dtype": str(model.module.layers[0].attention.wq.weight.grad.dtype),
            "offload": bool(group.fsdp_params[0].offload_to_cpu),
            "local_shape_after_forward": after_forward,
            "warned_autocast": any("runs as autocast" in str(w.message) for w in caught),
        }
    return out


def case_cpu_offload_trains_like_one_process() -> float:
    """With ``cpu_offload=True`` on HSDP, two AdamW steps still equal the single-process run (gloo, CPU)."""
    fabric = make_fabric(4, 1, world_size=4, num_nodes=2, data_parallel_replicate_size=2, cpu_offload=True)
    model, optimizer, ref, ref_opt = setup_pair(fabric)
    for x, y in global_batches(2):
        fabric.backward(lm_loss(model(local_slice(fabric, x)), local_slice(fabric, y)))
        lm_loss(ref(x), y).backward()
        optimizer.step()
        ref_opt.step()
        optimizer.zero_grad()
        ref_opt.zero_grad()
    assert bool(_fsdp_groups(model.module.layers[0])[0].fsdp_params[0].offload_to_cpu)
    return assert_matches(model, ref, "param")


class _LlamaAndPlainHead(nn.Module):
    """The tiny Llama (sharded) beside a layer and a buffer that no FSDP unit manages."""

    def __init__(self) -> None:
        super().__init__()
        self.llama = reference_model()
        self.head = nn.Linear(CFG.vocab_size, 2)
        self.register_buffer("scale", torch.ones(2))

    def reset_parameters(self) -> None:
        self.scale.fill_(1.0)


def _shard_llama_only(model: nn.Module, device_mesh: Any) -> nn.Module:
    parallelize_llama(model.llama, device_mesh)  # type: ignore[arg-type]
    return model


def case_offload_places_each_tensor_where_it_belongs() -> dict[str, Any]:
    """Meta init under ``cpu_offload``, set up for a root device that is not the CPU ("meta" stands in for cuda:N).

    FSDP2 refuses offloaded shards on any device but the CPU, and forward needs everything else on the compute
    device: the shards must be materialized (with the reference's values) and stay on the CPU, the buffers and
    the layer outside FSDP must end on the root device, and ``module_to_device`` (the Trainer's
    ``model_to_device``) must move leftovers there but never the shards.
    """
    root = torch.device("meta")
    ref = _LlamaAndPlainHead()
    fabric = make_fabric(4, 1, world_size=4, num_nodes=2, parallelize_fn=_shard_llama_only, cpu_offload=True)
    with torch.device("meta"):
        model = _LlamaAndPlainHead()
    core = fabric.strategy._core
    model = core.setup_module(model, root)
    shards = [p for p in model.llama.parameters() if isinstance(p, DTensor)]
    assert shards and bool(_fsdp_groups(model.llama.layers[0])[0].fsdp_params[0].offload_to_cpu)
    out = {
        "shards": sorted({str(p.device) for p in shards}),
        "buffers": sorted({str(b.device) for b in model.buffers()}),
        "head": str(model.head.weight.device),
    }
    for (name, p), want in zip(model.llama.named_parameters(), ref.llama.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), want, atol=0, rtol=0, msg=name)
    model.head.to_empty(device="cpu")  # a leftover on the CPU, as the Trainer may find it
    core.module_to_device(model, root)
    out["after_to_device"] = [*sorted({str(p.device) for p in shards}), str(model.head.weight.device)]
    # and on a CPU root (nothing to move), meta init under cpu_offload gives the model one process builds
    fabric = make_fabric(4, 1, world_size=4, num_nodes=2, cpu_offload=True)
    with fabric.init_module(empty_init=True):
        meta_model = reference_model()
    meta_model = fabric.setup_module(meta_model)
    assert_matches(meta_model, reference_model(), "param", atol=0, rtol=0)
    return out


def case_misuse_fails_on_every_rank() -> dict[str, str]:
    """Plain FSDP where HSDP was asked, and explicit options a parallelize_fn ignores, raise the fix."""
    out = {}
    fabric = make_fabric(
        4, 1, world_size=4, num_nodes=2, data_parallel_replicate_size=2, parallelize_fn=lightning_style_fsdp
    )
    out["flattened"] = _error(lambda: fabric.setup_module(reference_model()))
    fabric = make_fabric(4, 1, world_size=4, num_nodes=2, parallelize_fn=lightning_style_fsdp, cpu_offload=True)
    out["ignored"] = _error(lambda: fabric.setup_module(reference_model()))
    return out


def case_every_group_gets_the_timeout() -> dict[str, float]:
    fabric = make_fabric(4, 1, world_size=4, num_nodes=2, data_parallel_replicate_size=2)
    mesh = fabric.strategy.device_mesh
    cpu = torch.device("cpu")
    groups = {axis: mesh[axis].get_group() for axis in (*HSDP_AXES, "data_parallel")}
    groups["default"] = dist.group.WORLD
    groups["async_save"] = fabric.strategy._core.checkpointer._group()
    # The timeout a group was created with is only readable from its backend's options.
    return {name: g._get_backend(cpu).options._timeout.total_seconds() for name, g in groups.items()}


def grid() -> dict[str, Any]:
    return {
        "train_2x2x1": case_hsdp_training_matches_reference(4, 1, 2),
        "train_2x1x2": case_hsdp_training_matches_reference(2, 2, 2),
        "train_auto": case_hsdp_training_matches_reference(4, 1, "auto"),
        **{
            f"accumulate_{mode}_{dp}x{tp}_r{r}": case_accumulation_modes(dp, tp, r, mode)
            for mode in ("sharded", "unsharded")
            for dp, tp, r in ((4, 1, 2), (4, 1, 1))
        },
        "policies": case_policies_observed(),
        "offload": case_cpu_offload_trains_like_one_process(),
        "offload_placement": case_offload_places_each_tensor_where_it_belongs(),
        "misuse": case_misuse_fails_on_every_rank(),
        "timeouts": case_every_group_gets_the_timeout(),
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(grid, 4, nodes=2, timeout=300)


def test_hsdp_meshes_train_like_one_process(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        assert r["train_2x2x1"]["shape"] == (2, 2, 1) and r["train_2x2x1"]["axes"] == HSDP_AXES
        assert r["train_2x1x2"]["shape"] == (2, 1, 2)
        assert r["train_auto"]["shape"] == (2, 2, 1)  # two nodes, no TP: a replica per node, sharded within it
        assert r["train_2x2x1"]["sampler"] == {"num_replicas": 4, "rank": rank}  # the combined data-parallel rank
        assert r["train_2x1x2"]["sampler"] == {"num_replicas": 2, "rank": rank // 2}
        assert r["train_2x2x1"]["sizes"] == {
            "data_parallel_replicate": 2,
            "data_parallel_shard": 2,
            "tensor_parallel": 1,
            "data_parallel": 4,
        }


def test_accumulation_modes_run_the_collectives_they_promise(results: list[dict[str, Any]]) -> None:
    r = results[0]
    hsdp_sharded, hsdp_unsharded = r["accumulate_sharded_4x1_r2"], r["accumulate_unsharded_4x1_r2"]
    fsdp_sharded, fsdp_unsharded = r["accumulate_sharded_4x1_r1"], r["accumulate_unsharded_4x1_r1"]
    for micro in hsdp_sharded["comms"]:  # reduce-scatter within the replica; the all-reduce across replicas waits
        assert micro.get("c10d._reduce_scatter_base_", 0) + micro.get("c10d.reduce_scatter_", 0) > 0, micro
        assert micro.get("c10d.allreduce_", 0) == 0, micro
    assert hsdp_sharded["final"].get("c10d.allreduce_", 0) > 0
    for micro in fsdp_sharded["comms"]:
        assert any("reduce_scatter" in k for k in micro), micro
    for result in (hsdp_unsharded, fsdp_unsharded):  # nothing reduced until the last micro-batch
        for micro in result["comms"]:
            assert not any("reduce" in k for k in micro), micro
        assert any("reduce_scatter" in k for k in result["final"])
    numel = fsdp_sharded["model_numel"]
    assert fsdp_sharded["kept"] <= numel / 4 * 1.1  # a quarter: this rank's shard
    assert hsdp_sharded["kept"] <= numel / 2 * 1.1  # a half: the shard within a replica of two
    assert fsdp_unsharded["kept"] >= numel * 0.99 and hsdp_unsharded["kept"] >= numel * 0.99  # everything, unsharded


def test_fsdp_policies_are_applied_and_autocast_does_not_fight_them(results: list[dict[str, Any]]) -> None:
    p = results[0]["policies"]
    assert p["bf16_policy"] | {"local_shape_after_forward": None} == {
        "param_dtype": "torch.bfloat16",
        "autocast": False,
        "grad_dtype": "torch.float32",
        "offload": False,
        "local_shape_after_forward": None,
        "warned_autocast": False,
    }
    assert p["bf16_autocast"]["param_dtype"] == "torch.float32" and p["bf16_autocast"]["autocast"] is True
    assert p["bf16_lightning_fn"]["autocast"] is True and p["bf16_lightning_fn"]["warned_autocast"] is True
    assert p["offload_no_reshard"]["offload"] is True
    assert p["offload_no_reshard"]["local_shape_after_forward"] == (CFG.dim, CFG.dim)  # kept gathered for backward
    assert p["bf16_policy"]["local_shape_after_forward"] == (CFG.dim // 4, CFG.dim)  # resharded after forward


def test_cpu_offload_keeps_shards_on_the_cpu_and_the_rest_on_the_root_device(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["offload_placement"] == {
            "shards": ["cpu"],
            "buffers": ["meta"],
            "head": "meta",
            "after_to_device": ["cpu", "meta"],
        }


def test_misuse_raises_the_fix_on_every_rank(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert "HSDP was asked for (`data_parallel_replicate_size=2`)" in r["misuse"]["flattened"]
        assert "modelpar.fsdp_kwargs(device_mesh)" in r["misuse"]["flattened"]
        assert "`cpu_offload`" in r["misuse"]["ignored"] and "would be ignored" in r["misuse"]["ignored"]


def test_every_group_the_strategy_creates_gets_its_timeout(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert set(r["timeouts"].values()) == {PG_TIMEOUT.total_seconds()}, r["timeouts"]
