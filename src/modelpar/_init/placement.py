"""Where a set-up module's tensors live: the compute device, or host memory for the shards FSDP2 offloads.

FSDP2's ``CPUOffloadPolicy`` keeps a unit's sharded parameters (so also their gradients and optimizer state)
in CPU memory and copies each shard to the device for its all-gather. Its lazy initialization, at the first
forward, refuses a sharded parameter whose DTensor reports another device ("FSDP parameters should be
materialized on CPU when enabling CPU offloading"). Moving the local tensor afterwards does not help: when FSDP2
pins a shard it swaps the DTensor's local tensor for a pinned CPU copy, but the DTensor keeps reporting the
device it was created on. So the device must be right when the tensor is created:

* **Offloaded shards** (parameters ``fully_shard`` manages in a unit with ``CPUOffloadPolicy``) are
  materialized on the CPU, in ordinary memory, as torchtitan does. Pinning is FSDP2's: it pins each shard
  (``pin_memory=True``) when it re-registers the sharded parameters after allocation and at lazy init.
* **Everything else goes to the compute device**: buffers (FSDP2 never manages or offloads them, and the
  forward reads them on the device; ``fully_shard`` itself moves real buffers to the mesh's device), parameters
  of units without offloading and parameters outside any FSDP unit.

A meta-device model is therefore allocated on the CPU as soon as one tensor belongs there (allocating every
shard on the device first would need the very device memory offloading saves), and the rest is moved to the
compute device afterwards. Which parameters ``fully_shard`` manages is read from the module (DTensor
parameters at or below an ``FSDPModule``); whether their units offload is the strategy's record of the options
``fsdp_kwargs`` handed out, since FSDP2 has no public getter for a unit's policy.

The Trainer's ``model_to_device`` moves what is left off the compute device, but never a parameter
``fully_shard`` manages: those are where FSDP2 put them (Lightning's ``model.to(root_device)`` would move the
offloaded shards to the device and break them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from modelpar._init.full_size import own_tensors
from modelpar._init.materialize import has_meta_tensors, materialize_module

__all__ = ["materialization_device", "materialize", "move_to_device", "offloads", "tensor_device"]

CPU = torch.device("cpu")


def tensor_device(root_device: torch.device, *, offloaded_shard: bool) -> torch.device:
    """Where one tensor belongs: host memory for a shard FSDP2 offloads, the compute device for anything else."""
    return CPU if offloaded_shard else root_device


def materialization_device(root_device: torch.device, targets: Iterable[torch.device]) -> torch.device:
    """The one device meta tensors are allocated on: the CPU if any belongs there, else the compute device.

    Anything allocated on the CPU that belongs on the compute device is moved there afterwards; the reverse
    would first put every offloaded shard in device memory.
    """
    return CPU if any(t.type == "cpu" for t in targets) else root_device


def offloads(offloading: Sequence[bool], *, root_device: torch.device, has_meta: bool, strategy_name: str) -> bool:
    """Whether the parameters ``fully_shard`` manages are offloaded, from what each ``fsdp_kwargs`` call handed out.

    ``offloading`` has one entry per ``fsdp_kwargs`` call: whether it handed out a ``CPUOffloadPolicy``. Mixed
    calls (an override for some units) cannot be told apart on a meta-device model, whose parameters carry no
    trace of their unit's policy; on an accelerator that would put some shards on the wrong device, so it is
    refused here, identically on every rank, before anything is allocated. On the CPU every tensor lives in host
    memory anyway, and a model built on a real device was placed by ``fully_shard`` itself.
    """
    if all(offloading):
        return bool(offloading)
    if any(offloading) and has_meta and root_device.type != "cpu":
        raise ValueError(
            f"`fully_shard` got CPU offloading for {sum(offloading)} of its {len(offloading)} `fsdp_kwargs` calls, and"
            f" the model is on the meta device: `{strategy_name}` cannot tell which units' parameters belong in CPU"
            f" memory and which on {root_device}. Offload all units or none (the strategy's `cpu_offload`, without a"
            " per-call `offload_policy` override), or build the model on the CPU instead of the meta device so that"
            " `fully_shard` places each unit's shards itself."
        )
    return False


def _fsdp_parameters(module: nn.Module) -> set[int]:
    """The ids of the parameters ``fully_shard`` manages: DTensor parameters at or below an ``FSDPModule``."""
    found: set[int] = set()

    def visit(m: nn.Module, under_fsdp: bool) -> None:
        under_fsdp = under_fsdp or isinstance(m, FSDPModule)
        if under_fsdp:
            found.update(id(p) for p in m.parameters(recurse=False) if isinstance(p, DTensor))
        for child in m.children():
            visit(child, under_fsdp)

    visit(module, False)
    return found


def _own_tensors(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Every module's own parameters and buffers in ``module``, with their owner and attribute name."""
    return [(owner, name, t) for owner in module.modules() for name, t in own_tensors(owner)]


def _move(module: nn.Module, targets: dict[int, torch.device]) -> None:
    """Move the tensors whose ids are in ``targets``, through ``_apply`` on the root, like ``module.to``.

    ``_apply`` keeps parameter objects (tied parameters stay tied, and FSDP2 re-registers the sharded ones);
    a buffer shared by several modules is moved once, so it stays shared.
    """
    if not targets:
        return
    moved: dict[int, torch.Tensor] = {}

    def move(t: torch.Tensor) -> torch.Tensor:
        target = targets.get(id(t))
        if target is None or t.device == target:
            return t
        if id(t) not in moved:
            moved[id(t)] = t.to(target)
        return moved[id(t)]

    module._apply(move)


def materialize(
    module: nn.Module,
    root_device: torch.device,
    *,
    offload: bool,
    stage_roots: list[nn.Module] | None = None,
    absent: frozenset[int] = frozenset(),
) -> None:
    """Materialize ``module``'s meta tensors (see ``modelpar._init.materialize``), each where it belongs.

    With ``offload``, the shards ``fully_shard`` manages stay in CPU memory and the other meta tensors end on
    ``root_device``; tensors that were real before keep their device and values. Under pipeline parallelism
    ``stage_roots`` are this rank's stages (tensors are placed through them) and ``absent`` the ids of the modules
    other ranks hold, which stay on the meta device (``materialize_module``).
    """
    roots = stage_roots or [module]
    if not any(has_meta_tensors(root) for root in roots):
        return
    shards = set().union(*(_fsdp_parameters(root) for root in roots)) if offload else set()
    targets = {
        (id(owner), name): tensor_device(root_device, offloaded_shard=id(t) in shards)
        for root in roots
        for owner, name, t in _own_tensors(root)
        if t.is_meta
    }
    device = materialization_device(root_device, targets.values())
    materialize_module(module, device, allocate_through=stage_roots, absent=absent)
    for root in roots:
        _move(
            root,
            {
                id(t): targets[(id(owner), name)]
                for owner, name, t in _own_tensors(root)
                if (id(owner), name) in targets and targets[(id(owner), name)] != device
            },
        )


def move_to_device(module: nn.Module, root_device: torch.device) -> None:
    """Move every parameter and buffer to ``root_device``, except the ones ``fully_shard`` manages (and meta tensors).

    ``fully_shard`` put those where they belong: on the mesh's device, or in host memory when their unit offloads
    (also when only some units do), so the parameters it manages are observed, not decided. Like ``module.to``
    on FSDP modules, it first reshards every FSDP module, also when nothing moves: a module left unsharded (the
    root keeps its gathered parameters after an evaluation forward) registers its unsharded parameters, and an
    optimizer created next (the Trainer's, after ``model_to_device``) must get the shards.
    """
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    managed = _fsdp_parameters(module)
    _move(
        module,
        {
            id(t): root_device
            for _, _, t in _own_tensors(module)
            if id(t) not in managed and not t.is_meta and t.device != root_device
        },
    )
