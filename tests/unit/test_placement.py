"""Where tensors go under CPU offload, decided for a GPU root device without a GPU (no process group).

The decisions are pure functions of the root device and the offload state, so they are checked here with
``torch.device("cuda", 0)``, which needs no CUDA to construct. Their effect on real FSDP modules is checked in
``tests/distributed/test_hsdp.py`` (with "meta" standing in for the accelerator) and, on GPUs, by the GPU suite.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from modelpar._init.placement import materialization_device, materialize, move_to_device, offloads, tensor_device

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


def test_offloaded_shards_belong_in_host_memory_and_everything_else_on_the_gpu():
    assert tensor_device(GPU, offloaded_shard=True) == CPU
    assert tensor_device(GPU, offloaded_shard=False) == GPU  # buffers, units without offload, non-FSDP parameters
    assert tensor_device(CPU, offloaded_shard=True) == CPU == tensor_device(CPU, offloaded_shard=False)


def test_meta_tensors_are_allocated_on_the_cpu_as_soon_as_one_belongs_there():
    assert materialization_device(GPU, [GPU, CPU, GPU]) == CPU  # then the GPU ones are moved: never the reverse
    assert materialization_device(GPU, [GPU, GPU]) == GPU
    assert materialization_device(GPU, []) == GPU
    assert materialization_device(CPU, [CPU]) == CPU


def test_offload_is_read_from_what_fsdp_kwargs_handed_out():
    assert offloads([True, True, True], root_device=GPU, has_meta=True, strategy_name="S") is True
    assert offloads([False, False], root_device=GPU, has_meta=True, strategy_name="S") is False
    assert offloads([], root_device=GPU, has_meta=True, strategy_name="S") is False  # no fsdp_kwargs call
    # mixed, but fully_shard placed every shard itself (real tensors), or everything is on the CPU anyway
    assert offloads([True, False], root_device=GPU, has_meta=False, strategy_name="S") is False
    assert offloads([True, False], root_device=CPU, has_meta=True, strategy_name="S") is False


def test_mixed_offload_on_a_meta_model_is_refused_with_the_fix():
    with pytest.raises(
        ValueError,
        match=r"CPU offloading for 1 of its 3 `fsdp_kwargs` calls.*`S` cannot tell.*on cuda:0\. Offload all units or"
        r" none.*build the model on the CPU",
    ):
        offloads([False, True, False], root_device=GPU, has_meta=True, strategy_name="S")


def test_without_fsdp_modules_nothing_counts_as_an_offloaded_shard():
    """A plain module under ``offload=True``: every meta tensor goes to the root, and ``move_to_device`` moves all."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    materialize(model, CPU, offload=True)
    assert {t.device for t in (*model.parameters(), *model.buffers())} == {CPU}
    move_to_device(model, torch.device("meta"))  # "meta" stands in for another device
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers()))
