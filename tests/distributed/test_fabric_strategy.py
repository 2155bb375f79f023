"""The Fabric strategy on real gloo process groups, checked against a single-process reference.

Two spawns: 2 processes (meshes 2x1 and 1x2), in each Lightning namespace (``lightning_fabric`` and
``lightning.fabric``), and 4 processes laid out as two simulated nodes of two (meshes "auto" -> 2x2, 4x1, 1x4), in
one (:data:`FOUR_NAMESPACE`). Each spawn runs a grid of cases; each case raises on a mismatch, so the harness
reports the failing rank's traceback.
"""

from __future__ import annotations

import importlib
import threading
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from harness import PG_TIMEOUT, run_distributed
from modelpar import ModelParallelStrategy
from modelpar._mesh.groups import group_timeout
from modelpar.models import Llama
from modelpar.plans import parallelize_llama
from parity import (
    CFG,
    FABRIC_NAMESPACES,
    adamw,
    assert_matches,
    global_batches,
    lm_loss,
    local_slice,
    make_fabric,
    reference_model,
    setup_pair,
    use_fabric_namespace,
)

STEPS = 3


# ---------------------------------------------------------------------------------------------------
# cases (run inside every rank)
# ---------------------------------------------------------------------------------------------------
def case_training_matches_reference(dp: Any, tp: Any, world_size: int, num_nodes: int = 1) -> dict[str, Any]:
    """Losses, gradients and weights after several AdamW steps equal the single-process run."""
    fabric = make_fabric(dp, tp, world_size=world_size, num_nodes=num_nodes)
    mesh = fabric.strategy.device_mesh
    model, optimizer, ref, ref_opt = setup_pair(fabric)
    losses, local_losses, grad_diff, weight_diff = [], [], 0.0, 0.0
    for x, y in global_batches(STEPS):
        loss = lm_loss(model(local_slice(fabric, x)), local_slice(fabric, y))
        fabric.backward(loss)
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        global_loss = fabric.all_reduce(loss.detach().clone(), reduce_op="mean")
        torch.testing.assert_close(global_loss, ref_loss.detach(), atol=1e-5, rtol=1e-5)
        grad_diff = max(grad_diff, assert_matches(model, ref, "grad"))
        optimizer.step()
        ref_opt.step()
        optimizer.zero_grad()
        ref_opt.zero_grad()
        weight_diff = max(weight_diff, assert_matches(model, ref, "param"))
        losses.append(global_loss.item())  # the parallel model's, not the reference's: each rank has its own
        local_losses.append(loss.item())
    return {
        "mesh": tuple(mesh.shape),
        "axes": mesh.mesh_dim_names,
        "losses": losses,
        "local_losses": local_losses,
        "grad_diff": grad_diff,
        "weight_diff": weight_diff,
        "sampler": fabric.strategy.distributed_sampler_kwargs,
    }


def case_clipping_matches_reference(dp: int, tp: int, world_size: int, num_nodes: int = 1) -> dict[str, float]:
    """`fabric.clip_gradients` by norm (2 and inf) and by value equals clipping the reference model."""
    out = {}
    for mode in ("norm2", "norminf", "value"):
        fabric = make_fabric(dp, tp, world_size=world_size, num_nodes=num_nodes)
        model, _optimizer, ref, _ = setup_pair(fabric)
        x, y = global_batches(1)[0]
        fabric.backward(lm_loss(model(local_slice(fabric, x)), local_slice(fabric, y)))
        lm_loss(ref(x), y).backward()
        if mode == "value":
            fabric.clip_gradients(model, _optimizer, clip_val=0.01)
            torch.nn.utils.clip_grad_value_(ref.parameters(), 0.01)
        else:
            norm_type = 2.0 if mode == "norm2" else float("inf")
            got = fabric.clip_gradients(model, _optimizer, max_norm=0.05, norm_type=norm_type)
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=norm_type)
            assert got is not None and float(want) > 0.05, "the test must actually clip"
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            out[mode] = float(got)
        assert_matches(model, ref, "grad")
    return out


def case_no_backward_sync_accumulates_and_restores(dp: int, tp: int, world_size: int, num_nodes: int = 1) -> bool:
    """Accumulation under `no_backward_sync` matches the reference, and sync is on again afterwards."""
    fabric = make_fabric(dp, tp, world_size=world_size, num_nodes=num_nodes)
    model, _opt, ref, _ = setup_pair(fabric)
    (x1, y1), (x2, y2), (x3, y3) = global_batches(3)
    # enabled=False must change nothing (Lightning 2.6.6 leaves sync off after it).
    with fabric.no_backward_sync(model, enabled=False):
        pass
    with fabric.no_backward_sync(model, enabled=True):
        with fabric.no_backward_sync(model, enabled=True):  # nested: inner exit must not re-enable sync
            fabric.backward(lm_loss(model(local_slice(fabric, x1)), local_slice(fabric, y1)))
        fabric.backward(lm_loss(model(local_slice(fabric, x2)), local_slice(fabric, y2)))
    fabric.backward(lm_loss(model(local_slice(fabric, x3)), local_slice(fabric, y3)))
    for x, y in ((x1, y1), (x2, y2), (x3, y3)):
        lm_loss(ref(x), y).backward()
    assert_matches(model, ref, "grad")
    return True


def case_meta_init_materializes_consistently(dp: int, tp: int, world_size: int, num_nodes: int = 1) -> dict[str, Any]:
    """`fabric.init_module(empty_init=True)` + setup: nothing on meta, each rank's slice of the one-process model."""
    fabric = make_fabric(dp, tp, world_size=world_size, num_nodes=num_nodes)
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        model = Llama(CFG)
    assert all(p.is_meta for p in model.parameters())
    model = fabric.setup_module(model)
    from test_meta_init_on_cpu import check_local_shards

    from parity import full

    check_local_shards(model, reference_model(0))  # each rank's shard is its slice of the one-process model

    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    ref_rope = reference_model().rope
    torch.testing.assert_close(model.rope.cos, ref_rope.cos)
    torch.testing.assert_close(full(model.norm.weight), torch.ones(CFG.dim))
    # Every rank must hold parts of one model: gathered values identical across all ranks.
    checksums = torch.stack([full(p).detach().double().sum() for p in model.parameters()])
    gathered = [torch.zeros_like(checksums) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, checksums)
    for other in gathered[1:]:
        torch.testing.assert_close(other, gathered[0], atol=0, rtol=0)
    bound = 1 / CFG.dim**0.5  # nn.Linear's kaiming-uniform bound with fan_in = dim
    wq = full(model.layers[0].attention.wq.weight)
    assert 0 < wq.abs().max() <= bound + 1e-6 and wq.std() > bound / 4
    # Forward/backward works on the materialized model.
    x, y = global_batches(1)[0]
    fabric.backward(lm_loss(model(local_slice(fabric, x)), local_slice(fabric, y)))
    return {"params": len(checksums)}


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))


class _BadReset(nn.Linear):
    def reset_parameters(self) -> None:  # re-creates the weight on meta instead of filling it
        self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"))


def _shard_all(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def _returns_none(model: nn.Module, mesh: Any) -> None:
    return None


def case_setup_errors(world_size: int) -> dict[str, str]:
    messages: dict[str, str] = {}
    # 1. sizes that do not multiply to the world size: raised in setup_environment, before any collective.
    # ValueError (ours) and RuntimeError (what Lightning raises for it) both catch it.
    with pytest.raises(RuntimeError, match=r"`data_parallel_size=3` x `tensor_parallel_size=2` = 6") as e1:
        make_fabric(3, 2, world_size=world_size, parallelize_fn=_shard_all)
    assert isinstance(e1.value, ValueError)
    messages["sizes"] = str(e1.value)
    with pytest.raises(ValueError, match=r"`tensor_parallel_size=3` .* Choose tensor_parallel_size among") as e2:
        make_fabric("auto", 3, world_size=world_size, parallelize_fn=_shard_all)
    messages["auto"] = str(e2.value)
    # 2. parallelize_fn that forgets to return the model.
    fabric = make_fabric(world_size, 1, world_size=world_size, parallelize_fn=_returns_none)
    with pytest.raises(
        TypeError,
        match=r"The `parallelize_fn` \(_returns_none\) must return a `nn.Module` instance, the parallelized model, but it returned NoneType",
    ):
        fabric.setup_module(nn.Linear(2, 2))
    # 3. FSDP1-wrapped submodules are named.
    from torch.distributed.fsdp import FullyShardedDataParallel

    fabric = make_fabric(world_size, 1, world_size=world_size, parallelize_fn=_shard_all)
    wrapped = nn.Sequential(nn.Linear(4, 4), FullyShardedDataParallel(nn.Linear(4, 4), device_id=torch.device("cpu")))
    with pytest.raises(TypeError, match=r"wrapped with FSDP1 .*: '1'\. .*fully_shard") as e3:
        fabric.setup_module(wrapped)
    messages["fsdp1"] = str(e3.value)
    # 4. a reset_parameters that leaves tensors on meta is named; a class without one is warned about.
    with fabric.init_module(empty_init=True):
        bad = nn.Sequential(_BadReset(4, 4))
    with pytest.raises(RuntimeError, match=r"still on the meta device: 0\.weight"):
        fabric.setup_module(bad)
    with fabric.init_module(empty_init=True):
        no_reset = nn.Sequential(nn.Linear(4, 4), _NoReset())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.setup_module(no_reset)
    texts = [str(w.message) for w in caught if "reset_parameters" in str(w.message)]
    if dist.get_rank() == 0:
        assert texts and "_NoReset" in texts[0] and "Linear" not in texts[0].split(":")[-1], texts
    else:
        assert not texts, "the warning is for rank 0 only"
    return messages


_PRECISION_DTYPE = {"bf16-mixed": torch.float32, "bf16-true": torch.bfloat16, "16-true": torch.float16}


def case_precision_matches_reference_in_same_precision(precision: str, num_nodes: int) -> dict[str, Any]:
    """One step on 2x2 in `precision`; the reference runs the same precision on one process."""
    import copy

    fabric = make_fabric(2, 2, world_size=4, num_nodes=num_nodes, precision=precision)
    ref = reference_model()
    model = fabric.setup_module(copy.deepcopy(ref))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    dtype = _PRECISION_DTYPE[precision]
    ref = ref.to(dtype)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = global_batches(1)[0]
    out: dict[str, Any] = {}
    if precision == "bf16-mixed":  # FSDP2's bf16 policy, no autocast: the root's outputs are fp32 all the same
        with torch.no_grad():
            logits = model.module(local_slice(fabric, x))  # the FSDP root itself, without Fabric's output cast
            raw = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), local_slice(fabric, y).reshape(-1))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                autocast_loss = F.cross_entropy(ref(x).reshape(-1, CFG.vocab_size), y.reshape(-1))
        out |= {"root_dtype": str(logits.dtype), "loss_dtype": str(raw.dtype)}
        out["vs_autocast"] = abs(fabric.all_reduce(raw.clone()).item() - autocast_loss.item()) / autocast_loss.item()
    loss = lm_loss(model(local_slice(fabric, x)), local_slice(fabric, y))
    fabric.backward(loss)
    optimizer.step()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        ref_loss = lm_loss(ref(x), y)
    ref_loss.backward()
    ref_opt.step()
    global_loss = fabric.all_reduce(loss.detach().float().clone())
    torch.testing.assert_close(global_loss, ref_loss.detach().float(), atol=3e-2, rtol=3e-2)
    param_dtypes = {p.dtype for p in model.parameters()}
    assert param_dtypes == {dtype}, param_dtypes
    assert_matches(model, ref, "param", atol=2e-2, rtol=2e-2)
    return out | {"loss": float(global_loss), "dtype": str(dtype)}


def case_collectives(world_size: int, num_nodes: int = 1) -> dict[str, Any]:
    fabric = make_fabric("auto", 2, world_size=world_size, num_nodes=num_nodes, parallelize_fn=_shard_all)
    rank = dist.get_rank()
    t = torch.tensor(float(rank))
    assert fabric.all_reduce(t) is t  # in place, like Lightning
    mean = t.item()
    total = fabric.all_reduce(torch.tensor(float(rank)), reduce_op="sum").item()
    tp_sum = fabric.strategy.all_reduce(torch.tensor(float(rank)), group="tensor_parallel", reduce_op="sum").item()
    fabric.barrier()
    obj = fabric.broadcast({"from": rank}, src=0)
    return {"mean": mean, "sum": total, "tp_sum": tp_sum, "bcast": obj["from"]}


def case_axis_over_all_ranks_is_the_default_group(namespace: str, dp: int, tp: int) -> dict[str, Any]:
    """On 2x1 and 1x2 the axis of size 2 spans the world: it is the default group (same backend and timeout),
    not a second communicator over every rank; with another timeout it gets its own group, with that timeout."""
    world_axis, other_axis = ("data_parallel", "tensor_parallel") if dp == 2 else ("tensor_parallel", "data_parallel")
    mesh = make_fabric(dp, tp, world_size=2).strategy.device_mesh
    assert group_timeout("cpu") == PG_TIMEOUT  # the default group has the strategy's timeout
    out = {
        "world_axis_is_default": mesh.get_group(world_axis) is dist.group.WORLD,
        "other_axis_timeout": group_timeout("cpu", mesh.get_group(other_axis)),
    }
    other_timeout = PG_TIMEOUT + timedelta(seconds=1)
    strategy = ModelParallelStrategy(parallelize_llama, dp, tp, timeout=other_timeout)
    fabric = importlib.import_module(namespace).Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    group = fabric.strategy.device_mesh.get_group(world_axis)
    out["other_timeout_is_default"] = group is dist.group.WORLD
    out["other_timeout_group_timeout"] = group_timeout("cpu", group)
    t = torch.ones(())
    dist.all_reduce(t, group=group)  # the group works
    out["other_timeout_sum"] = t.item()
    return out


def case_checkpoint_round_trip_continues_like_reference(root: Path, dp: int, tp: int) -> list[str]:
    """`fabric.save` / `fabric.load` in both formats restore model, optimizer and extras; training goes on
    exactly like the reference (under each Lightning namespace, so checkpoints work the same in both)."""
    done = []
    for distributed in (True, False):
        fabric = make_fabric(dp, tp, world_size=2, save_distributed_checkpoint=distributed)
        model, optimizer, ref, ref_opt = setup_pair(fabric)
        (x1, y1), (x2, y2) = global_batches(2)
        fabric.backward(lm_loss(model(local_slice(fabric, x1)), local_slice(fabric, y1)))
        optimizer.step()
        optimizer.zero_grad()
        path = root / f"{dp}x{tp}-{'distributed' if distributed else 'full'}"
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
        # a fresh pair with other weights and no optimizer state: loading must overwrite everything
        fabric = make_fabric(tp, dp, world_size=2, save_distributed_checkpoint=distributed)  # another layout
        model = fabric.setup_module(reference_model(seed=5))
        optimizer = fabric.setup_optimizers(adamw(model.parameters(), lr=1e-2, weight_decay=0.1))
        state = {"model": model, "optimizer": optimizer, "step": 0}
        remainder = fabric.load(path, state)
        assert state["step"] == 1 and remainder == {}, (state["step"], remainder)
        for x, y in ((x1, y1), (x2, y2)):
            lm_loss(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        fabric.backward(lm_loss(model(local_slice(fabric, x2)), local_slice(fabric, y2)))
        optimizer.step()
        assert_matches(model, ref, "param")
        done.append(f"{dp}x{tp}->{tp}x{dp} {'distributed' if distributed else 'full'}")
    return done


def case_threads_left_pass_lightnings_check(before: set[threading.Thread]) -> dict[str, list[str]]:
    """What Lightning's test suites do after every test (``thread_police_duuu_daaa_duuu_daaa``): stop each thread
    the test started that is a daemon through its ``stop()`` and require it ended; any other thread still alive fails
    the test. Here with the process group still there (as after Lightning's tests that do not destroy it), so the
    watchdog's thread is certainly running: after a ``destroy_process_group`` it may already have ended itself."""
    checked, left = [], []
    for thread in set(threading.enumerate()) - before:
        stop = getattr(thread, "stop", None)
        if thread.daemon and callable(stop):
            stop()
            checked.append(thread.name)
        if thread.is_alive():
            left.append(thread.name)
    return {"checked": sorted(checked), "left": left}


# ---------------------------------------------------------------------------------------------------
# grids (one spawn each)
# ---------------------------------------------------------------------------------------------------
def grid_two_processes(namespace: str, root: Path) -> dict[str, Any]:
    use_fabric_namespace(namespace)
    out: dict[str, Any] = {"checkpoints": case_checkpoint_round_trip_continues_like_reference(root, 2, 1)}
    for dp, tp in ((2, 1), (1, 2)):
        out[f"train_{dp}x{tp}"] = case_training_matches_reference(dp, tp, 2)
        out[f"clip_{dp}x{tp}"] = case_clipping_matches_reference(dp, tp, 2)
        out[f"sync_{dp}x{tp}"] = case_no_backward_sync_accumulates_and_restores(dp, tp, 2)
        out[f"meta_{dp}x{tp}"] = case_meta_init_materializes_consistently(dp, tp, 2)
        out[f"world_axis_{dp}x{tp}"] = case_axis_over_all_ranks_is_the_default_group(namespace, dp, tp)
    out["errors"] = case_setup_errors(2)
    out["collectives"] = case_collectives(2)
    return out


def grid_two_nodes_of_two(namespace: str) -> dict[str, Any]:
    use_fabric_namespace(namespace)
    threads = set(threading.enumerate())
    out: dict[str, Any] = {}
    out["train_auto"] = case_training_matches_reference("auto", "auto", 4, num_nodes=2)
    for dp, tp in ((4, 1), (1, 4)):
        out[f"train_{dp}x{tp}"] = case_training_matches_reference(dp, tp, 4, num_nodes=2)
    out["clip_2x2"] = case_clipping_matches_reference(2, 2, 4, num_nodes=2)
    out["sync_2x2"] = case_no_backward_sync_accumulates_and_restores(2, 2, 4, num_nodes=2)
    out["meta_2x2"] = case_meta_init_materializes_consistently(2, 2, 4, num_nodes=2)
    out["collectives"] = case_collectives(4, num_nodes=2)
    for precision in _PRECISION_DTYPE:
        out[f"precision_{precision}"] = case_precision_matches_reference_in_same_precision(precision, 2)
    out["threads"] = case_threads_left_pass_lightnings_check(threads)  # last: it stops the watchdog
    return out


# ---------------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=FABRIC_NAMESPACES)
def namespace(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def two_process_results(namespace: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(grid_two_processes, 2, namespace, tmp_path_factory.mktemp("fabric"))


#: The namespace of the 4-process grid. The 2-process grid runs every case kind (training, clipping, accumulation,
#: meta init, collectives, errors, precisions) in both namespaces; modelpar resolves the namespace in one place, and
#: what the 4 processes add (two nodes, "auto" sizes, 2-D meshes) does not depend on it. As for the Trainer's grid
#: (test_trainer.py), one 4-rank spawn less: 21 s of CPU on 2 cores (2026-11-28).
FOUR_NAMESPACE = "lightning.fabric"


@pytest.fixture(scope="module")
def two_node_results() -> list[dict[str, Any]]:
    return run_distributed(grid_two_nodes_of_two, 4, FOUR_NAMESPACE, nodes=2)


@pytest.mark.parametrize("layout", ["2x1", "1x2"])
def test_training_on_two_processes_matches_single_process_reference(two_process_results, layout):
    results = [r[f"train_{layout}"] for r in two_process_results]
    dp, tp = (int(v) for v in layout.split("x"))
    assert all(r["mesh"] == (dp, tp) and r["axes"] == ("data_parallel", "tensor_parallel") for r in results)
    assert results[0]["losses"][-1] < results[0]["losses"][0], "training must make progress"
    assert all(r["losses"] == results[0]["losses"] for r in results), "the parallel model's mean loss differs"
    local = [r["local_losses"] for r in results]
    if tp == 2:  # tensor-parallel peers compute the loss of the same batch from the same (gathered) logits
        assert local[0] == local[1], f"tensor-parallel peers disagree on the loss: {local}"
    else:  # data-parallel ranks see different halves of the batch
        assert local[0] != local[1], f"data-parallel ranks computed the same loss: {local}"
    if dp == 2:
        assert [r["sampler"] for r in results] == [{"num_replicas": 2, "rank": 0}, {"num_replicas": 2, "rank": 1}]
    else:  # tensor-parallel peers get the same batches
        assert all(r["sampler"] == {"num_replicas": 1, "rank": 0} for r in results)


def test_auto_sizes_on_two_simulated_nodes_give_a_2x2_mesh_that_matches_reference(two_node_results):
    results = [r["train_auto"] for r in two_node_results]
    assert all(r["mesh"] == (2, 2) for r in results)
    assert [r["sampler"]["rank"] for r in results] == [0, 0, 1, 1]  # TP peers are neighbouring ranks


@pytest.mark.parametrize("layout", ["4x1", "1x4"])
def test_training_on_four_processes_matches_single_process_reference(two_node_results, layout):
    dp, tp = (int(v) for v in layout.split("x"))
    assert all(r[f"train_{layout}"]["mesh"] == (dp, tp) for r in two_node_results)


@pytest.mark.parametrize(
    ("results", "layouts"), [("two_process_results", ["2x1", "1x2"]), ("two_node_results", ["2x2"])]
)
def test_gradient_clipping_by_norm_and_value_matches_reference(
    request, namespace, results, layouts
):  # namespace: run under both
    for r in request.getfixturevalue(results):
        for layout in layouts:
            clip = r[f"clip_{layout}"]
            assert clip["norm2"] > 0.05 and clip["norminf"] > 0


@pytest.mark.parametrize(
    ("results", "layouts"), [("two_process_results", ["2x1", "1x2"]), ("two_node_results", ["2x2"])]
)
def test_no_backward_sync_accumulates_like_reference_and_restores_sync(
    request, namespace, results, layouts
):  # namespace: run under both
    assert all(r[f"sync_{layout}"] for r in request.getfixturevalue(results) for layout in layouts)


@pytest.mark.parametrize(
    ("results", "layouts"), [("two_process_results", ["2x1", "1x2"]), ("two_node_results", ["2x2"])]
)
def test_meta_device_init_is_materialized_consistently_on_every_rank(
    request, namespace, results, layouts
):  # namespace: run under both
    assert all(r[f"meta_{layout}"]["params"] > 0 for r in request.getfixturevalue(results) for layout in layouts)


def test_bad_input_raises_the_same_clear_error_on_every_rank(two_process_results):
    messages = [r["errors"] for r in two_process_results]
    assert messages[0] == messages[1]
    assert "the world size (2)" in messages[0]["sizes"] and 'pass "auto"' in messages[0]["sizes"]
    assert "[1, 2]" in messages[0]["auto"]


def test_collectives_reduce_over_world_or_mesh_axis(two_process_results, two_node_results):
    for results, world in ((two_process_results, 2), (two_node_results, 4)):
        c = [r["collectives"] for r in results]
        expected_sum = sum(range(world))
        assert all(x["sum"] == expected_sum and x["mean"] == expected_sum / world for x in c)
        assert all(x["bcast"] == 0 for x in c)
        # tensor-parallel groups are neighbouring ranks: (0, 1) and, with 4 ranks, (2, 3)
        assert [x["tp_sum"] for x in c] == ([1.0, 1.0] if world == 2 else [1.0, 1.0, 5.0, 5.0])


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "16-true"])
def test_supported_precisions_train_like_reference_in_same_precision(two_node_results, precision):
    results = [r[f"precision_{precision}"] for r in two_node_results]
    assert len({r["loss"] for r in results}) == 1


def test_the_threads_a_run_leaves_pass_the_leftover_thread_check_of_lightnings_test_suites(two_node_results):
    for rank, result in enumerate(r["threads"] for r in two_node_results):
        assert "modelpar-peer-watchdog" in result["checked"], (rank, result)  # the check saw the watchdog
        assert result["left"] == [], (rank, result)


def test_bf16_mixed_policy_gives_fp32_losses_that_match_autocast(two_node_results):
    """FSDP2's bf16 policy replaces autocast, but the root's outputs are fp32, so a loss computed from them is too.

    The loss is then within 1e-3 (relative) of an autocast run of the same model: both round the same matmuls
    to bf16, and differ only where autocast keeps fp32 (the residual stream from the fp32 embedding, and the
    reductions of the norms; here ~1e-4). A bf16 loss could be off by half a bf16 step, up to 2**-9 = 2e-3.
    """
    for r in (r["precision_bf16-mixed"] for r in two_node_results):
        assert r["root_dtype"] == r["loss_dtype"] == "torch.float32"
        assert r["vs_autocast"] < 1e-3, r["vs_autocast"]


def test_checkpoints_round_trip_across_layouts_and_training_continues_like_reference(two_process_results):
    assert all(r["checkpoints"] == ["2x1->1x2 distributed", "2x1->1x2 full"] for r in two_process_results), (
        two_process_results[0]["checkpoints"]
    )


@pytest.mark.parametrize("layout", ["2x1", "1x2"])
def test_a_mesh_axis_over_all_ranks_is_the_default_group_unless_its_timeout_differs(two_process_results, layout):
    for r in two_process_results:
        got = r[f"world_axis_{layout}"]
        assert got["world_axis_is_default"], "a second communicator over all ranks was created"
        assert got["other_axis_timeout"] == PG_TIMEOUT
        assert not got["other_timeout_is_default"]
        assert got["other_timeout_group_timeout"] == PG_TIMEOUT + timedelta(seconds=1)
        assert got["other_timeout_sum"] == 2.0
