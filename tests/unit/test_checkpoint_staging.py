"""Staging decisions, asked on the CPU as a GPU run would ask them: pinned memory, CPU offload, what to copy.

The CUDA paths themselves (pinned buffers, non-blocking copies) run only in the GPU suite; here the pure
functions that decide them are asked with CUDA devices, and the copying decision with real tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from modelpar.checkpoint._staging import Staging, StagingMemory, live_storages, private_tensors, staging_memory
from modelpar.checkpoint._state import state_dict_options


def test_tensors_from_a_gpu_are_staged_into_pinned_memory_without_blocking_and_cpu_tensors_into_pageable():
    assert staging_memory(torch.device("cuda", 0)) == StagingMemory(pinned=True, non_blocking=True)
    assert staging_memory(torch.device("cuda")) == StagingMemory(pinned=True, non_blocking=True)
    assert staging_memory(torch.device("cpu")) == StagingMemory(pinned=False, non_blocking=False)


def test_sharded_state_is_taken_on_its_device_and_only_the_full_state_is_offloaded_to_the_cpu():
    sharded, full = state_dict_options(full=False), state_dict_options(full=True)
    assert not sharded.full_state_dict and not sharded.cpu_offload  # the stager copies once, from the device
    assert full.full_state_dict and full.cpu_offload  # gathered to rank 0's CPU, tensor by tensor


def test_only_tensors_sharing_memory_with_the_live_model_or_optimizer_are_copied_for_a_full_async_save():
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    live = live_storages([model], [optimizer])
    gathered = {k: v.clone() for k, v in model.state_dict().items()}  # what a gather of DTensors returns
    state = {"model": {**gathered, "bias": model.state_dict()["bias"]}, "optimizer": optimizer.state_dict()}
    private = private_tensors(state, live)
    assert private == {id(gathered["weight"])}  # the live bias, moments and `step` counters are not private

    stager = Staging()
    staged = stager.stage(state, private=private)
    assert staged["model"]["weight"] is gathered["weight"]  # written as it is
    assert staged["model"]["bias"] is not model.bias and torch.equal(staged["model"]["bias"], model.bias)
    moments = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
    assert stager.staged_bytes == model.bias.numel() * 4 + moments
