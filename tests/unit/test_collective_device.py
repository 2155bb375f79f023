"""Where a tensor must be for a collective: the decision behind CPU offload under NCCL, checked without a GPU.

Clipping reduces its norm on the default group and ``save_pretrained`` gathers each shard on its mesh; both
ask :func:`collective_device`. The GPU suite runs the moves themselves (``cpu_offload`` under NCCL).
"""

import pytest
import torch

from modelpar._mesh.collective import collective_device, served_device_types


@pytest.fixture(autouse=True)
def _current_device_3(monkeypatch):
    # The current accelerator index, as a GPU process would have it after `torch.cuda.set_device(3)`.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.xpu, "current_device", lambda: 3)


@pytest.mark.parametrize(
    ("backend", "device", "expected"),
    [
        ("gloo", "cpu", "cpu"),
        ("gloo", "cuda:1", "cuda:1"),  # gloo reduces CUDA tensors too: no copy
        ("nccl", "cuda:2", "cuda:2"),
        ("nccl", "cpu", "cuda:3"),  # CPU-offloaded gradients go to the current CUDA device
        ("cpu:gloo,cuda:gloo", "cuda:1", "cuda:1"),  # what get_backend_config() says for "gloo"
        ("cpu:gloo,cuda:nccl", "cpu", "cpu"),
        ("cpu:gloo,cuda:nccl", "cuda:0", "cuda:0"),
        ("cuda:nccl", "cpu", "cuda:3"),  # what get_backend_config() says for "nccl"
        ("xccl", "cpu", "xpu:3"),
        ("my_backend", "cpu", "cpu"),  # a backend torch does not know is trusted with the tensor's device
    ],
)
def test_a_process_group_gets_tensors_on_a_device_its_backend_serves(backend, device, expected):
    device = torch.device(device)
    assert collective_device(device, served_device_types(backend, device)) == torch.device(expected)


@pytest.mark.parametrize(
    ("mesh_device_type", "local", "expected"),
    [
        ("cuda", "cpu", "cuda:3"),  # a CPU-offloaded shard on a CUDA (NCCL) mesh must move
        ("cuda", "cuda:3", "cuda:3"),  # already there: the same device, no copy
        ("cpu", "cpu", "cpu"),  # a gloo CPU mesh: no move
    ],
)
def test_a_shard_moves_to_its_mesh_device_only_when_it_is_elsewhere(mesh_device_type, local, expected):
    assert collective_device(torch.device(local), (mesh_device_type,)) == torch.device(expected)
