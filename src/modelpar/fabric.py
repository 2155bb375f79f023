"""``ModelParallelStrategy`` for Lightning Fabric, and for standalone use under ``torchrun``.

A thin adapter: Fabric's hooks translate into calls on :class:`modelpar._core.ParallelCore`, which the
Trainer adapter shares. With Fabric, the accelerator, devices, cluster environment and precision are
filled in by Fabric; standalone, :meth:`ModelParallelStrategy.setup_environment` detects them itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch
from lightning_fabric.accelerators import Accelerator
from lightning_fabric.plugins import CheckpointIO, Precision
from lightning_fabric.plugins.environments import ClusterEnvironment
from lightning_fabric.strategies import ModelParallelStrategy as _LightningModelParallelStrategy
from lightning_fabric.strategies import ParallelStrategy
from torch import nn
from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, MixedPrecision, MixedPrecisionPolicy, ShardingStrategy
from torch.optim import Optimizer
from typing_extensions import override

from modelpar._mesh.cluster import detect_cluster
from modelpar._mesh.process_group import DEFAULT_TIMEOUT, all_reduce
from modelpar._mesh.sizes import SizeArg
from modelpar._mesh.watchdog import DEFAULT_PEER_TIMEOUT
from modelpar._strategy.adapter import CoreStrategyMixin
from modelpar._strategy.core import ParallelCore, ParallelizeFn
from modelpar._strategy.lightning import register_in_every_namespace
from modelpar._strategy.options import StrategyOptions
from modelpar._strategy.precision import check_precision, without_autocast
from modelpar._train.grad_sync import AccumulationMode
from modelpar.float8 import Float8Recipe, Float8Training
from modelpar.pipeline import PipelineSchedule
from modelpar.plans import ActivationCheckpointing, ModuleSelector

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ModelParallelStrategy"]

TModel = TypeVar("TModel", bound=nn.Module)


class _BackwardSync:
    """What Fabric's ``no_backward_sync`` calls into; the flag bookkeeping lives in the core."""

    def __init__(self, core: ParallelCore) -> None:
        self._core = core

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager[None]:
        return self._core.no_backward_sync(module, enabled)


class ModelParallelStrategy(CoreStrategyMixin, _LightningModelParallelStrategy):
    """FSDP2 + tensor parallelism on a ``("data_parallel", "tensor_parallel")`` device mesh, or HSDP on a 3-D one.

    It subclasses Lightning's ``ModelParallelStrategy`` only so that every ``isinstance`` check in Lightning
    treats it as a model-parallel strategy (Fabric refuses unsupported precisions that way, before it would
    silently turn ``"16-mixed"`` into ``"bf16-mixed"`` on CPU). None of Lightning's logic is used: every
    hook is overridden here and forwards to the shared core, and Lightning's ``__init__`` is not called.
    It serves ``lightning.fabric.Fabric`` (``import lightning as L``) and ``lightning_fabric.Fabric`` alike
    (see ``modelpar._strategy.lightning``).

    Usage with Fabric::

        def parallelize(model, mesh):
            parallelize_module(model, mesh["tensor_parallel"], plan)  # TP first ...
            for block in model.layers:
                fully_shard(block, **fsdp_kwargs(mesh))              # ... then FSDP, bottom-up
            fully_shard(model, **fsdp_kwargs(mesh))
            return model

        fabric = L.Fabric(strategy=ModelParallelStrategy(parallelize, data_parallel_size=2), devices=4)

    Standalone under ``torchrun`` (no Fabric)::

        strategy = ModelParallelStrategy(parallelize)
        strategy.setup_environment()
        model = strategy.setup_module(model)

    Args:
        parallelize_fn: ``(model, device_mesh) -> model``; applies TP plans and ``fully_shard`` (a
            ``modelpar.plans.ParallelPlan`` is one). Left out, the strategy shards the model with FSDP2 itself over
            every rank (``tensor_parallel_size="auto"`` is then 1; a Hugging Face model takes its own plan for
            ``tensor_parallel_size > 1``), with the units ``fsdp_units`` says or it finds.
        data_parallel_size: ranks along the data-parallel axis. ``"auto"``: the number of nodes, or
            ``world_size / tensor_parallel_size`` when that one is given.
        tensor_parallel_size: ranks along the tensor-parallel axis. ``"auto"``: devices per node, or
            ``world_size / data_parallel_size`` when that one is given.
        save_distributed_checkpoint: ``True`` saves a reshardable folder of shards; ``False`` one full file.
        process_group_backend: defaults to NCCL on CUDA, gloo on CPU.
        timeout: for every collective; a hung rank fails after this instead of blocking forever.
        async_save: return from ``save_checkpoint`` once the state is staged in CPU memory and write it in
            the background; the next save, any load and ``teardown()`` wait for it.
        storage_options: fsspec options (credentials, endpoint ...) for checkpoints at URLs (``s3://`` ...),
            for every save and load; without them the file system's own configuration (``AWS_*`` ...).
        data_parallel_replicate_size: split the data-parallel ranks into this many replicas, each sharding the
            model over the rest (HSDP; the mesh becomes ``("data_parallel_replicate", "data_parallel_shard",
            "tensor_parallel")``). ``data_parallel_size`` stays the whole data-parallel size. ``"auto"``: one
            replica per node when ``tensor_parallel_size`` is 1 on several nodes, else 1.
        context_parallel_size: split every sequence over this many ranks (context parallelism, see
            docs/long-context.md); the mesh gains a ``"context_parallel"`` axis inside data parallelism and outside
            tensor parallelism, and FSDP shards over data x context parallel. ``data_parallel_size`` stays the
            number of distinct sample streams; the world size is data x context x tensor parallel.
        expert_parallel_size: split each MoE layer's experts over this many ranks, borrowed from the data-parallel
            ranks that shard each replica (expert parallelism, see docs/moe.md); tokens reach their experts by
            all-to-all, and the ranks holding the same experts FSDP-shard them. Needs a plan that names the MoE
            modules (``modelpar.plans.LLAMA_MOE_PLAN``) or ``modelpar.moe.parallelize_experts``.
        mixed_precision: FSDP2 ``MixedPrecisionPolicy``; ``None`` derives it from the precision flag
            (``"bf16-mixed"``: bf16 parameters and compute, fp32 gradient reduction, and no autocast).
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory (``True`` or a
            ``CPUOffloadPolicy``); the optimizer step then runs on the CPU.
        reshard_after_forward: free gathered parameters after forward (``True``), keep them for backward
            (``False``), or reshard to that many ranks (int); ``None``: FSDP2's default (all but the root).
        gradient_accumulation: ``"sharded"`` (default) reduce-scatters every micro-batch of ``no_backward_sync``
            so gradients stay sharded (HSDP defers only the replica all-reduce); ``"unsharded"`` skips all
            reduction until the last micro-batch (less traffic, unsharded gradients in memory).
        peer_timeout: seconds (a number or ``timedelta``) after which a rank that stopped heartbeating (killed,
            frozen, its host gone), or a c10d store that stopped answering, ends every other rank with exit code
            75 and an error naming it, instead of leaving them in a collective until ``timeout``. Default 30;
            ``None`` turns the watchdog off. One process starts none. See docs/checkpointing.md.
        fsdp_units: without a ``parallelize_fn``, the FSDP units: a set of module classes (``{TransformerBlock}``,
            as FSDP1's ``ModuleWrapPolicy``), patterns (``("layers.*",)``) or a predicate ``(module) -> bool``.
            Left out: a Hugging Face model's ``_no_split_modules``, else the model's repeated blocks (the modules of
            one class filling its largest ``ModuleList`` / ``Sequential``), else the root alone (with a warning).
            See docs/quickstart.md.
        activation_checkpointing: without a ``parallelize_fn``: ``"full"`` or ``"selective"`` on the FSDP units, or
            the modules to checkpoint fully (classes, patterns or a predicate).
        sync_module_states: broadcast rank 0's parameters and buffers to every rank before sharding (FSDP1's
            option, for models whose ranks were not built alike). Meta-device models need none.
        pipeline_parallel_size: cut the model into stages over this many ranks (pipeline parallelism, see
            docs/pipeline.md); the mesh gains an outermost ``"pipeline_parallel"`` axis and every other axis is per
            stage. Train with ``strategy.pipeline_step(model, inputs, targets, loss_fn)``.
        pipeline_schedule: torch's schedule by name: ``"1F1B"`` (default), ``"GPipe"``, ``"Interleaved1F1B"``,
            ``"LoopedBFS"``, ``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"``, ``"DualPipeV"``.
        pipeline_microbatches: micro-batches per step (at least the number of stages); ``None``: the number of stages.
        pipeline_stages_per_rank: stages each rank holds under a looped schedule (default 2); V schedules hold 2.
        pipeline_split: the modules of each stage by name (``[["tok_embeddings", "layers.0"], ["layers.1", "norm",
            "output"]]``); left out, the model's repeated blocks are balanced by cost over the stages.
        float8: train the model's linear layers in float8 (torchao, the ``float8`` extra): a recipe name
            (``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``) or a ``modelpar.float8.Float8Training``.
            It goes to the plan the strategy applies: the one it makes without ``parallelize_fn``, or a
            ``ParallelPlan`` given as ``parallelize_fn`` (as ``plan.replace(float8=...)``). A function of your own
            converts the model itself (``modelpar.float8.convert``, first); the strategy then keeps the float8
            all-gather's scales current after every weight update either way. See docs/float8.md.
        auto_wrap_policy, activation_checkpointing_policy, sharding_strategy, state_dict_type, device_mesh,
        limit_all_gathers, use_orig_params: Lightning ``FSDPStrategy``'s arguments, so that changing the class
            is the whole migration; each becomes its FSDP2 option (a wrap policy: ``fsdp_units``;
            ``"SHARD_GRAD_OP"``: ``reshard_after_forward=False``; ``"HYBRID_SHARD"``: a replica per node;
            ``device_mesh=(replicas, shards)``: HSDP of that shape; ``state_dict_type``:
            ``save_distributed_checkpoint``) or is refused with the reason. ``cpu_offload`` and
            ``mixed_precision`` take FSDP1's ``CPUOffload`` and ``MixedPrecision`` too. Any other FSDP1 argument
            is refused by name with its FSDP2 equivalent. The table: docs/migrating-from-fsdp1.md.
        accelerator, parallel_devices, cluster_environment, precision: for standalone use; Fabric sets
            them otherwise. When left out standalone, they are detected (torchrun, SLURM, ...; CUDA or CPU;
            32-bit precision).
    """

    _framework = "fabric"

    def __init__(
        self,
        parallelize_fn: Callable[[TModel, DeviceMesh], TModel] | None = None,
        data_parallel_size: SizeArg = "auto",
        tensor_parallel_size: SizeArg = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        *,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: Precision | None = None,
        async_save: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        data_parallel_replicate_size: SizeArg = 1,
        context_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        mixed_precision: MixedPrecisionPolicy | MixedPrecision | None = None,
        cpu_offload: bool | CPUOffloadPolicy | CPUOffload = False,
        reshard_after_forward: bool | int | None = None,
        gradient_accumulation: AccumulationMode = "sharded",
        peer_timeout: float | timedelta | None = DEFAULT_PEER_TIMEOUT,
        fsdp_units: ModuleSelector | None = None,
        activation_checkpointing: ActivationCheckpointing | ModuleSelector | None = None,
        sync_module_states: bool = False,
        pipeline_parallel_size: int = 1,
        pipeline_schedule: PipelineSchedule = "1F1B",
        pipeline_microbatches: int | None = None,
        pipeline_stages_per_rank: int | None = None,
        pipeline_split: Sequence[Sequence[str]] | None = None,
        float8: Float8Training | Float8Recipe | None = None,
        auto_wrap_policy: Any = None,
        activation_checkpointing_policy: Any = None,
        sharding_strategy: str | ShardingStrategy | None = None,
        state_dict_type: Literal["full", "sharded"] | None = None,
        device_mesh: tuple[int, int] | None = None,
        limit_all_gathers: bool | None = None,
        use_orig_params: bool | None = None,
        **kwargs: Any,
    ) -> None:
        fn: ParallelizeFn | None = parallelize_fn
        self._core = ParallelCore(
            strategy_name=type(self).__name__,
            parallelize_fn=fn,
            options=StrategyOptions.pick(locals()),
        )
        self._quiet_precision: tuple[Precision, Precision] | None = None  # (plugin, its copy without autocast)
        ParallelStrategy.__init__(  # skip Lightning's __init__: its state is unused here
            self,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision=precision,
        )
        self._num_nodes = 0  # 0 = not told yet: Fabric sets it, standalone use detects it
        self._backward_sync_control = _BackwardSync(self._core)  # type: ignore[assignment]
        self._set_up_modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    # -- properties ----------------------------------------------------------------------------------
    @property
    @override
    def precision(self) -> Precision:
        """The precision plugin; without autocast in its forward context when FSDP2's policy casts to bf16."""
        plugin = self._precision if self._precision is not None else Precision()
        if self._core.autocast:
            return plugin
        if self._quiet_precision is None or self._quiet_precision[0] is not plugin:
            self._quiet_precision = (plugin, without_autocast(plugin))
        return self._quiet_precision[1]

    @precision.setter
    @override
    def precision(self, precision: Precision | None) -> None:
        # Fabric only refuses unsupported precisions for Lightning's own class; refuse them here instead.
        if precision is not None:
            check_precision(precision, type(self).__name__)
        self._precision = precision

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        raise NotImplementedError(
            f"`{type(self).__name__}` does not use the `CheckpointIO` plugin: it saves with"
            " torch.distributed.checkpoint. Use `save_checkpoint` / `load_checkpoint` (`fabric.save` / `fabric.load`)."
        )

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: CheckpointIO) -> None:
        raise NotImplementedError(
            f"`{type(self).__name__}` does not support setting a `CheckpointIO` plugin ({type(io).__name__} given): it"
            " saves with torch.distributed.checkpoint. Remove the plugin from `Fabric(plugins=...)`."
        )

    @property
    def num_nodes(self) -> int:
        return self._num_nodes or 1

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    # -- environment ---------------------------------------------------------------------------------
    def _fill_standalone_defaults(self) -> None:
        """Without Fabric, nobody has told us the cluster, devices or node count: detect them."""
        if self.cluster_environment is not None and self.accelerator is not None and self.parallel_devices:
            self._num_nodes = self._num_nodes or 1
            return
        detected = detect_cluster()
        # Devices the user passed say how many processes run per node; otherwise detection must know it.
        self._core.per_node_known = bool(self.parallel_devices) or detected.per_node_known
        self.cluster_environment = self.cluster_environment or detected.environment
        self.accelerator = self.accelerator or detected.accelerator
        self.parallel_devices = self.parallel_devices or detected.devices
        if not self._num_nodes:
            self._num_nodes = detected.num_nodes

    @override
    def setup_environment(self) -> None:
        """Create the process group and the mesh; sizes are validated first, identically on every rank."""
        self._fill_standalone_defaults()
        ParallelStrategy.setup_environment(self)  # device set-up only; not Lightning's process-group code
        self._start_distributed()

    @override
    def teardown(self) -> None:
        """Finish background saves and release the environment (never touching the absent ``checkpoint_io``)."""
        self._teardown_all(self.precision)

    def _precision_name(self) -> str:
        return str(getattr(self._precision, "precision", "32-true"))

    # -- modules -------------------------------------------------------------------------------------
    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        module = self._set_up_module(module)
        self._set_up_modules.add(module)
        return module

    @override
    def module_to_device(self, module: nn.Module) -> None:
        """Nothing to do: ``fully_shard`` places shards on the mesh's device, materialization on the root device."""

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager[Any]:
        return self._core.init_context(self.precision.module_init_context(), empty_init)

    # -- collectives ---------------------------------------------------------------------------------
    @override
    def all_reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """Reduce in place and return ``tensor``; ``group`` may be a mesh axis name like ``"data_parallel"``."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return all_reduce(tensor, self._core.resolve_group(group), reduce_op if reduce_op is not None else "sum")

    # -- gradients -----------------------------------------------------------------------------------
    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip by the global norm over all meshes the gradients live on (see ``modelpar._train.clip``)."""
        self.precision.unscale_gradients(optimizer)
        params = list(self.precision.main_params(optimizer))
        return self._core.clip_gradients_norm(params, float(max_norm), float(norm_type), error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.precision.unscale_gradients(optimizer)
        self._core.clip_gradients_value(list(self.precision.main_params(optimizer)), float(clip_val))

    # -- checkpoints ---------------------------------------------------------------------------------
    @override
    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Save ``state``: a reshardable folder by default, one file with ``save_distributed_checkpoint=False``."""
        location = self._checkpoint_path(path, storage_options)
        self._core.checkpointer.save(
            location,
            state,
            full=not self._core.save_distributed_checkpoint,
            filter=filter,
            known_modules=list(self._set_up_modules),
        )

    @override
    def load_checkpoint(
        self,
        path: str | Path,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` in place from ``path`` (either format, any mesh layout); return the unrequested rest."""
        if not state:
            raise ValueError(
                f"Got {type(self).__name__}.load_checkpoint(..., state={state!r}), but a state with at least one"
                " object to restore is needed, like `load_checkpoint(path, state={'model': model, ...})`."
            )
        location = self._checkpoint_path(path)
        checkpointer = self._core.checkpointer
        if isinstance(state, nn.Module):
            checkpointer.load_raw(location, state, strict=strict, weights_only=weights_only)
            return {}
        if isinstance(state, Optimizer):
            raise NotImplementedError(
                f"Loading a single optimizer object from a checkpoint is not supported with `{type(self).__name__}`:"
                " its state is keyed by the model's parameter names. Pass `state={'optimizer': optimizer}` instead."
            )
        return checkpointer.load(
            location, state, strict=strict, weights_only=weights_only, known_modules=list(self._set_up_modules)
        )


register_in_every_namespace(ModelParallelStrategy, "fabric", "strategies.ModelParallelStrategy")
