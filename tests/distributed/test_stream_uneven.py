"""Full files streamed into sharded models whose dims do not divide: every rank gets exactly what FSDP2 holds.

A single-process model with dims 7, 9 and 13 is saved as a plain file (weights, and AdamW state keyed by
position). Each layout shards a fresh model (tensor parallelism, then ``fully_shard`` on the data-parallel
axis, over TP on the same dim for column-parallel weights), loads the file, and compares on every rank:

* each local shard with what FSDP2 itself holds after sharding the same single-process weights (and, for the
  Adam moments, a model whose weights are the single-process moments), shape and values;
* each local shard with ``distribute_tensor``'s where DTensor's own slicing applies (no ``_StridedShard``);
* ``full_tensor()`` with the single-process values.

3x2 is the layout that matters: 7 and 13 rows over tp=2 then dp=3 are where ``distribute_tensor``'s
reading of ``_StridedShard`` differs from FSDP2's layout (no 2x2 size differs). One spawn per world size.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from harness import PG_TIMEOUT, run_distributed
from modelpar.checkpoint import Checkpointer
from modelpar.checkpoint._stream import _local_block

LAYOUTS = {4: [(2, 2), (4, 1), (1, 4)], 6: [(3, 2), (2, 3)]}


class Uneven(nn.Module):
    """Dims 7, 9, 13: none divides by 2, 3 or 4."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(9, 7)  # column-parallel: weight (7, 9) and bias (7,) sharded on dim 0 twice
        self.mid = nn.Linear(7, 13)  # column-parallel: (13, 7)
        self.down = nn.Linear(13, 9)  # row-parallel: weight (9, 13) on dim 1 by TP, dim 0 by FSDP
        self.norm = nn.LayerNorm(9)  # FSDP only


def reference() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The single-process truth: seeded weights after one AdamW step (so the moments are not zero)."""
    torch.manual_seed(0)
    model = Uneven()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(5, 9)
    model.norm(model.down(model.mid(model.up(x)))).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


_MESHES: dict[tuple[int, int], DeviceMesh] = {}


def shard(model: nn.Module, dp: int, tp: int) -> nn.Module:
    if (dp, tp) not in _MESHES:  # one mesh per layout: each new one costs collectives to set up its groups
        _MESHES[dp, tp] = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    mesh = _MESHES[dp, tp]
    if tp > 1:
        plan = {"up": ColwiseParallel(), "mid": ColwiseParallel(), "down": RowwiseParallel()}
        parallelize_module(model, mesh["tensor_parallel"], plan)
    fully_shard(model.mid, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def held_by_fsdp(values: dict[str, torch.Tensor], dp: int, tp: int) -> dict[str, torch.Tensor]:
    """What FSDP2 holds on this rank after sharding a single-process model with these parameter values."""
    model = Uneven()
    model.load_state_dict(values, strict=False)
    return {k: v.to_local().clone() for k, v in shard(model, dp, tp).state_dict().items()}


def compare(got: dict[str, DTensor], held: dict[str, torch.Tensor], truth: dict[str, torch.Tensor], what: str) -> int:
    strided = 0
    for name, value in got.items():
        local, where = value.to_local(), f"{what} {name} {value.placements} rank {dist.get_rank()}"
        assert local.shape == held[name].shape, (
            f"{where}: local {tuple(local.shape)}, FSDP2 holds {tuple(held[name].shape)}"
        )
        torch.testing.assert_close(local, held[name], atol=0, rtol=0, msg=lambda m, w=where: f"{w}: {m}")
        if all(isinstance(p, Shard) or p.is_replicate() for p in value.placements):
            ref = distribute_tensor(truth[name], value.device_mesh, value.placements, src_data_rank=None).to_local()
            torch.testing.assert_close(
                local, ref, atol=0, rtol=0, msg=lambda m, w=where: f"{w} vs distribute_tensor: {m}"
            )
        else:
            strided += 1
        full = value.full_tensor()
        torch.testing.assert_close(full, truth[name], atol=0, rtol=0, msg=lambda m, w=where: f"{w} full_tensor: {m}")
    return strided


def grid(root: Path, world: int) -> dict[str, Any]:
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    saved = torch.load(root / "full.pt", weights_only=True)  # the truth as written, not recomputed here
    truth, state = saved["model"], saved["optimizer"]["state"]
    names = [name for name, _ in Uneven().named_parameters()]  # the optimizer state is keyed by position
    moments = {key: {name: state[i][key] for i, name in enumerate(names)} for key in ("exp_avg", "exp_avg_sq")}
    out: dict[str, Any] = {}
    for dp, tp in LAYOUTS[world]:
        layout = f"{dp}x{tp}"
        held = held_by_fsdp(truth, dp, tp)
        # load_raw of a raw state-dict file
        torch.manual_seed(7)
        model = shard(Uneven(), dp, tp)
        Checkpointer().load_raw(root / "raw.pt", model)
        strided = compare(model.state_dict(), held, truth, f"{layout} load_raw")
        # a full checkpoint with the optimizer: weights and Adam moments cut to each rank's shard
        torch.manual_seed(7)
        model = shard(Uneven(), dp, tp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        Checkpointer().load(root / "full.pt", {"model": model, "optimizer": opt})
        compare(model.state_dict(), held, truth, f"{layout} load")
        for key, values in moments.items():
            got = {name: opt.state[p][key] for name, p in model.named_parameters()}
            compare(got, held_by_fsdp(values, dp, tp), values, f"{layout} optimizer {key}")
        assert all(opt.state[p]["step"].item() == 1 for p in model.parameters())
        out[layout] = strided
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("uneven")
    model, opt = reference()
    torch.save(model.state_dict(), root / "raw.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, root / "full.pt")
    return root


def test_full_files_load_into_uneven_2x2_4x1_1x4_shards_exactly_as_fsdp2_holds_them(files):
    results = run_distributed(grid, 4, files, 4)
    assert results[0]["2x2"] > 0  # FSDP over TP on the same dim was exercised


def test_full_files_load_into_uneven_3x2_and_2x3_shards_exactly_as_fsdp2_holds_them_on_every_rank(files):
    results = run_distributed(grid, 6, files, 6)
    assert results[0]["3x2"] > 0
    assert all(r == results[0] for r in results)


def _piece(indices: torch.Tensor, parts: int, index: int, dim: int = 0) -> torch.Tensor:
    """Piece ``index`` of ``torch.chunk`` along ``dim``, empty where torch.chunk returns fewer pieces."""
    pieces = torch.chunk(indices, parts, dim=dim)
    return pieces[index] if index < len(pieces) else indices.narrow(dim, 0, 0)


def _cut(shape: tuple[int, ...], coordinate: tuple[int, ...], sizes: tuple[int, ...], placements: list[Any]) -> Any:
    block = _local_block(shape, coordinate, sizes, placements)
    assert block is not None
    out = torch.arange(math.prod(shape)).view(shape)
    for dim, (start, length) in enumerate(block):
        out = out.narrow(dim, start, length)
    return out


def test_local_blocks_are_nested_torch_chunks_and_fsdp2_over_tp_cuts_tp_first_for_every_size():
    for rows in range(0, 16):
        for dp, tp in [(2, 2), (3, 2), (2, 3), (4, 2), (3, 3), (4, 4)]:
            full = torch.arange(rows * 3).view(rows, 3)
            for d in range(dp):
                for t in range(tp):
                    # Shard axes cut left to right, as distribute_tensor does
                    want = _piece(_piece(full, dp, d), tp, t)
                    assert torch.equal(_cut((rows, 3), (d, t), (dp, tp), [Shard(0), Shard(0)]), want)
                    want = _piece(_piece(full, dp, d), tp, t, dim=1)
                    assert torch.equal(_cut((rows, 3), (d, t), (dp, tp), [Shard(0), Shard(1)]), want)
                    assert torch.equal(_cut((rows, 3), (d, t), (dp, tp), [Replicate(), Shard(0)]), _piece(full, tp, t))
                    # FSDP over TP on the same dim: TP's piece first, then FSDP's piece of it
                    want = _piece(_piece(full, tp, t), dp, d)
                    placements = [_StridedShard(0, split_factor=tp), Shard(0)]
                    assert torch.equal(_cut((rows, 3), (d, t), (dp, tp), placements), want), (rows, dp, tp, d, t)
    # a _StridedShard not built the way FSDP2 builds it is left to distribute_tensor
    assert _local_block((8, 3), (0, 0), (2, 2), [_StridedShard(0, split_factor=3), Shard(0)]) is None
