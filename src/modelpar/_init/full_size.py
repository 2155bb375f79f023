"""Running a module's initializers at full size on sharded (DTensor) tensors, keeping this rank's block.

An initializer written for one process (``reset_parameters()``, a root ``init_weights()``) runs on full-size
plain tensors, and each rank keeps its block of the result, cut by block arithmetic (:mod:`modelpar._init.blocks`,
FSDP2's own layout, ``_StridedShard`` of FSDP over TP included) as a ``narrow`` view and copied into the local
shard: nothing larger than one full-size tensor plus the local shard exists per tensor, and nothing is
communicated. Two ways in:

* :func:`run_hook` swaps a module's own DTensors for full-size stand-ins while its hook runs, so arbitrary code
  works on them; what the hook wrote goes into the shards afterwards.
* :class:`FullSizeInit`, a torch-function mode active during every hook, performs each in-place ``nn.init.*_``
  call and random ``Tensor`` method (``normal_``, ``uniform_`` ...) on another module's DTensor at full size.

A fused expert tensor (a 3-D DTensor ``[experts, rows, cols]``) is the exception in both: it gets a
one-element stand-in whose ops :class:`~modelpar._expert_blocks.BlockDraw` performs a few experts at a time,
with the values of one full draw, and falls back to the full size (from the same random state) where it cannot.

Full-size buffers come from a :class:`Scratch` pool that lives for one materialization: the kernel faults in
the pages of a fresh buffer on first touch, which (profiled at 2x2 on CPU) cost about as much as the draws
themselves when every tensor got a new one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

from modelpar._init.blocks import local_view
from modelpar._init.expert_blocks import BlockDraw, NotBlockwise, is_fused_experts, stand_in
from modelpar._init.unwritten import mark_unwritten, merge_written

__all__ = ["FullSizeInit", "Scratch", "device_rng", "own_tensors", "random_state", "run_hook"]

_RANDOM_TENSOR_METHODS = (
    "normal_",
    "uniform_",
    "bernoulli_",
    "exponential_",
    "log_normal_",
    "cauchy_",
    "geometric_",
    "random_",
)
#: In-place initializers a hook may call on another module's DTensor; each is run at full size instead.
#: (Of ``nn.init``, the torch-function mode sees only those that dispatch through ``__torch_function__``;
#: the others are plain Python over ``Tensor`` methods, whose random ones the mode sees one by one.)
_FULL_SIZE_FUNCTIONS: frozenset[Callable[..., Any]] = frozenset(
    [getattr(torch.Tensor, name) for name in _RANDOM_TENSOR_METHODS]
    + [getattr(nn.init, name) for name in dir(nn.init) if name.endswith("_") and not name.startswith("_")]
)
#: The same initializers recognised by name: libraries swap ``torch.nn.init``'s functions for guarded wrappers of
#: the same name while they initialize (Hugging Face's ``guard_torch_init_functions``), and ``nn.init``'s own
#: dispatch then hands the mode the wrapper, whose inner calls the mode (popped while it runs) would not see.
_FULL_SIZE_NAMES = frozenset(name for name in dir(nn.init) if name.endswith("_") and not name.startswith("_"))


def own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s own parameters and buffers (not its children's), by attribute name."""
    return list(itertools.chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False)))


class Scratch:
    """Reusable flat buffers for full-size stand-ins, per dtype and device, handed out as contiguous views.

    :meth:`take` gives the smallest free buffer that is large enough, or a new one (dropping the largest free one
    that is too small, so the pool holds no more buffers than were in use at once); :meth:`give` takes it back.
    A caller must not keep a view after giving it back: the next tensor is drawn into the same memory.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        # The flat buffer behind each view lent out, by address: ``view._base`` is not set on views made while a
        # dispatch mode (an allocation counter, ``CommDebugMode``) is active.
        self._lent: dict[int, torch.Tensor] = {}

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A contiguous tensor of ``like``'s (global) shape, dtype and device, with arbitrary contents."""
        return self.take_shape(like.shape, like.dtype, like.device)

    def take_shape(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous tensor of ``shape``, ``dtype`` and ``device``, with arbitrary contents."""
        numel = math.prod(shape)
        free = self._free.setdefault((dtype, device), [])
        sizes = [b.numel() for b in free]  # by position: tensors compare elementwise, not by identity
        fits = [i for i, size in enumerate(sizes) if size >= numel]
        if fits:
            buffer = free.pop(min(fits, key=sizes.__getitem__))
        else:
            if free:
                free.pop(max(range(len(free)), key=sizes.__getitem__))
            buffer = torch.empty(numel, dtype=dtype, device=device)
        view = buffer[:numel].view(shape)
        self._lent[view.data_ptr()] = buffer
        return view

    def give(self, view: torch.Tensor) -> None:
        """Return the buffer behind a view from :meth:`take`."""
        base = self._lent.pop(view.data_ptr(), None)
        if base is None:  # an empty view (address 0): nothing worth keeping
            return
        self._free.setdefault((base.dtype, base.device), []).append(base)


def _local_part(dtensor: DTensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's block of ``full`` as laid out in ``dtensor``, without communication.

    A view (``narrow`` per dim, the block FSDP2 holds, ``_StridedShard`` included): nothing is copied until the
    caller copies it into the shard. Only placements that block arithmetic does not cut fall back to
    ``distribute_tensor``, which builds the pieces of every rank first.
    """
    view = local_view(full.detach(), dtensor)
    if view is not None:
        return view
    return distribute_tensor(full.detach(), dtensor.device_mesh, dtensor.placements, src_data_rank=None).to_local()


def _slice_into(dtensor: DTensor, full: torch.Tensor) -> None:
    """Copy this rank's slice of ``full`` (written whole by an initializer) into ``dtensor``'s local shard."""
    with torch.no_grad():
        dtensor.to_local().copy_(_local_part(dtensor, full))


class FullSizeInit(TorchFunctionMode):
    """Runs in-place initializers on DTensors at full size on a plain tensor, then keeps this rank's slice.

    Handled at the outermost call: an ``nn.init`` function that dispatches here runs whole on the plain
    tensor (its inner calls then see no DTensor); one that does not dispatch is plain Python whose random
    ``Tensor`` methods arrive here one by one. Memory: one full-size tensor at a time, except for a fused
    expert tensor (:func:`~modelpar._expert_blocks.is_fused_experts`), which is drawn in blocks through
    ``blocks`` when the initializer allows (else at full size, from the same random state).
    """

    def __init__(self, scratch: Scratch, written: set[int], blocks: BlockDraw) -> None:
        super().__init__()
        self._scratch = scratch
        self._written = written
        self._blocks = blocks

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func in _FULL_SIZE_FUNCTIONS or getattr(func, "__name__", None) in _FULL_SIZE_NAMES:
            in_args = bool(args) and isinstance(args[0], DTensor)
            target = args[0] if in_args else kwargs.get("tensor")
            if isinstance(target, DTensor) and not target.is_meta:

                def call(full: torch.Tensor) -> None:
                    if in_args:
                        func(full, *args[1:], **kwargs)
                    else:
                        func(*args, **{**kwargs, "tensor": full})

                if is_fused_experts(target) and self._in_blocks(call, target):
                    return target
                full = self._scratch.take(target)
                call(full)
                _slice_into(target, full)
                self._written.add(id(target))
                self._scratch.give(full)
                return target
        return func(*args, **kwargs)

    def _in_blocks(self, call: Callable[[torch.Tensor], None], target: DTensor) -> bool:
        """Run ``call`` on a block-drawn stand-in of ``target``; ``False`` (random state restored) if refused."""
        stand = stand_in(target)
        restore = random_state(target.device)
        self._blocks.add(stand, target)
        try:
            call(stand)
        except NotBlockwise:
            pass
        finally:
            self._blocks.remove(stand)
        if self._blocks.refused(stand):  # raised, or raised and caught by the initializer
            restore()
            return False
        return True


def device_rng(device: torch.device) -> Any:
    """The module of ``device``'s random state (``torch.cuda`` ...), or None for the CPU or if it has none."""
    if device.type == "cpu":
        return None
    backend = getattr(torch, device.type, None)
    has_state = callable(getattr(backend, "get_rng_state", None)) and callable(getattr(backend, "set_rng_state", None))
    return backend if has_state else None


def random_state(device: torch.device) -> Callable[[], None]:
    """Capture the CPU random state and ``device``'s (:func:`device_rng`); returns what puts them back.

    A refused block draw may have drawn some blocks already, from either generator: the full-size run that
    follows starts from where the block run started, on every rank alike.
    """
    cpu = torch.get_rng_state()
    backend = device_rng(device)
    accelerator = backend.get_rng_state(device) if backend is not None else None

    def restore() -> None:
        torch.set_rng_state(cpu)
        if backend is not None:
            backend.set_rng_state(accelerator, device)

    return restore


def run_hook(
    module: nn.Module, hook: Callable[[], object], keep: tuple[str, ...], scratch: Scratch, written: set[int]
) -> None:
    """Run ``hook`` with ``module``'s own DTensors and its ``keep`` tensors behind stand-ins.

    A DTensor's stand-in is a full-size plain tensor whose block for this rank is filled with the unwritten
    marker (the rest holds whatever the scratch buffer held); afterwards what the hook wrote of the block goes
    into the DTensor (unless the tensor is in ``keep``), and the rest keeps its
    value (an earlier hook's, or the marker). A plain ``keep`` tensor's stand-in is a copy; the originals of
    ``keep`` come back untouched. A stand-in the hook replaced is left as the hook set it. Other modules'
    DTensors are handled by :class:`FullSizeInit`. The ids of DTensors written whole go into ``written``.

    A fused expert DTensor (:func:`~modelpar._expert_blocks.is_fused_experts`) gets a one-element stand-in that
    :class:`~modelpar._expert_blocks.BlockDraw` performs the hook's ops on, block by block. If the hook does
    something with it that cannot be done so, the random state (CPU, and the tensor's accelerator) is put back
    and the hook runs again with full-size stand-ins (its Python side effects happen twice; its tensors get the
    values of one run).
    """
    blocks = BlockDraw(scratch.take_shape, scratch.give, written)
    fused = tuple(name for name, t in own_tensors(module) if name not in keep and is_fused_experts(t))
    if fused:
        restore = random_state(getattr(module, fused[0]).device)
        try:
            if _run_hook(module, hook, keep, scratch, written, blocks, fused):
                return
        except NotBlockwise:
            pass
        restore()
    _run_hook(module, hook, keep, scratch, written, blocks, ())


def _run_hook(
    module: nn.Module,
    hook: Callable[[], object],
    keep: tuple[str, ...],
    scratch: Scratch,
    written: set[int],
    blocks: BlockDraw,
    in_blocks: tuple[str, ...],
) -> bool:
    """:func:`run_hook` with the ``in_blocks`` tensors drawn in blocks; ``False`` if :class:`BlockDraw` refused one."""
    swapped: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    drawn: list[torch.Tensor] = []  # the scratch views behind the DTensors' stand-ins
    block_drawn: list[torch.Tensor] = []  # the one-element stand-ins of the tensors drawn in blocks
    for name, t in own_tensors(module):
        if isinstance(t, DTensor) and name in in_blocks:
            data = stand_in(t)
            blocks.add(data, t)
            block_drawn.append(data)
        elif isinstance(t, DTensor):
            data = scratch.take(t)
            drawn.append(data)
            # Only this rank's block is merged back, so only it needs the marker (a quarter of the memory
            # traffic at 2x2); where the block is not a view of ``data``, the whole stand-in is marked.
            block = local_view(data, t)
            mark_unwritten(block if block is not None else data)
        elif name in keep:
            data = t.detach().clone()
        else:
            continue
        stand_in_ = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
        swapped[name] = (t, stand_in_)
        setattr(module, name, stand_in_)
    try:
        # ``blocks`` under ``FullSizeInit``: it sees what ``FullSizeInit`` passes on or runs on a stand-in.
        with blocks, FullSizeInit(scratch, written, blocks):
            hook()
    finally:
        filled: list[tuple[DTensor, torch.Tensor]] = []
        for name, (original, stand) in swapped.items():
            if name in keep or getattr(module, name) is stand:
                setattr(module, name, original)
                if name not in keep and name not in in_blocks and isinstance(original, DTensor):
                    filled.append((original, stand))
        for data in block_drawn:
            blocks.remove(data)
    refused = any(blocks.refused(data) for data in block_drawn)  # the hook caught the refusal: run it again
    for original, stand in filled if not refused else ():  # reached only when the hook returned
        if merge_written(original.to_local(), _local_part(original, stand)):
            written.add(id(original))
    for data in drawn:
        scratch.give(data)
    return not refused
