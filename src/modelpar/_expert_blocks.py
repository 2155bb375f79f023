"""Drawing a fused ``[experts, ...]`` tensor a few experts at a time, with the values of one full draw.

A MoE layer's experts are often one fused parameter, ``[n_experts, rows, cols]`` (``GroupedExperts.w1``, Hugging
Face's ``gate_up_proj``): DeepSeek-V3's is 30 GB in fp32. :mod:`modelpar._full_size` initializes a sharded tensor
by drawing it whole on a full-size buffer; for these it would hold the whole fused tensor on every rank. Instead
such a tensor's initializer runs on a **stand-in** of the full shape backed by one element (an ``expand``), under
:class:`BlockDraw`, a dispatch mode that performs each operation on it without ever building it:

* a random fill (``uniform_``, ``normal_``, ``bernoulli_`` with a float ``p`` ...) is drawn along dim 0 in blocks
  of whole experts, one reused buffer, in order; each rank copies the part of each block inside its shard;
* an element-wise in-place op with scalar operands (``mul_``, ``add_``, ``clamp_``, ``erfinv_``, ``fill_``,
  ``zero_`` ..., what ``trunc_normal_`` and the constant initializers do) runs on the shard directly;
* views that read only the shape (``.data``, the fan-in arithmetic of ``kaiming_*``) pass.

Anything else (a copy from another tensor, a write through a view, a read of the values, orthogonal's QR, a
random op with its own ``generator``) raises :class:`NotBlockwise` before it draws; the caller restores the
CPU random state and draws that tensor at full size, as before.

**Why the values are one full draw's (CPU only).** The CPU generator (mt19937) hands out numbers in element
order: every one of torch 2.13's CPU random fills above consumes them element by element, except ``normal_``,
which fills a tensor of 16 or more elements 16 at a time (Box-Muller on 8 pairs) and redraws the last 16 when
the size is not a multiple of 16. So a block holds a multiple of 16 elements (``16 / gcd(16, rows * cols)``
experts, at most 16) and the short remainder joins the last block: block by block, the stream is consumed
exactly as by one draw, which is checked bit for bit in the tests. Element-wise ops give the same bits on any
slice. CUDA's Philox generator derives each element from the launch's offset and the thread's index, so a
block's draw is not the matching part of the full draw: on other device types :func:`draws_in_blocks` is
``False`` and the tensor is drawn at full size, keeping the values of a one-process build.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode  # torch's home of dispatch modes (no public alias)

from modelpar._blocks import shard_block

__all__ = ["BlockDraw", "NotBlockwise", "draws_in_blocks", "expert_blocks", "is_fused_experts", "stand_in"]

aten = torch.ops.aten

#: Random fills whose CPU draws, split along dim 0 into blocks of a multiple of 16 elements, equal one draw.
_RANDOM = frozenset(
    [aten.uniform_, aten.normal_, aten.exponential_, aten.log_normal_, aten.cauchy_, aten.geometric_, aten.random_]
)
#: ``bernoulli_`` only with a float probability (a tensor of probabilities is a second operand).
_RANDOM_OVERLOADS = frozenset([aten.bernoulli_.float])
#: In-place ops where each element depends on itself and scalars only: the same bits on the shard as on the whole.
_ELEMENTWISE = frozenset(
    [
        aten.zero_,
        aten.fill_,
        aten.mul_,
        aten.div_,
        aten.add_,
        aten.sub_,
        aten.clamp_,
        aten.clamp_min_,
        aten.clamp_max_,
        aten.erfinv_,
        aten.neg_,
        aten.abs_,
        aten.exp_,
        aten.sqrt_,
        aten.pow_,
    ]
)
#: Ops that make another view of a stand-in: harmless until the view is written or read, which is refused.
_VIEWS = frozenset([aten.detach, aten.alias, aten.select, aten.slice, aten.view, aten.t, aten.transpose, aten.permute])


class NotBlockwise(Exception):
    """An initializer did something to a fused tensor that cannot be performed block by block."""


def draws_in_blocks(device: torch.device) -> bool:
    """Whether random fills on ``device`` split along dim 0 into the values of one draw: the CPU generator only."""
    return device.type == "cpu"


def is_fused_experts(t: torch.Tensor) -> bool:
    """A sharded 3-D tensor ``[experts, rows, cols]`` on a device whose draws split, with a block this rank can cut.

    Fused expert weights are the 3-D parameters of the models we know (``GroupedExperts``, Hugging Face's experts
    folders); any other 3-D DTensor (a ``Conv1d`` weight) is drawn in blocks too, which gives the same values.
    """
    return (
        isinstance(t, DTensor)
        and t.ndim == 3
        and t.numel() > 0
        and not t.is_meta
        and draws_in_blocks(t.device)
        and shard_block(t) is not None
    )


def expert_blocks(n_experts: int, per_expert: int) -> list[tuple[int, int]]:
    """(first expert, experts) of each block: a multiple of 16 elements, the remainder joined to the last block."""
    step = 16 // math.gcd(16, per_expert) if per_expert else 1
    starts = list(range(0, n_experts, step))
    if len(starts) > 1 and n_experts - starts[-1] < step:
        starts.pop()
    ends = [*starts[1:], n_experts]
    return [(start, end - start) for start, end in zip(starts, ends, strict=True)]


def stand_in(target: DTensor) -> torch.Tensor:
    """A plain tensor of ``target``'s full shape, dtype and device backed by a single element (an ``expand``)."""
    return torch.empty(1, dtype=target.dtype, device=target.to_local().device).expand(target.shape)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    return []


class BlockDraw(TorchDispatchMode):
    """Performs the ops on registered stand-ins on their DTensors' shards, drawing random fills in blocks.

    ``take``/``give`` lend and take back a block's buffer (a :class:`~modelpar._full_size.Scratch`'s). The ids of
    the DTensors written whole go into ``written``.
    """

    def __init__(
        self,
        take: Callable[[torch.Size, torch.dtype, torch.device], torch.Tensor],
        give: Callable[[torch.Tensor], None],
        written: set[int],
    ) -> None:
        super().__init__()
        self._take = take
        self._give = give
        self._written = written
        self._targets: dict[int, tuple[torch.Tensor, DTensor]] = {}  # storage address -> (stand-in, DTensor)
        self._refused: set[int] = set()  # storage addresses of stand-ins an op was refused on

    def add(self, stand: torch.Tensor, target: DTensor) -> None:
        """Perform the ops on ``stand`` (from :func:`stand_in`) on ``target``'s shard from now on."""
        address = stand.untyped_storage().data_ptr()
        self._targets[address] = (stand, target)
        self._refused.discard(address)

    def refused(self, stand: torch.Tensor) -> bool:
        """Whether an op on ``stand`` was refused (:class:`NotBlockwise`), even if the initializer caught it."""
        return stand.untyped_storage().data_ptr() in self._refused

    def remove(self, stand: torch.Tensor) -> None:
        self._targets.pop(stand.untyped_storage().data_ptr(), None)

    def _target_of(self, t: torch.Tensor) -> tuple[torch.Tensor, DTensor] | None:
        if isinstance(t, DTensor) or not self._targets:
            return None
        try:
            return self._targets.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # a tensor without storage (another subclass)
            return None

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        hits = [t for t in _tensors(list(args)) + _tensors(list(kwargs.values())) if self._target_of(t) is not None]
        if not hits:
            return func(*args, **kwargs)
        try:
            return self._perform(func, hits, args, kwargs)
        except NotBlockwise:
            self._refused.update(t.untyped_storage().data_ptr() for t in hits)
            raise

    def _perform(self, func: Any, hits: list[torch.Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        packet = func.overloadpacket
        if packet in _VIEWS:
            try:
                return func(*args, **kwargs)
            except RuntimeError as error:  # ``view`` of an ``expand``: the whole tensor would allow it
                raise NotBlockwise(f"{func} of a fused expert tensor's stand-in") from error
        first = args[0] if args else None
        found = self._target_of(first) if isinstance(first, torch.Tensor) else None
        others = _tensors(list(args[1:])) + _tensors(list(kwargs.values()))
        if (
            found is None
            or not isinstance(first, torch.Tensor)
            or len(hits) != 1
            or (first.shape, first.stride(), first.storage_offset())
            != (found[0].shape, found[0].stride(), found[0].storage_offset())
            or any(t.ndim > 0 for t in others)
        ):  # not an op on exactly the whole stand-in with scalar operands
            raise NotBlockwise(f"{func} on a fused expert tensor")
        target = found[1]
        if packet in _RANDOM or func in _RANDOM_OVERLOADS:
            if kwargs.get("generator") is not None:
                raise NotBlockwise(f"{func} with a generator of its own")
            self._draw(func, target, args[1:], kwargs)
        elif packet in _ELEMENTWISE:
            with torch.no_grad():
                func(target.to_local(), *args[1:], **kwargs)
        else:
            raise NotBlockwise(f"{func} on a fused expert tensor")
        if packet in _RANDOM or packet in (aten.zero_, aten.fill_) or func in _RANDOM_OVERLOADS:
            self._written.add(id(target))
        return first

    def _draw(self, func: Any, target: DTensor, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Draw ``target``'s full tensor block by block, in order; copy each block's part of this rank's shard."""
        block = shard_block(target)
        if block is None:
            raise NotBlockwise("a placement without block arithmetic")
        local = target.to_local()
        (first_row, rows), *others = block
        shape = target.shape
        for start, count in expert_blocks(shape[0], math.prod(shape[1:])):
            buffer = self._take(torch.Size([count, *shape[1:]]), target.dtype, local.device)
            func(buffer, *rest, **kwargs)
            low, high = max(start, first_row), min(start + count, first_row + rows)
            if low < high:
                part = buffer.narrow(0, low - start, high - low)
                for dim, (begin, length) in enumerate(others, start=1):
                    part = part.narrow(dim, begin, length)
                with torch.no_grad():
                    local.narrow(0, low - first_row, high - low).copy_(part)
            self._give(buffer)
