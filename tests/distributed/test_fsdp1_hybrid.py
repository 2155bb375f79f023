"""FSDP1 ``HYBRID_SHARD`` checkpoints load into HSDP, and training goes on like one process.

One spawn of 4 processes as two nodes. First real torch FSDP1 with ``ShardingStrategy.HYBRID_SHARD`` on a
2-D CPU mesh ``(replicate=2, shard=2)`` (a replica per node, sharded within it, as on a cluster) trains two
AdamW steps; Lightning's Fabric ``FSDPStrategy`` saves it with its own ``save_checkpoint`` in the sharded
format (DCP of FSDP1's ``SHARDED_STATE_DICT`` model and ``FSDP.optim_state_dict``, plus ``meta.pt``). FSDP1
then takes one more step, for what a continuation must reproduce, and is torn down.

Our strategy, in the same process group, loads the checkpoint into HSDP 2x2x1 (the same replicas and shards
as FSDP1, over a 3-D mesh) and into 2x1x2 (replicas of TP-sharded layers): weights and Adam moments, gathered,
must equal what FSDP1 held bit for bit; one more step must give FSDP1's loss and weights, and those of the
single-process reference trained three steps.

The FSDP1 model is wrapped by hand (per block, then the root) because Lightning's own wrapping passes
``device_id=None`` on CPU and builds a ``device_mesh`` tuple on CUDA only; see ``test_fsdp1.py`` for why the
strategy subclass exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning_fabric import Fabric
from test_fsdp1 import CPU, LR, CPUFabricFSDPStrategy, _assert_truth, _continue_like_fsdp1, _local, fsdp1_full_state
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy

from harness import run_distributed
from parity import adamw, assert_matches, global_batches, lm_loss, make_fabric, reference_model

HYBRID_AXES = ("replicate", "shard")


def fsdp1_hybrid_wrap(model: torch.nn.Module, mesh: Any) -> FSDP:
    """FSDP1 HYBRID_SHARD per block, then the root, all on one 2-D ``(replicate, shard)`` mesh."""
    kwargs = {"device_id": CPU, "use_orig_params": True, "sharding_strategy": ShardingStrategy.HYBRID_SHARD}
    for i, block in enumerate(model.layers):
        model.layers[i] = FSDP(block, device_mesh=mesh, **kwargs)
    return FSDP(model, device_mesh=mesh, **kwargs)


def _reference(steps: int) -> tuple[torch.nn.Module, float]:
    """The single-process reference after ``steps`` AdamW steps, and the loss of its last step."""
    model = reference_model()
    opt = adamw(model.parameters(), lr=LR)
    loss = torch.tensor(0.0)
    for x, y in global_batches(steps):
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model, loss.item()


def write_with_fsdp1_hybrid(root: Path) -> dict[str, Any]:
    fabric = Fabric(
        accelerator="cpu", devices=2, num_nodes=2, strategy=CPUFabricFSDPStrategy(state_dict_type="sharded")
    )
    fabric.launch()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=HYBRID_AXES)
    model = fabric.setup_module(fsdp1_hybrid_wrap(reference_model(), mesh))
    fsdp_model = model.module
    assert fsdp_model.sharding_strategy is ShardingStrategy.HYBRID_SHARD
    # really hybrid: each rank holds half of a block (sharded over the node), the same half as its replica peer;
    # the flat parameter is FSDP1's own storage of the block (no public API exposes a rank's shard of it)
    flat = fsdp_model.layers[0]._flat_param
    optimizer = fabric.setup_optimizers(adamw(model.parameters(), lr=LR))
    for x, y in global_batches(2):
        fabric.backward(lm_loss(model(_local(x)), _local(y)))
        optimizer.step()
        optimizer.zero_grad()
    local = flat.detach().clone()
    peers = [torch.empty_like(local) for _ in range(4)]
    dist.all_gather(peers, local)
    rank = dist.get_rank()
    layout = {
        "local_numel": local.numel(),
        "block_numel": sum(p.numel() for p in reference_model().layers[0].parameters()),
        "same_as_replica_peer": torch.equal(peers[rank], peers[(rank + 2) % 4]),
        "differs_from_shard_peer": not torch.equal(peers[rank], peers[rank ^ 1]),
    }
    fabric.save(root / "hybrid-sharded", {"model": model, "optimizer": optimizer, "step": 2})  # Lightning's code
    sd, osd = fsdp1_full_state(fsdp_model, optimizer.optimizer)
    truth = {"model": sd, "moments": osd["state"]}
    x, y = global_batches(3)[2]  # FSDP1 goes on one step: what our strategy must reproduce
    loss = lm_loss(model(_local(x)), _local(y))
    fabric.backward(loss)
    optimizer.step()
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    truth_next = {"loss": global_loss.item() / 4, "model": fsdp1_full_state(fsdp_model, optimizer.optimizer)[0]}
    return {"truth": truth, "truth_next": truth_next, "layout": layout}


def grid(root: Path) -> dict[str, Any]:
    written = write_with_fsdp1_hybrid(root)
    truth, truth_next = written["truth"], written["truth_next"]
    ref_model, ref_loss = _reference(3)
    out: dict[str, Any] = {"layout": written["layout"]}
    # FSDP1 hybrid itself trains like one process (tolerance: another reduction order)
    torch.testing.assert_close(truth["model"], _reference(2)[0].state_dict(), atol=2e-5, rtol=1e-4)
    for name, (dp, tp) in {"2x2x1": (4, 1), "2x1x2": (2, 2)}.items():
        fabric = make_fabric(dp, tp, world_size=4, num_nodes=2, data_parallel_replicate_size=2)
        assert tuple(fabric.strategy.device_mesh.shape) == tuple(int(n) for n in name.split("x"))
        model = fabric.setup_module(reference_model(seed=5))
        optimizer = fabric.setup_optimizers(adamw(model.parameters(), lr=LR))
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(root / "hybrid-sharded", state)
        assert state["step"] == 2
        where = f"FSDP1 HYBRID_SHARD -> HSDP {name}"
        _assert_truth(model, optimizer, truth, where)  # exact
        loss = _continue_like_fsdp1(fabric, model, optimizer, truth_next, where)
        assert abs(loss - ref_loss) < 1e-5, (where, loss, ref_loss)
        assert_matches(model, ref_model, "param")
        out[name] = loss
    return out


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fsdp1-hybrid")
    return {"root": root, "results": run_distributed(grid, 4, root, nodes=2, timeout=180)}


def test_fsdp1_hybrid_shard_really_shards_within_a_node_and_replicates_across_nodes(hybrid):
    for r in hybrid["results"]:
        layout = r["layout"]
        assert layout["same_as_replica_peer"] and layout["differs_from_shard_peer"], layout
        assert layout["block_numel"] / 2 <= layout["local_numel"] <= layout["block_numel"] / 2 + 1  # half (padded)


def test_fsdp1_hybrid_checkpoint_loads_exactly_into_hsdp_and_training_continues_like_fsdp1(hybrid):
    for r in hybrid["results"]:
        assert set(r) >= {"2x2x1", "2x1x2"}
        assert abs(r["2x2x1"] - r["2x1x2"]) < 1e-5


def test_lightning_wrote_the_hybrid_checkpoint_in_its_sharded_layout(hybrid):
    folder = hybrid["root"] / "hybrid-sharded"
    assert (folder / ".metadata").is_file() and (folder / "meta.pt").is_file()
    assert torch.load(folder / "meta.pt", weights_only=True) == {"step": 2}
