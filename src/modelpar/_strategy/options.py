"""The strategy's options as one frozen, validated value: what both front ends hand the core.

The front ends keep their signatures explicit and typed (IDEs and docs read them), and pass their arguments on
with :meth:`StrategyOptions.pick`, which takes exactly the fields declared here. So a new option is its field
and validation here, the code that uses it, and its line in each signature (``tests/unit/test_strategy_options.py``
checks that every field is in both signatures with the same default).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from modelpar._mesh.process_group import DEFAULT_TIMEOUT
from modelpar._mesh.sizes import (
    SizeArg,
    check_context_parallel_size,
    check_expert_parallel_size,
    check_pipeline_parallel_size,
    check_size_arg,
)
from modelpar._mesh.watchdog import DEFAULT_PEER_TIMEOUT, PeerTimeoutArg, resolve_peer_timeout
from modelpar._train.grad_sync import AccumulationMode, GradientSyncControl
from modelpar.float8._spec import Float8Recipe, Float8Training, float8_spec
from modelpar.legacy import FSDP1_ARGUMENTS, translate_fsdp1_arguments
from modelpar.pipeline import PipelineSchedule
from modelpar.pipeline._schedules import check_schedule_settings, schedule_spec
from modelpar.pipeline._split import check_pipeline_split
from modelpar.plans import ActivationCheckpointing
from modelpar.plans._units import ModuleSelector, normalize_selector

__all__ = ["StrategyOptions"]

_NAME = "ModelParallelStrategy"


@dataclass(frozen=True)
class StrategyOptions:
    """Every option of the strategy that the core uses, validated when made (identically on every rank, long
    before any collective). The meaning of each is the front ends' docstring's."""

    data_parallel_size: SizeArg = "auto"
    tensor_parallel_size: SizeArg = "auto"
    save_distributed_checkpoint: bool = True
    process_group_backend: str | None = None
    timeout: timedelta | None = DEFAULT_TIMEOUT
    async_save: bool = False
    storage_options: Mapping[str, Any] | None = None
    data_parallel_replicate_size: SizeArg = 1
    context_parallel_size: int = 1
    expert_parallel_size: int = 1
    mixed_precision: MixedPrecisionPolicy | None = None
    cpu_offload: bool | CPUOffloadPolicy = False
    reshard_after_forward: bool | int | None = None
    gradient_accumulation: AccumulationMode = "sharded"
    peer_timeout: PeerTimeoutArg = DEFAULT_PEER_TIMEOUT
    fsdp_units: ModuleSelector | None = None
    activation_checkpointing: ActivationCheckpointing | ModuleSelector | None = None
    sync_module_states: bool = False
    pipeline_parallel_size: int = 1
    pipeline_schedule: PipelineSchedule = "1F1B"
    pipeline_microbatches: int | None = None
    pipeline_stages_per_rank: int | None = None
    pipeline_split: Sequence[Sequence[str]] | None = None
    float8: Float8Training | Float8Recipe | None = None
    #: Derived, not an argument: the Lightning ``FSDPStrategy`` arguments given (folded into the fields above by
    #: :meth:`pick`). They say the user came from FSDP1, where the strategy shards the model itself.
    fsdp1_arguments: tuple[str, ...] = field(default=(), metadata={"derived": True})

    def __post_init__(self) -> None:
        check_size_arg("data_parallel_size", self.data_parallel_size)
        check_size_arg("tensor_parallel_size", self.tensor_parallel_size)
        check_size_arg("data_parallel_replicate_size", self.data_parallel_replicate_size)
        check_context_parallel_size(self.context_parallel_size)
        check_expert_parallel_size(self.expert_parallel_size)
        _check_fsdp_args(self.mixed_precision, self.cpu_offload, self.reshard_after_forward)
        if self.timeout is not None and not isinstance(self.timeout, timedelta):
            raise TypeError(f"`timeout` must be a `datetime.timedelta`, but got {self.timeout!r}.")
        resolve_peer_timeout(self.peer_timeout)
        GradientSyncControl(self.gradient_accumulation)  # validates the mode with the strategy's message
        if self.fsdp_units is not None:
            object.__setattr__(self, "fsdp_units", normalize_selector(self.fsdp_units, _NAME, "fsdp_units"))
        checkpointing = self.activation_checkpointing
        if isinstance(checkpointing, str):
            if checkpointing not in ("full", "selective"):
                raise ValueError(
                    f"`activation_checkpointing={checkpointing!r}` is not a mode. Use 'full', 'selective', or the"
                    " modules to checkpoint (a set of classes such as {TransformerBlock}, patterns or a predicate)."
                )
        elif checkpointing is not None:
            object.__setattr__(
                self, "activation_checkpointing", normalize_selector(checkpointing, _NAME, "activation_checkpointing")
            )
        if not isinstance(self.sync_module_states, bool):
            raise TypeError(f"`sync_module_states` must be a bool, but got {self.sync_module_states!r}.")
        check_pipeline_parallel_size(self.pipeline_parallel_size)
        check_schedule_settings(
            schedule_spec(self.pipeline_schedule),
            pipeline_parallel_size=self.pipeline_parallel_size,
            stages_per_rank_arg=self.pipeline_stages_per_rank,
            microbatches=self.pipeline_microbatches,
        )
        if self.pipeline_split is not None:
            object.__setattr__(self, "pipeline_split", check_pipeline_split(self.pipeline_split))
        object.__setattr__(self, "float8", float8_spec(self.float8, _NAME))

    @property
    def chooses_units(self) -> tuple[str, ...]:
        """The given options that choose what the strategy shards or checkpoints itself (no ``parallelize_fn``),
        by the names the user gave them (``auto_wrap_policy`` for the units it became)."""
        given = {"fsdp_units": "auto_wrap_policy", "activation_checkpointing": "activation_checkpointing_policy"}
        return tuple(
            given[name] if given[name] in self.fsdp1_arguments else name
            for name in given
            if getattr(self, name) is not None
        )

    @classmethod
    def pick(cls, arguments: Mapping[str, Any]) -> StrategyOptions:
        """The options among a front end's arguments (its ``locals()``): the fields declared here, with Lightning
        ``FSDPStrategy``'s arguments (:data:`modelpar.legacy.FSDP1_ARGUMENTS`) folded in, and any other keyword
        argument (``kwargs``) refused by name."""
        own = {f.name: arguments[f.name] for f in fields(cls) if not f.metadata.get("derived")}
        fsdp1 = {name: arguments[name] for name in FSDP1_ARGUMENTS}
        given = tuple(name for name, value in fsdp1.items() if value is not None)
        return cls(**translate_fsdp1_arguments(own, fsdp1, arguments.get("kwargs") or {}), fsdp1_arguments=given)


def _check_fsdp_args(mixed_precision: Any, cpu_offload: Any, reshard_after_forward: Any) -> None:
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
        raise TypeError(
            "`mixed_precision` must be a `torch.distributed.fsdp.MixedPrecisionPolicy` or None (derived from the"
            f" precision flag), but got {type(mixed_precision).__name__}."
        )
    if not isinstance(cpu_offload, (bool, CPUOffloadPolicy)):
        raise TypeError(
            f"`cpu_offload` must be a bool or a `torch.distributed.fsdp.CPUOffloadPolicy`, but got {cpu_offload!r}."
        )
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, int):
        raise TypeError(
            "`reshard_after_forward` must be True, False, an int (ranks to reshard to) or None (FSDP2's default),"
            f" but got {reshard_after_forward!r}."
        )
