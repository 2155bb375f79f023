"""Clipping by norm on real gloo process groups, against ``torch.nn.utils.clip_grad_norm_`` on one process.

One spawn of 4 processes on a 2 x 2 ``(data_parallel, tensor_parallel)`` mesh runs every case: hand-placed
gradients on several meshes at once (sharded over both axes, replicated along one, on the 1-D data-parallel
sub-mesh, pending-sum ``Partial``, a plain tensor, one in another dtype, one empty on some ranks), a Llama
model under the FSDP2 + TP plan (strided shards), and non-finite norms. Every case counts its all-reduces:
one per clipping call.
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

from harness import PG_TIMEOUT, run_distributed
from modelpar import MESH_AXES, clip_grad_norm
from modelpar.plans import parallelize_llama
from parity import full, global_batches, lm_loss, reference_model

NORM_TYPES = (1.0, 2.0, 3.0, float("inf"))


def _counting_all_reduces() -> list[int]:
    """Count ``dist.all_reduce`` calls in this process from now on (the clipping collective)."""
    calls = [0]
    original = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counted  # this worker process only
    return calls


def _hand_placed(mesh: DeviceMesh, other_dtype: torch.dtype) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The same global gradients as (sharded parameters, single-process reference parameters)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(8, 6), (4, 6), (8,), (6, 4), (3, 5), (4, 4), (1, 3)]
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
    ]
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
            part = t / m.size(1)  # each tensor-parallel rank holds a share; the shares sum to t
            p.grad = DTensor.from_local(part, m, placements, shape=t.shape, stride=t.stride())
        else:
            p = nn.Parameter(distribute_tensor(torch.zeros_like(t), m, placements))
            p.grad = distribute_tensor(t.clone(), m, placements)
        ours.append(p)
    return ours, ref


def case_hand_placed_gradients_on_several_meshes(mesh: DeviceMesh, other_dtype: torch.dtype) -> dict[str, Any]:
    out: dict[str, Any] = {}
    original = dist.all_reduce
    for norm_type in NORM_TYPES:
        ours, ref = _hand_placed(mesh, other_dtype)
        before = [r.grad.double() for r in ref]
        want_norm = torch.nn.utils.get_total_norm([p.grad.double() for p in ref], norm_type)
        max_norm = float(want_norm) / 2
        calls = _counting_all_reduces()
        try:
            got = clip_grad_norm(ours, max_norm, norm_type)
        finally:
            dist.all_reduce = original
        assert calls[0] == 1, f"norm {norm_type}: {calls[0]} all-reduces, expected 1"
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
    original = dist.all_reduce
    for norm_type in NORM_TYPES:
        for p, s in zip(model.parameters(), snapshot, strict=True):
            (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).copy_(s)
        for p, s in zip(ref.parameters(), ref_snapshot, strict=True):
            p.grad.copy_(s)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
        assert float(want) > 0.05, "the case must actually clip"
        calls = _counting_all_reduces()
        try:
            got = clip_grad_norm(model.parameters(), 0.05, norm_type)
        finally:
            dist.all_reduce = original
        assert calls[0] == 1
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
        "llama": case_llama_under_fsdp_and_tp_matches_reference(mesh),
        "nonfinite": case_nonfinite_shard_on_one_rank_raises_on_every_rank(mesh),
        "rank": int(os.environ["RANK"]),
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(grid, 4)


@pytest.mark.parametrize("case", ["hand_placed", "hand_placed_mixed_dtypes", "llama"])
def test_clip_grad_norm_on_a_2x2_mesh_equals_single_process_clipping_with_one_all_reduce(results, case):
    norms = [r[case] for r in results]
    assert all(n == norms[0] for n in norms), "every rank must return the same norm"
    assert set(norms[0]) == {f"norm{p}" for p in NORM_TYPES}


def test_a_nan_gradient_shard_on_one_rank_makes_every_rank_raise(results):
    assert [r["nonfinite"] for r in results] == ["raised"] * 4
