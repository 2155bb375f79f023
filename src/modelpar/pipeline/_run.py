"""A set-up pipeline: this rank's stages, their torch ``PipelineStage`` objects and schedule, and the step call.

:class:`Pipeline` lives on the model the user holds (``model._modelpar_pipeline``), so the step call needs nothing
but that model. The schedule is made at the first step (the stages' tensors are real by then), once.

**The loss is the exact token mean of the global batch.** torch's schedules call the loss function once per
micro-batch on the last stage and, by default, divide the gradients by the number of micro-batches: the mean of
micro-batch means, which weighs a token of a short (padded) micro-batch more than one of a full one, and which
FSDP then averages over data-parallel ranks with the same bias. Here the schedule does not scale
(``scale_grads=False``, pytorch #144352); each micro-batch's loss (a mean over its counted tokens, as
``cross_entropy`` gives it) is multiplied by ``its tokens x R / N`` before its backward, where ``N`` is the number of
counted tokens over the whole global batch (one all-reduce of one number over the data-parallel ranks) and ``R``
the ranks FSDP averages gradients over. The gradients are then those of ``sum(token losses) / N``, exactly, and
the loss returned on every rank is that value (one all-reduce over all ranks). Counting happens on the host, once
per step, from the targets every rank has (the sampler splits by data-parallel rank only, so the ranks of one
pipeline see the same batch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from modelpar.float8._scales import refresh_scales
from modelpar.pipeline._schedules import ScheduleSpec

__all__ = ["PIPELINE_ATTRIBUTE", "Pipeline", "pipeline_of", "pipelined"]

#: The attribute of a set-up model that holds its :class:`Pipeline`.
PIPELINE_ATTRIBUTE = "_modelpar_pipeline"

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(eq=False)
class Pipeline:
    """This rank's part of a pipeline: its stages (modules and indices), the schedule's settings, the groups."""

    spec: ScheduleSpec
    modules: list[nn.Module]
    stage_indices: list[int]
    num_stages: int
    microbatches: int
    device: torch.device
    pipeline_group: Any
    token_group: Any | None
    token_ranks: int
    tensor_parallel_size: int
    #: The state-dict keys of the whole model (every stage's), for full checkpoints: each rank loads its own and
    #: knows the others' are not unexpected.
    whole_state_keys: frozenset[str] = frozenset()
    _schedule: Any = field(default=None, repr=False)
    _shapes: Any = field(default=None, repr=False)
    _stages: list[Any] = field(default_factory=list, repr=False)
    _call: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_indices

    def _make_schedule(self) -> Any:
        from torch.distributed.pipelining import PipelineStage

        self._stages = [
            PipelineStage(module, index, self.num_stages, self.device, group=self.pipeline_group)
            for module, index in zip(self.modules, self.stage_indices, strict=True)
        ]
        cls = self.spec.torch_class()
        stages = self._stages[0] if not self.spec.looped else self._stages
        return cls(stages, n_microbatches=self.microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """One micro-batch's loss, weighted so that the step's gradients are those of the global token mean.

        The count comes from the micro-batch's own targets (torch may call the loss once more to infer shapes on
        the first step, so calls are not numbered); it is read on the host only when some micro-batch of the step
        counts no token (a mean over none is NaN, whose weight 0 would not cancel it)."""
        call = self._call
        count = (target != call["ignore_index"]).sum()
        if call["some_empty"] and int(count) == 0:
            return output.sum() * 0.0
        loss = call["loss_fn"](output, target)
        if isinstance(loss, DTensor):  # loss parallelism: a replicated scalar, the same on every tensor-parallel rank
            loss = loss.to_local()
        return loss * (count * call["scale"])

    def _run(
        self, args: tuple[Any, ...], target: Any, losses: list[torch.Tensor], extra: dict[str, Any], train: bool
    ) -> None:
        collect = losses if self.has_last else None
        for module in self.modules:  # before the schedule's own unshards (looped schedules all-gather ahead)
            refresh_scales(module)
        # return_outputs=False: the last stage would otherwise keep every micro-batch's logits until the step ends,
        # then concatenate them (the merged output, which nothing here uses).
        if train:
            self._schedule.step(*args, target=target, losses=collect, return_outputs=False, **extra)
        else:
            with torch.no_grad():
                self._schedule.eval(*args, target=target, losses=collect, return_outputs=False, **extra)

    def step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: LossFn,
        *,
        ignore_index: int = -100,
        grad_scale: float = 1.0,
        forward_kwargs: dict[str, Any] | None = None,
        train: bool = True,
    ) -> torch.Tensor:
        """Run forward and backward over the micro-batches; return the global batch's token-mean loss everywhere.

        ``train=False``: forward only (torch's ``schedule.eval``, under ``no_grad``), for a validation loss.

        ``forward_kwargs`` reach every stage's forward, each tensor split into micro-batches along its first
        (batch) dimension: per-token inputs every stage needs, like the ``positions`` of a sequence shard under
        context parallelism (``modelpar.context.shard_batch``)."""
        _check_batch(inputs, targets, self.microbatches)
        extra = dict(forward_kwargs or {})
        for name, value in extra.items():
            if isinstance(value, torch.Tensor) and (value.dim() == 0 or value.shape[0] != inputs.shape[0]):
                raise ValueError(
                    f"`{name}` (shape {tuple(value.shape)}) is split into micro-batches along its first dimension,"
                    f" which must be the batch's {inputs.shape[0]} samples. Expand it to (batch, ...) first."
                )
            if isinstance(value, torch.Tensor):
                extra[name] = value.to(self.device).contiguous()
        counts = (targets != ignore_index).reshape(self.microbatches, -1).sum(dim=1)
        total = counts.sum().to(torch.float64)
        if self.token_group is not None:
            total = _all_reduce(total, self.token_group, self.device)
        total_tokens = float(total)
        if total_tokens == 0:
            raise ValueError(
                f"No target of the global batch is counted (all equal `ignore_index={ignore_index}`), so the mean"
                " loss is undefined. Check the labels, or pass the `ignore_index` your loss uses."
            )
        shapes = (tuple(inputs.shape), tuple(targets.shape))
        if self._shapes is not None and shapes != self._shapes:
            raise ValueError(
                f"The pipeline's batch shapes are fixed by its first step (torch sizes each stage's send and receive"
                f" buffers then), but this call has inputs {shapes[0]} and targets {shapes[1]} where the first had"
                f" {self._shapes[0]} and {self._shapes[1]}. Give every step (and `pipeline_eval`) batches of one"
                " shape: `drop_last=True` in the DataLoader, and sequences padded to one length (targets"
                " `ignore_index` where padded)."
            )
        self._shapes = shapes
        if self._schedule is None:
            self._schedule = self._make_schedule()
        self._call = {
            "ignore_index": ignore_index,
            "some_empty": bool((counts == 0).any()),
            "scale": self.token_ranks * float(grad_scale) / total_tokens,
            "loss_fn": loss_fn,
        }
        # Contiguous: torch 2.11's stages compare each micro-batch's strides with those of the first they saw (2.13's
        # do not), so a view (``tokens[:, :-1]``, stride seq + 1) failed there with a PipeliningShapeError.
        args = (inputs.to(self.device).contiguous(),) if self.has_first else ()
        target = targets.to(self.device).contiguous() if self.has_last else None
        losses: list[torch.Tensor] = []
        # Vocab-sharded logits (a plan with loss parallelism) need torch's loss_parallel() around the loss and its
        # backward, which the schedule runs inside; it leaves plain tensors alone.
        context = loss_parallel() if self.tensor_parallel_size > 1 else contextlib.nullcontext()
        try:
            with context:
                self._run(args, target, losses, extra, train)
        finally:
            self._call = {}
        local = torch.zeros((), dtype=torch.float64)
        if losses:  # this rank holds the last stage: its part of the token mean (tensor-parallel peers repeat it)
            weighted = torch.stack([loss.detach().to(torch.float64).cpu() for loss in losses]).sum()
            local = weighted / (self.token_ranks * float(grad_scale) * self.tensor_parallel_size)
        return _all_reduce(local, None, self.device).to(torch.float32)


def _all_reduce(tensor: torch.Tensor, group: Any, device: torch.device) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` (None: every rank) on the device the group communicates on."""
    from modelpar._mesh.collective import collective_device, group_device_types

    where = collective_device(device, group_device_types(device, group))
    buffer = tensor.detach().to(where).clone()
    dist.all_reduce(buffer, group=group)
    return buffer.cpu() if buffer.device != device else buffer


def _check_batch(inputs: torch.Tensor, targets: torch.Tensor, microbatches: int) -> None:
    if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise TypeError(
            f"`pipeline_step` takes `inputs` and `targets` as tensors, but got {type(inputs).__name__} and"
            f" {type(targets).__name__}."
        )
    batch = inputs.shape[0] if inputs.dim() else 0
    if batch % microbatches:
        raise ValueError(
            f"The batch of {batch} samples cannot be split into `pipeline_microbatches={microbatches}` equal"
            f" micro-batches. Use a batch size that is a multiple of {microbatches}, or change"
            " `pipeline_microbatches`."
        )
    if targets.shape[:1] != inputs.shape[:1]:
        raise ValueError(
            f"`targets` has {targets.shape[0] if targets.dim() else 0} samples but `inputs` {batch}; they must match."
        )


def pipeline_of(model: nn.Module) -> Pipeline:
    """The :class:`Pipeline` of a set-up model (or of a Fabric wrapper around one); ``ValueError`` otherwise."""
    found = pipelined(model)
    if found is None:
        raise ValueError(
            f"`pipeline_step` needs a model set up with `pipeline_parallel_size > 1`, but {type(model).__name__} was"
            " not. Set up the model with the strategy (`fabric.setup(model)`, or `strategy.setup_module(model)`"
            " standalone) on a strategy with `pipeline_parallel_size > 1`; without a pipeline, call the model and"
            " `backward` as usual."
        )
    return found


def pipelined(model: nn.Module) -> Pipeline | None:
    """The :class:`Pipeline` of a set-up model (or a Fabric wrapper around one), or None without pipeline."""
    found = getattr(model, PIPELINE_ATTRIBUTE, None)
    inner = getattr(model, "module", None)
    if found is None and isinstance(inner, nn.Module):
        found = getattr(inner, PIPELINE_ATTRIBUTE, None)
    return found if isinstance(found, Pipeline) else None
