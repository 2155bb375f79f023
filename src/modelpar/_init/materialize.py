"""Meta-device materialization: allocate real storage for a (sharded) module and initialize it.

The idiom, written plainly: build the model under ``torch.device("meta")`` (no memory), shard it with
``parallelize_fn`` (still no memory), then :func:`materialize_module` allocates each rank's shard on the
real device and runs the model's own initialization code.

**Guarantee.** On every layout (any mix of FSDP2, HSDP and tensor parallelism, on any device type) each
rank ends up with its slice of the very model one process builds from the same random state, bit for bit.
For an ordinary model that is ``torch.manual_seed(s); Model(...)`` built eagerly: the initializers run in
the order the constructors would run them and draw full-size tensors, so they consume the global random
stream exactly as eager construction does (which also leaves the stream in the same state afterwards).
DTensor's own random ops cannot promise this: on CUDA they derive each shard from an offset into a shared
stream (not the values one process draws), and on CPU meshes they have no support at all (every shard
repeats one rank's draws).

"Bit for bit" holds against a one-process build on the device type materialization draws on (``device``: the
CPU under ``cpu_offload``), since CPU and CUDA generators draw different numbers from one seed.

**How** (:mod:`modelpar._init.full_size`). Each initializer runs on full-size plain tensors and every rank keeps its
block, cut as a view by the block arithmetic of :mod:`modelpar._init.blocks` (FSDP2's layout, ``_StridedShard`` of
FSDP over TP included), with no communication. A module's own DTensors are swapped for full-size stand-ins
while its ``reset_parameters()`` runs, so arbitrary code works on them. An initializer that reaches DTensors of
other modules (a parent's ``reset_parameters()``, the root hook) runs under a torch-function mode that performs
each in-place ``nn.init.*_`` call and random ``Tensor`` method (``normal_``, ``uniform_`` ...) on such a DTensor
at full size and copies this rank's block back. Memory per tensor: one reused full-size buffer beside the
shard; at most one module's own tensors at full size at once, plus one tensor; never the whole model. Time: on
the CPU every rank draws every full tensor, about what an eager one-process build costs.

**Fused expert tensors are drawn in blocks** (:mod:`modelpar._init.expert_blocks`). A 3-D DTensor ``[experts, rows,
cols]`` (a MoE layer's fused weights: 30 GB in fp32 for one of DeepSeek-V3's) never exists at full size: its
initializer runs on a one-element stand-in of the full shape, random fills are drawn along dim 0 a few experts at a
time (blocks of a multiple of 16 elements: 16 experts at most, one where an expert holds a multiple of 16 elements)
into one reused buffer, each rank keeping its part, and element-wise in-place ops with scalar operands run on the
shard. The values are one full draw's, bit for bit, because the CPU generator consumes its stream element by element
(``normal_`` 16 at a time). On CUDA (Philox: a block's draw is not the full draw's part) the blocks give one
coherent model, the same on every layout, but not an eager CUDA build's values for these tensors (the exception to
the guarantee above; ``cpu_offload`` initializes on the CPU, bit for bit). An initializer that does anything else
with the tensor (a copy from another tensor, a write through a view, orthogonal's QR, a random op with its own
``generator``) is refused before it draws: the random state is put back and the tensor is drawn at full size (a
module's own ``reset_parameters()`` then runs a second time, so its Python side effects happen twice).

**Unwritten tensors are named** (:mod:`modelpar._init.unwritten`). Allocated tensors and stand-ins are filled with
a marker first; a stand-in's unwritten elements do not overwrite the shard, and whatever still holds the marker
at the end is named (module path, tensor, class) in one rank-0 warning, with every rank's report gathered.
Tracked writes rather than assumed coverage: a parent's ``reset_parameters()`` that skips a child's tensor is
caught too.

**Order.** Modules are visited children first, then their parent (siblings in registration order), and
``reset_parameters()`` is called on every module that defines it, even on one without tensors of its own,
so a parent that customizes its children's initialization wins over their defaults. Last comes the
**root hook**: if the root module defines a callable ``init_weights()`` (the torchtitan and Hugging Face
convention), it is called with no arguments, and its values win over everything before it.

**Real tensors are kept.** Only meta tensors are allocated (through ``module._apply`` on the root, so
FSDP2's bookkeeping is updated and tied tensors stay tied); tensors that were already real (loaded or
trained weights) keep their values bit for bit. A module's own ``reset_parameters()`` runs if any of its own
tensors was on the meta device, and its real ones are restored afterwards. A hook that would reach other
modules' tensors runs only when its whole subtree was on the meta device (it could otherwise overwrite
real weights); when it is skipped for that reason a rank-0 warning names it. A module with no meta tensor
in its subtree is not touched. So a set-up, trained module that gains a new submodule on the meta device
can be materialized again: only the new part is initialized.

**Ranks agree on the random state.** Every rank must draw the same full-size tensors, or the slices would
come from different models. With a process group of more than one rank, a digest of the CPU random state
(and of the target device's) is compared across ranks first. If all agree (the user seeded every rank
alike), initialization draws from the global stream as eager construction would. If they differ (nobody
seeded), rank 0's states are broadcast and used inside ``torch.random.fork_rng``, so the model is still one
coherent model, each rank's own stream is left as it was, and a rank-0 warning asks for a seed.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from modelpar._init.full_size import Scratch, device_rng, own_tensors, run_hook
from modelpar._init.unwritten import mark_unwritten, unwritten_mask
from modelpar._rank_zero import rank_zero_warn

__all__ = ["has_meta_tensors", "materialize_module"]


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` (recursively) lives on the meta device."""
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


@dataclass(frozen=True)
class _Node:
    """One module as it was before allocation: which of its own tensors were meta, and what lies below."""

    path: str
    module: nn.Module
    meta_names: tuple[str, ...]  # own tensors on the meta device
    real_names: tuple[str, ...]  # own tensors already real
    reaches_others: bool  # some descendant owns tensors, so a hook here may touch them
    subtree_meta: bool  # some tensor in the subtree (own included) is on the meta device
    real_example: str | None  # the path of a real tensor in the subtree, if any

    @property
    def label(self) -> str:
        return (
            f"`{self.path}` ({type(self.module).__name__})" if self.path else f"the root {type(self.module).__name__}"
        )


def _plan(root: nn.Module) -> list[_Node]:
    """Every module once, children before their parent, siblings in registration order."""
    nodes: list[_Node] = []
    below: dict[int, tuple[bool, bool, str | None]] = {}  # id -> (owns tensors, has meta, a real tensor's path)

    def visit(module: nn.Module, path: str) -> None:
        below[id(module)] = (False, False, None)  # marks it visited; a shared module is walked once
        for name, child in module.named_children():
            if id(child) not in below:
                visit(child, f"{path}.{name}" if path else name)
        own = own_tensors(module)
        meta = tuple(n for n, t in own if t.is_meta)
        real = tuple(n for n, t in own if not t.is_meta)
        children = [below[id(c)] for c in module.children()]
        reaches = any(c[0] for c in children)
        subtree_meta = bool(meta) or any(c[1] for c in children)
        example = (f"{path}.{real[0]}" if path else real[0]) if real else next((c[2] for c in children if c[2]), None)
        below[id(module)] = (bool(own) or reaches, subtree_meta, example)
        nodes.append(_Node(path, module, meta, real, reaches, subtree_meta, example))

    visit(root, "")
    return nodes


def _allocate(module: nn.Module, device: torch.device) -> None:
    """Give every meta tensor storage on ``device``; leave real ones as they are.

    Through ``_apply`` on the root, like ``to_empty``: FSDP2's override re-registers its sharded parameters.
    A tensor shared by several modules is allocated once; ``_apply`` wraps a plain parameter that changes
    device in a new ``Parameter`` per module, so the owners are pointed back at one object afterwards.
    """
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in module.modules():
        for name, t in own_tensors(owner):
            owners.setdefault(id(t), []).append((owner, name))
    shared_ids = {key for key, found in owners.items() if len(found) > 1}
    allocated: dict[int, torch.Tensor] = {}  # shared tensors only, so nothing else outlives its swap

    def fresh(t: torch.Tensor) -> torch.Tensor:
        new = torch.empty_like(t, device=device)
        mark_unwritten(new)  # what no initializer overwrites is found (and named) afterwards
        return new

    def allocate(t: torch.Tensor) -> torch.Tensor:
        if not t.is_meta:
            return t
        if id(t) not in shared_ids:
            return fresh(t)
        if id(t) not in allocated:
            allocated[id(t)] = fresh(t)
        return allocated[id(t)]

    module._apply(allocate)
    for (first, first_name), *others in (o for o in owners.values() if len(o) > 1):
        shared = getattr(first, first_name)
        for owner, name in others:
            if getattr(owner, name) is not shared:
                setattr(owner, name, shared)


@contextmanager
def _ranks_agree_on_rng(device: torch.device) -> Iterator[None]:
    """Make every rank draw the same numbers: as they are if the ranks agree, else rank 0's, in a fork."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        yield
        return
    backend = device_rng(device)
    states = [torch.get_rng_state()] + ([backend.get_rng_state(device)] if backend is not None else [])
    digest = hashlib.sha256(b"".join(s.cpu().numpy().tobytes() for s in states)).hexdigest()
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) == 1:
        yield
        return
    payload: list[Any] = [states]
    dist.broadcast_object_list(payload, src=0)
    rank_zero_warn(
        f"The ranks had different random states ({len(set(digests))} distinct among {len(digests)} ranks) when"
        " the model's meta-device tensors were initialized, so rank 0's state was used on every rank to build"
        " one coherent model. For a reproducible model, call `lightning.seed_everything(seed)` (or"
        " `torch.manual_seed(seed)`) with the same seed on every rank before creating it."
    )
    devices = [device] if backend is not None else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.set_rng_state(payload[0][0])
        if backend is not None:
            backend.set_rng_state(payload[0][1], device)
        yield


@contextmanager
def _drawn_for_nothing(modules: list[nn.Module], device: torch.device) -> Iterator[None]:
    """Give the meta tensors of ``modules`` (absent modules: another pipeline stage's) throwaway storage on
    ``device`` while a hook runs, so it draws what it would draw in one process; put the meta tensors back after."""
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    for module in modules:
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for table in tables:
            for name, t in list(table.items()):
                if t is not None and t.is_meta:
                    real = torch.empty_like(t, device=device)
                    swapped.append((table, name, t))
                    table[name] = nn.Parameter(real, t.requires_grad) if isinstance(t, nn.Parameter) else real
    try:
        yield
    finally:
        for table, name, t in swapped:
            table[name] = t


def _own_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for _, t in own_tensors(module))


def _initialize(
    root: nn.Module, nodes: list[_Node], absent: frozenset[int] = frozenset(), device: torch.device | None = None
) -> set[int]:
    """Run the hooks children first, then the root hook; warn about the hooks skipped.

    ``absent``: ids of modules that are not on this rank (other pipeline stages'). Their hooks still run, on
    throwaway storage, so the random stream advances as in one process and this rank's modules get the values
    one process gives them; a present module's hook that reaches absent ones gets them the same way.
    Returns the ids of the DTensors known to be written whole (they need no check for the marker).
    """
    skipped: list[str] = []
    scratch = Scratch()  # full-size buffers, reused from hook to hook
    written: set[int] = set()
    throwaway = device if device is not None else torch.device("cpu")

    # Throwaway storage for one hook at a time, at most the largest module's own tensors: a hook that reaches more of
    # the absent modules (a root `init_weights()` over the whole model) would put the other stages on this rank, so
    # their tensors stay on the meta device for it (its draws for them are skipped, and a warning says what that costs).
    budget = max((_own_bytes(m) for m in root.modules()), default=0)
    undrawn: list[str] = []

    def absent_below(node: _Node) -> list[nn.Module]:
        if not absent:
            return []
        below = node.module.modules() if node.reaches_others else iter((node.module,))
        found = [m for m in below if id(m) in absent]
        if sum(_own_bytes(m) for m in found) > budget:
            undrawn.append(node.label)
            return []
        return found

    for node in nodes:
        reset = getattr(node.module, "reset_parameters", None)
        if not node.subtree_meta or not callable(reset):
            continue
        if node.reaches_others and node.real_example is not None:
            skipped.append(_skip_message(node, "reset_parameters"))
            continue
        with _drawn_for_nothing(absent_below(node), throwaway):
            run_hook(node.module, reset, keep=node.real_names, scratch=scratch, written=written)
    root_node = nodes[-1]
    init_weights = getattr(root, "init_weights", None)
    if callable(init_weights):
        if root_node.real_example is not None:
            skipped.append(_skip_message(root_node, "init_weights"))
        else:
            with _drawn_for_nothing(absent_below(root_node), throwaway):
                run_hook(root, init_weights, keep=(), scratch=scratch, written=written)
    if undrawn:
        rank_zero_warn(
            f"Under pipeline parallelism {', '.join(undrawn[:3])} initialize(s) modules of other stages too, which"
            " this rank does not allocate; their random draws were skipped, so this rank's weights are a valid"
            " initialization but not the values one process gives them. Load pretrained weights or a checkpoint"
            " (as for a Hugging Face model), or give the modules their own `reset_parameters()`."
        )
    if skipped:
        rank_zero_warn(
            "Meta-device initialization skipped hooks that would overwrite real tensors:\n"
            + "\n".join(f"- {s}" for s in skipped)
        )
    return written


def _unwritten_report(nodes: list[_Node], written: set[int]) -> list[tuple[str, str, int, int]]:
    """(tensor path, module class, elements unwritten, elements) of this rank's shards no initializer fully wrote.

    Tensors in ``written`` (ids of DTensors written whole) are skipped.
    """
    report: list[tuple[str, str, int, int]] = []
    seen: set[int] = set()
    for node in nodes:
        for name in node.meta_names:
            t = getattr(node.module, name, None)
            if not isinstance(t, torch.Tensor) or id(t) in seen or id(t) in written or t.is_meta:
                continue
            seen.add(id(t))  # a tied tensor is named once, at its first owner
            mask = unwritten_mask(t)
            count = int(mask.sum()) if mask is not None else 0
            if count:
                path = f"{node.path}.{name}" if node.path else name
                report.append(
                    (
                        path,
                        type(node.module).__name__,
                        count,
                        t.to_local().numel() if isinstance(t, DTensor) else t.numel(),
                    )
                )
    return report


def _warn_unwritten(nodes: list[_Node], written: set[int]) -> None:
    """Name, on rank 0, every allocated tensor that no initializer wrote (wholly or partly) on any rank.

    Each rank checks its own shards for the marker; with several ranks the (usually empty) reports are
    gathered, so a tensor unwritten only in another rank's shard is named too.
    """
    reports = [_unwritten_report(nodes, written)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, reports[0])
        reports = gathered
    totals: dict[str, tuple[str, int, int]] = {}
    for report in reports:
        for path, cls, count, numel in report:
            _, seen_count, seen_numel = totals.get(path, (cls, 0, 0))
            totals[path] = (cls, seen_count + count, seen_numel + numel)
    if not totals:
        return
    listed = [f"`{path}` ({cls}{'' if count == numel else ', partly'})" for path, (cls, count, numel) in totals.items()]
    classes = ", ".join(dict.fromkeys(cls for cls, _, _ in totals.values()))
    rank_zero_warn(
        "Parameter initialization incomplete: no initializer wrote these tensors, so they hold NaN (a marker,"
        f" for integers the smallest value) instead of values: {', '.join(listed)}. Their modules define no"
        " `reset_parameters()`, or a parent's `reset_parameters()` (or the root's `init_weights()`) that runs"
        " instead does not initialize them. Initialize them in one of those, or load a checkpoint before"
        f" training. The modules holding them need a `reset_parameters()` method for re-initialization: {classes}."
    )


def _skip_message(node: _Node, hook: str) -> str:
    own = f" Its own meta tensors {list(node.meta_names)} were left uninitialized." if node.meta_names else ""
    return (
        f"{node.label}.{hook}() was not called: it may re-initialize its submodules' tensors, and"
        f" `{node.real_example}` among them is already real (loaded or trained weights would be lost). The"
        f" submodules' own `reset_parameters()` ran instead.{own} Build the whole module on the meta device"
        " to have it run, or load a checkpoint for it."
    )


def _owner(module: nn.Module, name: str) -> nn.Module:
    return module.get_submodule(name.rpartition(".")[0])


def _meta_tensor_names(module: nn.Module) -> list[str]:
    names = [n for n, p in module.named_parameters() if p.is_meta]
    return names + [n for n, b in module.named_buffers() if b.is_meta]


def materialize_module(
    module: nn.Module,
    device: torch.device,
    *,
    allocate_through: list[nn.Module] | None = None,
    absent: frozenset[int] = frozenset(),
) -> None:
    """Allocate every meta tensor of ``module`` on ``device`` and initialize it; keep real tensors as they are.

    Calls ``reset_parameters()`` children first, then ``module.init_weights()`` if the root defines it (see
    the module docstring for the order, the guarantee and when a hook is skipped). With a process group of
    several ranks, all ranks must call it (the ranks' random states are compared first, and what was left
    unwritten is gathered last). Every tensor that no initializer wrote, wholly or partly, is named with its
    module in a rank-0 warning; it holds a NaN marker (see :mod:`modelpar._init.unwritten`), not stray memory.
    ``device`` may be any device (the CPU under ``cpu_offload``, the accelerator otherwise).

    Under pipeline parallelism ``module`` is the whole model, still on the meta device in the parts other ranks
    hold: ``absent`` are the ids of those modules (left on the meta device; their hooks run on throwaway storage,
    one at a time, so this rank's stages get the values one process gives them), and ``allocate_through`` the
    roots of this rank's stages, through which the tensors are allocated (each is its stage's root FSDP unit). Raises
    ``RuntimeError`` naming any tensor still on the meta device afterwards (a ``reset_parameters`` that
    re-created a tensor on meta, for example), since training on it would fail far from the cause.
    """
    if not has_meta_tensors(module):
        return
    nodes = _plan(module)
    for root in allocate_through or [module]:
        _allocate(root, device)
    with _ranks_agree_on_rng(device):
        written = _initialize(module, nodes, absent, device)
    still_meta = [name for name in _meta_tensor_names(module) if id(_owner(module, name)) not in absent]
    if still_meta:
        raise RuntimeError(
            f"After materialization, {len(still_meta)} tensor(s) are still on the meta device:"
            f" {', '.join(still_meta[:10])}{' ...' if len(still_meta) > 10 else ''}. A `reset_parameters()`"
            " probably re-created them on the meta device; make it fill the existing tensors in place"
            " (e.g. `nn.init.*` or `tensor.copy_`)."
        )
    _warn_unwritten(nodes, written)
