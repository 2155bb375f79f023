"""Drawing a fused ``[experts, ...]`` tensor a few experts at a time, with the values of one full draw.

A MoE layer's experts are often one fused parameter, ``[n_experts, rows, cols]`` (``GroupedExperts.w1``, Hugging
Face's ``gate_up_proj``): DeepSeek-V3's is 30 GB in fp32. :mod:`modelpar._init.full_size` initializes a sharded tensor
by drawing it whole on a full-size buffer; for these it would hold the whole fused tensor on every rank. Instead
such a tensor's initializer runs on a **stand-in** of the full shape backed by one element (an ``expand``), under
:class:`BlockDraw`, a torch-function mode (:class:`torch.overrides.TorchFunctionMode`, public) that performs
each call on it without ever building it:

* a random fill (``uniform_``, ``normal_``, ``bernoulli_`` with a float ``p`` ...) is drawn along dim 0 in blocks
  of whole experts, one reused buffer, in order; each rank copies the part of each block inside its shard;
* an element-wise in-place op with scalar operands (``mul_``, ``add_``, ``clamp_``, ``erfinv_``, ``fill_``,
  ``zero_`` ..., what ``trunc_normal_`` and the constant initializers do) runs on the shard directly;
* views that read only the shape (``.data``, the fan-in arithmetic of ``kaiming_*``) pass.

Anything else (a copy from another tensor, a write through a view, a read of the values, orthogonal's QR, a
random op with its own ``generator``) raises :class:`NotBlockwise` before it draws; the caller restores the
CPU random state and draws that tensor at full size, as before.

**What a torch-function mode sees.** Calls arrive before dispatch, as the ``Tensor`` methods and functions the
initializer wrote (``Tensor.normal_``, ``Tensor.data.__get__``, ``Tensor.__imul__`` ...), so stand-ins and their
views are told apart by storage address. A Python function that hands itself to the mode whole (its body runs
with the mode off, unseen) can only be recognised: of ``nn.init``, ``uniform_``, ``normal_``, ``constant_`` and
``kaiming_uniform_`` do so and are performed as the ``Tensor`` method each ends in (``kaiming_uniform_``'s bound
computed as torch computes it); any other such function on a stand-in (a library's own, dispatching initializer)
is refused, so that tensor is drawn at full size. ``nn.init``'s other functions are plain Python whose calls
arrive one by one.

**Why the values are one full draw's (CPU only).** The CPU generator (mt19937) hands out numbers in element
order: every one of torch 2.13's CPU random fills above consumes them element by element, except ``normal_``,
which fills a tensor of 16 or more elements 16 at a time (Box-Muller on 8 pairs) and redraws the last 16 when
the size is not a multiple of 16. So a block holds a multiple of 16 elements (``16 / gcd(16, rows * cols)``
experts, at most 16) and the short remainder joins the last block: block by block, the stream is consumed
exactly as by one draw, which is checked bit for bit in the tests. Element-wise ops give the same bits on any
slice. CUDA's Philox generator derives each element from the launch's offset and the thread's index, so a
block's draw is not the matching part of the full draw (:func:`blocks_equal_one_draw` is ``False`` there). The
tensor is drawn in blocks anyway: a full fused tensor can be tens of GB, and the issue this serves puts memory
first. Every rank draws the same blocks in the same order, so the model is still one coherent model and the same
on every layout; only its fused tensors' values differ from an eager one-process CUDA build.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from modelpar._init.blocks import shard_block

__all__ = ["BlockDraw", "NotBlockwise", "blocks_equal_one_draw", "expert_blocks", "is_fused_experts", "stand_in"]

#: Random fills whose CPU draws, split along dim 0 into blocks of a multiple of 16 elements, equal one draw
#: (``bernoulli_`` only with a float probability: a tensor of probabilities is a second operand).
_RANDOM: frozenset[Callable[..., Any]] = frozenset(
    getattr(torch.Tensor, name)
    for name in (
        "uniform_",
        "normal_",
        "exponential_",
        "log_normal_",
        "cauchy_",
        "geometric_",
        "random_",
        "bernoulli_",
    )
)
#: In-place ops where each element depends on itself and scalars only: the same bits on the shard as on the whole.
#: The in-place operators (``t *= 2``) arrive as themselves and run as the method they stand for.
_ELEMENTWISE: dict[Callable[..., Any], Callable[..., Any]] = {
    **{
        getattr(torch.Tensor, name): getattr(torch.Tensor, name)
        for name in (
            "zero_",
            "fill_",
            "mul_",
            "div_",
            "add_",
            "sub_",
            "clamp_",
            "clamp_min_",
            "clamp_max_",
            "erfinv_",
            "neg_",
            "abs_",
            "exp_",
            "sqrt_",
            "pow_",
        )
    },
    torch.Tensor.__imul__: torch.Tensor.mul_,
    torch.Tensor.__itruediv__: torch.Tensor.div_,
    torch.Tensor.__iadd__: torch.Tensor.add_,
    torch.Tensor.__isub__: torch.Tensor.sub_,
}
#: Calls that make another view of a stand-in (the result must share its memory: ``reshape`` of an ``expand``
#: or indexing with a list copies, which reads the values): harmless until the view is written or read.
_VIEWS: frozenset[Callable[..., Any]] = frozenset(
    getattr(torch.Tensor, name)
    for name in ("detach", "__getitem__", "view", "view_as", "t", "transpose", "permute", "select", "narrow")
)
#: Reads of the metadata only (a property's ``__get__``, ``.data`` and ``.T`` included, passes too): the dispatch
#: level never saw them; ``untyped_storage`` and ``data_ptr`` are how stand-ins are told apart.
_METADATA: frozenset[Callable[..., Any]] = frozenset(
    getattr(torch.Tensor, name)
    for name in (
        "dim",
        "size",
        "numel",
        "nelement",
        "stride",
        "storage_offset",
        "is_contiguous",
        "is_floating_point",
        "is_complex",
        "element_size",
        "get_device",
        "untyped_storage",
        "data_ptr",
        "requires_grad_",
        "__len__",
        "__hash__",
    )
)
#: ``nn.init``'s functions that hand themselves to the mode whole (their inner calls are not seen), as the
#: ``Tensor`` method they end in: ``(method, its positional scalars, generator)`` from their keyword arguments,
#: which is how their own dispatch passes them (under the name of a library's wrapper, too: see
#: :mod:`modelpar._init.full_size`).
_WHOLE_INITIALIZERS: dict[str, tuple[frozenset[str], Callable[[dict[str, Any]], tuple[Any, tuple[Any, ...]]]]] = {
    "uniform_": (
        frozenset(["tensor", "a", "b", "generator"]),
        lambda kw: (torch.Tensor.uniform_, (kw["a"], kw["b"])),
    ),
    "normal_": (
        frozenset(["tensor", "mean", "std", "generator"]),
        lambda kw: (torch.Tensor.normal_, (kw["mean"], kw["std"])),
    ),
    "constant_": (frozenset(["tensor", "val"]), lambda kw: (torch.Tensor.fill_, (kw["val"],))),
    "kaiming_uniform_": (
        frozenset(["tensor", "a", "mode", "nonlinearity", "generator"]),
        lambda kw: (torch.Tensor.uniform_, _kaiming_bounds(kw)),
    ),
}


class NotBlockwise(Exception):
    """An initializer did something to a fused tensor that cannot be performed block by block."""


def blocks_equal_one_draw(device: torch.device) -> bool:
    """Whether random fills on ``device`` split along dim 0 into the values of one draw: the CPU generator only."""
    return device.type == "cpu"


def is_fused_experts(t: torch.Tensor) -> bool:
    """A sharded 3-D tensor ``[experts, rows, cols]`` with a block this rank can cut (on any device type).

    Fused expert weights are the 3-D parameters of the models we know (``GroupedExperts``, Hugging Face's experts
    folders); any other 3-D DTensor (a ``Conv1d`` weight) is drawn in blocks too, which gives the same values.
    """
    return isinstance(t, DTensor) and t.ndim == 3 and t.numel() > 0 and not t.is_meta and shard_block(t) is not None


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


def _kaiming_bounds(kwargs: dict[str, Any]) -> tuple[float, float]:
    """``kaiming_uniform_``'s bounds for ``kwargs["tensor"]``, computed as ``torch.nn.init`` does (2.13)."""
    shape, mode = kwargs["tensor"].shape, str(kwargs["mode"]).lower()
    if len(shape) < 2 or mode not in ("fan_in", "fan_out"):
        # torch raises its own error for these: at full size
        raise NotBlockwise(f"kaiming_uniform_ of shape {tuple(shape)} with mode {mode!r}")
    fan = (shape[1] if mode == "fan_in" else shape[0]) * math.prod(shape[2:])
    std = nn.init.calculate_gain(kwargs["nonlinearity"], kwargs["a"]) / math.sqrt(fan)
    bound = math.sqrt(3.0) * std  # in torch's order: the same float
    return -bound, bound


class BlockDraw(TorchFunctionMode):
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

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # The mode is off while this runs (torch pops it), so ``func`` and the ops below do not come back here.
        kwargs = kwargs or {}
        hits = [t for t in _tensors(list(args)) + _tensors(list(kwargs.values())) if self._target_of(t) is not None]
        if not hits:
            return func(*args, **kwargs)
        try:
            return self._perform(func, hits, args, kwargs)
        except NotBlockwise:
            self._refused.update(t.untyped_storage().data_ptr() for t in hits)
            raise

    def _perform(
        self, func: Callable[..., Any], hits: list[torch.Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        name = getattr(func, "__name__", None)
        if func in _METADATA or name == "__get__":
            return func(*args, **kwargs)
        if func in _VIEWS:
            try:
                out = func(*args, **kwargs)
            except RuntimeError as error:  # ``view`` of an ``expand``: the whole tensor would allow it
                raise NotBlockwise(f"{name} of a fused expert tensor's stand-in") from error
            if any(self._target_of(t) is None for t in _tensors(out)):  # a copy (advanced indexing)
                raise NotBlockwise(f"{name} of a fused expert tensor's stand-in copies it")
            return out
        whole = _WHOLE_INITIALIZERS.get(name or "")
        if whole is not None and not args and set(kwargs) == whole[0]:
            method, scalars = whole[1](kwargs)
            generator = {"generator": kwargs["generator"]} if "generator" in kwargs else {}
            with torch.no_grad():
                return self._perform(method, hits, (kwargs["tensor"], *scalars), generator)
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
            raise NotBlockwise(f"{name} on a fused expert tensor")
        if torch.is_grad_enabled() and first.requires_grad:  # autograd refuses it: let the full size raise
            raise NotBlockwise(f"in-place {name} on a leaf that requires grad")
        target = found[1]
        if func in _RANDOM:
            if others:  # ``bernoulli_`` with a tensor of probabilities
                raise NotBlockwise(f"{name} with a tensor operand")
            if kwargs.get("generator") is not None or any(isinstance(a, torch.Generator) for a in args):
                raise NotBlockwise(f"{name} with a generator of its own")
            self._draw(func, target, args[1:], kwargs)
        elif func in _ELEMENTWISE:
            with torch.no_grad():
                _ELEMENTWISE[func](target.to_local(), *args[1:], **kwargs)
        else:
            raise NotBlockwise(f"{name} on a fused expert tensor")
        if func in _RANDOM or _ELEMENTWISE.get(func) in (torch.Tensor.zero_, torch.Tensor.fill_):
            self._written.add(id(target))
        return first

    def _draw(self, func: Callable[..., Any], target: DTensor, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
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
