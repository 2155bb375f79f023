"""Clipping by norm on real gloo process groups, against ``torch.nn.utils.clip_grad_norm_`` on one process.

One spawn of 4 processes on a 2 x 2 ``(data_parallel, tensor_parallel)`` mesh runs every case: hand-placed
gradients on several meshes at once (sharded over both axes, replicated along one, on the 1-D data-parallel
sub-mesh, pending-sum ``Partial`` that differs per rank, a plain tensor, one in another dtype, one empty on
some ranks), a Llama model under the FSDP2 + TP plan (strided shards), and non-finite norms. Every case counts
its collectives with ``CommDebugMode``, which sees both ``dist.all_reduce`` and DTensor's functional
collectives: one per clipping call, plus one per ``Partial`` gradient that is also sharded (summed first).
"""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from harness import PG_TIMEOUT, run_distributed
from modelpar import MESH_AXES, clip_grad_norm
from modelpar.plans import parallelize_llama
from parity import full, global_batches, lm_loss, reference_model

NORM_TYPES = (1.0, 2.0, 3.0, float("inf"))


def _clip_counting_collectives(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, int]:
    """``clip_grad_norm(*args, **kwargs)`` and the number of collectives it ran on this rank."""
    with CommDebugMode() as comm:
        norm = clip_grad_norm(*args, **kwargs)
    return norm, comm.get_total_counts()


def _hand_placed(
    mesh: DeviceMesh, other_dtype: torch.dtype, sharded_partial: bool = False
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The same global gradients as (sharded parameters, single-process reference parameters)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(8, 6), (4, 6), (8,), (6, 4), (3, 5), (4, 4), (1, 3), (4, 2)][: 8 if sharded_partial else 7]
    fulls = [torch.randn(s, generator=g) for s in shapes]
    fulls[-2] = fulls[-2].to(other_dtype)  # (Shard(0), Replicate()) on the 2-D mesh
    dp_mesh = mesh["data_parallel"]
    placed: list[tuple[DeviceMesh | None, tuple[Any, ...]]] = [
        (mesh, (Shard(0), Shard(1))),  # split over both axes
        (mesh, (Replicate(), Shard(0))),  # TP-sharded, replicated along data_parallel: counted once
        (dp_mesh, (Shard(0),)),  # FSDP-only on the 1-D sub-mesh, repeated across tensor_parallel
        (mesh, (Replicate(), Partial())),  # pending sum over tensor_parallel
        (None, ()),  # a plain tensor every rank holds whole
        (mesh, (Shard(0), Replicate())),
        (mesh, (Shard(0), Replicate())),  # uneven: empty on the second data-parallel rank
        (mesh, (Shard(0), Partial())),  # sharded and pending: summed first, one collective more
    ][: len(fulls)]
    ours, ref = [], []
    for t, (m, placements) in zip(fulls, placed, strict=True):
        r = nn.Parameter(torch.zeros_like(t))
        r.grad = t.clone()
        ref.append(r)
        if m is None:
            p = nn.Parameter(torch.zeros_like(t))
            p.grad = t.clone()
        elif any(pl.is_partial() for pl in placements):
            p = nn.Parameter(distribute_tensor(torch.zeros_like(t), m, [Replicate()] * m.ndim))
            # Each tensor-parallel rank holds a different share; the shares sum to t (their norms do not).
            share = distribute_tensor(t, m, [pl if pl.is_shard() else Replicate() for pl in placements]).to_local()
            part = share * (0.25 if m.get_local_rank(1) == 0 else 0.75) + (1.0 if m.get_local_rank(1) == 0 else -1.0)
            p.grad = DTensor.from_local(part, m, placements, shape=t.shape, stride=t.stride())
        else:
            p = nn.Parameter(distribute_tensor(torch.zeros_like(t), m, placements))
            p.grad = distribute_tensor(t.clone(), m, placements)
        ours.append(p)
    return ours, ref


def case_hand_placed_gradients_on_several_meshes(
    mesh: DeviceMesh, other_dtype: torch.dtype, sharded_partial: bool = False
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for norm_type in NORM_TYPES:
        ours, ref = _hand_placed(mesh, other_dtype, sharded_partial)
        before = [r.grad.double() for r in ref]
        want_norm = torch.nn.utils.get_total_norm([p.grad.double() for p in ref], norm_type)
        max_norm = float(want_norm) / 2
        got, collectives = _clip_counting_collectives(ours, max_norm, norm_type)
        # One all-reduce; the Partial gradient that is replicated elsewhere rides in it; the one that is also
        # sharded is summed first (one all-reduce over tensor_parallel).
        expected = 2 if sharded_partial else 1
        assert collectives == expected, f"norm {norm_type}: {collectives} collectives, expected {expected}"
        assert got.dtype == torch.float32 and got.device == torch.device("cpu")
        torch.testing.assert_close(got.double(), want_norm, rtol=1e-5, atol=0)
        if other_dtype == torch.float32:  # torch's own clipping takes one dtype at a time on one mesh
            want = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        coef = max_norm / (float(got) + 1e-6)
        for i, (p, r) in enumerate(zip(ours, ref, strict=True)):
            expected = (before[i] * coef).to(r.grad.dtype)
            torch.testing.assert_close(full(p.grad), expected, rtol=1e-5, atol=1e-6, msg=lambda m, i=i: f"{i}: {m}")
        out[f"norm{norm_type}"] = float(got)
    return out


def case_llama_under_fsdp_and_tp_matches_reference(mesh: DeviceMesh) -> dict[str, float]:
    """Strided shards (FSDP over TP) and FSDP-only norms: the real mix of meshes of the Llama plan."""
    ref = reference_model()
    model = parallelize_llama(copy.deepcopy(ref), mesh)
    x, y = global_batches(1)[0]
    lm_loss(model(x), y).backward()  # every data-parallel rank sees the whole batch: the mean is the same
    lm_loss(ref(x), y).backward()
    snapshot = [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone() for p in model.parameters()]
    ref_snapshot = [p.grad.clone() for p in ref.parameters()]
    meshes = {p.grad.device_mesh.ndim for p in model.parameters() if isinstance(p.grad, DTensor)}
    assert meshes == {1, 2}, f"the plan must put gradients on both meshes, got mesh ranks {meshes}"
    out = {}
    for norm_type in NORM_TYPES:
        for p, s in zip(model.parameters(), snapshot, strict=True):
            (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).copy_(s)
        for p, s in zip(ref.parameters(), ref_snapshot, strict=True):
            p.grad.copy_(s)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
        assert float(want) > 0.05, "the case must actually clip"
        got, collectives = _clip_counting_collectives(model.parameters(), 0.05, norm_type)
        assert collectives == 1, f"norm {norm_type}: {collectives} collectives, expected 1"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        named_ref = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(full(p.grad), named_ref[name].grad, rtol=1e-4, atol=2e-6, msg=name)
        out[f"norm{norm_type}"] = float(got)
    return out


def case_nonfinite_shard_on_one_rank_raises_on_every_rank(mesh: DeviceMesh) -> str:
    ours, _ = _hand_placed(mesh, torch.float32)
    if dist.get_rank() == 3:
        ours[0].grad.to_local()[0, 0] = float("nan")
    try:
        clip_grad_norm(ours, 1.0)
    except RuntimeError as err:
        assert "is nan, so they cannot be clipped" in str(err)
    else:
        raise AssertionError("a NaN on rank 3 must make every rank raise")
    total = clip_grad_norm(ours, 1.0, error_if_nonfinite=False)
    assert math.isnan(float(total))
    return "raised"


def grid() -> dict[str, Any]:
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=MESH_AXES)
    torch.manual_seed(0)
    return {
        "hand_placed": case_hand_placed_gradients_on_several_meshes(mesh, torch.float32),
        "hand_placed_mixed_dtypes": case_hand_placed_gradients_on_several_meshes(mesh, torch.float64),
        "hand_placed_sharded_partial": case_hand_placed_gradients_on_several_meshes(mesh, torch.float32, True),
        "llama": case_llama_under_fsdp_and_tp_matches_reference(mesh),
        "nonfinite": case_nonfinite_shard_on_one_rank_raises_on_every_rank(mesh),
        "rank": int(os.environ["RANK"]),
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(grid, 4)


@pytest.mark.parametrize("case", ["hand_placed", "hand_placed_mixed_dtypes", "hand_placed_sharded_partial", "llama"])
def test_clip_grad_norm_on_a_2x2_mesh_equals_single_process_clipping_with_one_all_reduce(results, case):
    norms = [r[case] for r in results]
    assert all(n == norms[0] for n in norms), "every rank must return the same norm"
    assert set(norms[0]) == {f"norm{p}" for p in NORM_TYPES}


def test_a_nan_gradient_shard_on_one_rank_makes_every_rank_raise(results):
    assert [r["nonfinite"] for r in results] == ["raised"] * 4
