"""``ModelParallelStrategy`` for the Lightning Trainer: the same core as the Fabric strategy.

Needs the ``trainer`` extra (``pip install 'modelpar[trainer]'``). A thin adapter: the Trainer's hooks
forward to :class:`modelpar._core.ParallelCore` (mesh, module set-up, gradient sync, clipping) and to its
:class:`~modelpar.checkpoint.Checkpointer`, exactly as the Fabric adapter does. What is Trainer-specific
lives here: the LightningModule's ``configure_model`` / ``device_mesh`` protocol, the Trainer's checkpoint
layout (``state_dict`` + ``optimizer_states``), accumulation through ``block_backward_sync``, and clipping
through the precision plugin.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from modelpar._strategy.lightning import classes, installed, load, register_in_every_namespace

if not installed("pytorch"):  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "`modelpar.trainer` needs the Lightning Trainer, which is an optional extra. Install it with"
        " `pip install 'modelpar[trainer]'` or `pip install lightning` (or use the Fabric strategy,"
        " `modelpar.ModelParallelStrategy`)."
    )

import torch
from lightning_utilities.core.overrides import is_overridden
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import (
    CPUOffload,
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
    register_fsdp_forward_method,
)
from torch.optim import Optimizer
from typing_extensions import override

from modelpar._mesh.process_group import DEFAULT_TIMEOUT, all_reduce
from modelpar._mesh.sizes import SizeArg
from modelpar._mesh.watchdog import DEFAULT_PEER_TIMEOUT
from modelpar._strategy.adapter import CoreStrategyMixin
from modelpar._strategy.core import ParallelCore, ParallelizeFn
from modelpar._strategy.options import StrategyOptions
from modelpar._strategy.precision import without_autocast
from modelpar._train.grad_sync import AccumulationMode
from modelpar.checkpoint._rekey import optimizer_state_to_positions
from modelpar.checkpoint._remote import RemotePath, withdraw
from modelpar.checkpoint._state import state_dict_options
from modelpar.float8 import Float8Recipe, Float8Training
from modelpar.pipeline import PipelineSchedule
from modelpar.plans import ActivationCheckpointing, ModuleSelector

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from pytorch_lightning.plugins import Precision
    from pytorch_lightning.strategies import ModelParallelStrategy as _LightningModelParallelStrategy
    from pytorch_lightning.strategies import ParallelStrategy
    from torch.distributed.device_mesh import DeviceMesh
else:  # the primary installed namespace: pytorch_lightning, or lightning.pytorch without it
    _LightningModelParallelStrategy = load("pytorch", "strategies.ModelParallelStrategy")
    ParallelStrategy = load("pytorch", "strategies.ParallelStrategy")

__all__ = ["ModelParallelStrategy"]


class ModelParallelStrategy(CoreStrategyMixin, _LightningModelParallelStrategy):
    """FSDP2 + tensor parallelism for ``lightning.pytorch.Trainer(strategy=...)`` and ``pytorch_lightning.Trainer``.

    Either the LightningModule parallelizes itself in ``configure_model()`` with ``self.device_mesh``, or pass
    ``parallelize_fn(lightning_module, device_mesh) -> lightning_module`` and the strategy applies it after
    ``configure_model``. Subclasses Lightning's ``ModelParallelStrategy`` only so that the Trainer's
    ``isinstance`` checks (precision validation, "is distributed") treat it as one; Lightning's ``__init__``
    is not called and every hook with behaviour is overridden. One class serves both Lightning namespaces
    (``import lightning as L`` and ``import pytorch_lightning as pl``; see ``modelpar._strategy.lightning``): the
    LightningModule, optimizers and plugins it is given may come from either.

    Args:
        data_parallel_size, tensor_parallel_size, save_distributed_checkpoint, process_group_backend, timeout:
            as for the Fabric strategy (:class:`modelpar.ModelParallelStrategy`).
        parallelize_fn: optional ``(module, device_mesh) -> module`` applied to the LightningModule in place, once:
            later runs (``validate`` after ``fit``, a second ``fit``) use the module as it is.
        async_save: checkpoints return once staged in CPU memory and are written in the background.
        storage_options: fsspec options for checkpoints at URLs (``s3://`` ...), for every save and load.
        data_parallel_replicate_size, context_parallel_size, expert_parallel_size, mixed_precision, cpu_offload,
        reshard_after_forward, gradient_accumulation:
            HSDP, context and expert parallelism and the FSDP2 options, as for the Fabric strategy. ``configure_model``
            (or ``parallelize_fn``) passes them on with
            ``fully_shard(module, **modelpar.fsdp_kwargs(self.device_mesh))``;
            ``gradient_accumulation`` decides what ``accumulate_grad_batches`` skips.
        peer_timeout: seconds until a dead or frozen rank ends the others with a clear error; as for the Fabric
            strategy (default 30, ``None``: off).
        fsdp_units, activation_checkpointing, sync_module_states, auto_wrap_policy, activation_checkpointing_policy,
        sharding_strategy, state_dict_type, device_mesh, limit_all_gathers, use_orig_params:
            as for the Fabric strategy. Without ``parallelize_fn`` the strategy shards a LightningModule that
            ``configure_model`` left unsharded itself (FSDP2 over every rank); with unit options it always does, and
            ``tensor_parallel_size="auto"`` is then 1. A module ``configure_model`` sharded is used as it is.
        pipeline_parallel_size, pipeline_schedule, pipeline_microbatches, pipeline_stages_per_rank, pipeline_split:
            pipeline parallelism, as for the Fabric strategy: the LightningModule is cut into stages, and
            ``training_step`` (manual optimization) calls ``self.trainer.strategy.pipeline_step(...)``.
        float8: float8 training of the linear layers, as for the Fabric strategy (docs/float8.md).
    """

    _framework = "pytorch"

    def __init__(
        self,
        data_parallel_size: SizeArg = "auto",
        tensor_parallel_size: SizeArg = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        parallelize_fn: Callable[[Any, DeviceMesh], Any] | None = None,
        *,
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
            strategy_name=f"{type(self).__module__}.{type(self).__name__}",
            parallelize_fn=fn,
            options=StrategyOptions.pick(locals()),
        )
        self._quiet_precision: tuple[Precision, Precision] | None = None  # (plugin, its copy without autocast)
        ParallelStrategy.__init__(self)  # skip Lightning's __init__: its state is unused here
        self.num_nodes = 1

    # -- properties ----------------------------------------------------------------------------------
    @property
    @override
    def precision_plugin(self) -> Precision:
        """The precision plugin; without autocast in its step contexts when FSDP2's policy casts to bf16."""
        plugin: Precision = self._precision_plugin or load("pytorch", "plugins.Precision")()
        if self._core.autocast:
            return plugin
        if self._quiet_precision is None or self._quiet_precision[0] is not plugin:
            self._quiet_precision = (plugin, without_autocast(plugin))
        return self._quiet_precision[1]

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        self._precision_plugin = precision_plugin

    def _precision_name(self) -> str:
        return str(getattr(self._precision_plugin, "precision", "32-true"))

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # sharded models and optimizers must exist before their state can be loaded into them

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores optimizers itself, shard by shard

    # -- environment ---------------------------------------------------------------------------------
    @override
    def set_world_ranks(self) -> None:
        """Called by the Trainer's connector; the bookkeeping is shared with the Fabric adapter."""
        self._set_ranks()

    @override
    def setup_environment(self) -> None:
        ParallelStrategy.setup_environment(self)  # device set-up only; not Lightning's process-group code
        # Before the mesh: whether "auto" means Lightning's tensor parallelism or none (`ParallelCore.shards_for_user`).
        self._core.user_shards_in_hook = _overrides_configure_model(self.lightning_module)
        mesh = self._start_distributed()  # built on the first run; later runs in the same process group reuse it
        assert self.lightning_module is not None  # the Trainer connects the module before this hook
        # Read by `LightningModule.device_mesh` in configure_model; set on every run, whichever module is connected.
        self.lightning_module._device_mesh = mesh

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None  # set by the Trainer
        self.accelerator.setup(trainer)
        module = self._set_up_module(self.model)  # on later runs: nothing new to shard or init
        if module is not self.model:
            raise TypeError(
                "`parallelize_fn` must parallelize the LightningModule in place and return that same module"
                f" (it returned a different {type(module).__name__}); the Trainer keeps using the original."
            )
        _steps_run_fsdp_hooks(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._install_mesh_aware_clipping()
        self.barrier()
        if trainer.state.fn == "fit":  # TrainerFn.FITTING of either namespace (a str enum)
            self.setup_optimizers(trainer)  # Lightning's: drops a previous fit's optimizers and schedulers, makes new
        self.setup_precision_plugin()

    @override
    def model_to_device(self) -> None:
        """Lightning's ``model.to(root_device)`` for what no parallelization placed; offloaded shards stay on the CPU.

        Lightning's Trainer strategy moves the whole model, which would move FSDP2's CPU-offloaded shards to the
        GPU (their DTensors then report the GPU, and FSDP2's first forward refuses them).
        """
        assert self.model is not None
        self._core.module_to_device(self.model, self.root_device)

    def _install_mesh_aware_clipping(self) -> None:
        """Route the Trainer's ``gradient_clip_val`` through the core's clipping.

        The Trainer clips in the precision plugin with ``torch.nn.utils.clip_grad_norm_``, which fails when
        gradients live on different meshes (FSDP-only and tensor-parallel parameters). The plugin's two
        primitives are replaced on this plugin instance only; unscaling and the algorithm choice stay its own.
        """
        plugin, core = self.precision_plugin, self._core

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
            core.clip_gradients_norm(plugin.main_params(optimizer), float(clip_val), 2.0, False)

        def clip_grad_by_value(optimizer: Optimizer, clip_val: float) -> None:
            core.clip_gradients_value(plugin.main_params(optimizer), float(clip_val))

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]
        plugin.clip_grad_by_value = clip_grad_by_value  # type: ignore[method-assign]

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        with self._core.init_context(self.precision_plugin.tensor_init_context(), empty_init):
            yield

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Defer gradient reduction on accumulation micro-batches as ``gradient_accumulation`` says (``_grad_sync``)."""
        assert self.model is not None
        with self._core.no_backward_sync(self.model, enabled=True):
            yield

    @override
    def teardown(self) -> None:
        self._teardown_all(self.precision_plugin)

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: Any | None = None, **kwargs: Any
    ) -> Any:
        """Lightning's step, without its check that ``model`` is a LightningModule of one namespace only."""
        model = model or self.lightning_module
        return self.precision_plugin.optimizer_step(optimizer, model=model, closure=closure, **kwargs)  # type: ignore[arg-type]

    # -- collectives ---------------------------------------------------------------------------------
    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """Reduce over ``group``; by default the **data-parallel** group.

        Tensor-parallel peers hold the same values (they see the same batch), so reducing over the whole
        world would count each value once per peer: ``self.log(..., sync_dist=True, reduce_fx="sum")`` would
        be ``tensor_parallel_size`` times too large. ``group`` may also be a mesh axis name.
        """
        if not isinstance(tensor, torch.Tensor):
            return tensor
        group = self._core.resolve_group("data_parallel" if group is None else group)
        return all_reduce(tensor, group, reduce_op if reduce_op is not None else "sum")

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Every rank's vote counts (early stopping, checkpoint decisions): reduced over the whole world."""
        votes = all_reduce(torch.tensor(int(decision), device=self.root_device), None, "sum")
        return bool(votes == self.world_size) if all else bool(votes)

    # -- checkpoints ---------------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Sharded state dict, or (``save_distributed_checkpoint=False``) the full one on rank 0 only."""
        assert self.model is not None
        full = not self._core.save_distributed_checkpoint
        return get_model_state_dict(self.model, options=state_dict_options(full=full))  # shards: not offloaded

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Sharded optimizer state, or the full one keyed by position (as DDP writes it) on rank 0."""
        assert self.model is not None
        if isinstance(optimizer, classes("pytorch", "core.optimizer.LightningOptimizer")):
            optimizer = optimizer._optimizer  # type: ignore[attr-defined]
        full = not self._core.save_distributed_checkpoint
        state = get_optimizer_state_dict(self.model, optimizer, options=state_dict_options(full=full))
        if full and self.global_rank == 0:  # positions, so DDP and single-device runs can load it
            state = optimizer_state_to_positions(state, self.model, optimizer)
        return state

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write the Trainer's checkpoint dict atomically, in the same layout as Lightning's strategy."""
        path = self._checkpoint_path(filepath, storage_options)
        write = functools.partial(  # the model and optimizers the state comes from (async full saves copy less)
            self._core.checkpointer.write,
            live_modules=[self.model] if self.model is not None else [],
            live_optimizers=list(self.optimizers),
        )
        if not self._core.save_distributed_checkpoint:  # the gathered model and optimizers, and the rest
            gathered = {k: v for k, v in checkpoint.items() if k in ("state_dict", "optimizer_states")}
            write(path, gathered, {k: v for k, v in checkpoint.items() if k not in gathered}, full=True)
            return
        metadata = dict(checkpoint)
        tensors = {"state_dict": metadata.pop("state_dict")}
        for idx, optim_state in enumerate(metadata.pop("optimizer_states", [])):
            tensors[f"optimizer_{idx}"] = optim_state
        write(path, tensors, metadata, full=False)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the model and optimizers in place (any layout, either format); return the rest for the Trainer."""
        path = self._checkpoint_path(checkpoint_path)
        assert self.model is not None and self.lightning_module is not None
        return self._core.checkpointer.load_trainer_checkpoint(
            path,
            self.model,
            self.optimizers,
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
        )

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing to do: ``load_checkpoint`` already restored the shards."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing to do: ``load_checkpoint`` already restored the shards."""

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete a checkpoint file or folder (``ModelCheckpoint`` top-k clean-up), once, on rank 0.

        At a URL the checkpoint is withdrawn first (its commit marker goes before its objects).
        """
        if self.is_global_zero:
            path = self._core.checkpointer.location(filepath)
            if isinstance(path, RemotePath):
                withdraw(path)
            elif path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()


#: The LightningModule methods the Trainer calls in place of ``forward``.
_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def _steps_run_fsdp_hooks(module: Any) -> None:
    """Make the step methods of a LightningModule that is itself an FSDP unit gather its parameters, as forward does.

    When the module is sharded as the root (the strategy's own plan does that), FSDP2 all-gathers the parameters
    no block holds (embeddings, the head) in its pre-forward hook, but the Trainer calls ``training_step`` and never
    ``forward``; torch's ``register_fsdp_forward_method`` runs the same hooks around those methods.
    """
    if isinstance(module, FSDPModule):
        for name in _STEP_METHODS:
            register_fsdp_forward_method(module, name)  # type: ignore[arg-type]  # an FSDPModule is a Module


def _overrides_configure_model(module: Any) -> bool:
    """Lightning's ``is_overridden`` against the LightningModule class of the module's own namespace."""
    parent = next((c for c in classes("pytorch", "LightningModule") if isinstance(module, c)), None)
    return parent is not None and is_overridden("configure_model", module, parent=parent)


register_in_every_namespace(ModelParallelStrategy, "pytorch", "strategies.ModelParallelStrategy")
