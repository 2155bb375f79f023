"""The strategy glue that the Fabric and the Trainer adapters share, as one mixin.

Fabric's and the Trainer's ``Strategy`` base classes are different classes, so each adapter must declare
the hooks its framework calls; the bodies are the same and live here, once. The mixin comes first in
each adapter's bases and relies only on what both bases provide (``parallel_devices``, ``local_rank``,
``node_rank``, ``num_nodes``, ``cluster_environment``, ``accelerator``) plus the adapter's ``_core``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from lightning_fabric.plugins.environments import ClusterEnvironment
from lightning_fabric.utilities.seed import reset_seed

from modelpar._mesh.process_group import barrier, broadcast_object
from modelpar._strategy.core import ParallelCore
from modelpar._strategy.lightning import Framework, load, strategy_repr
from modelpar.checkpoint._remote import Location, RemotePath, to_location
from modelpar.legacy import reject_fsdp1_modules

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["CoreStrategyMixin"]

TModule = TypeVar("TModule", bound=torch.nn.Module)


class CoreStrategyMixin:
    """Hooks whose behaviour is the core's, whichever framework drives the strategy."""

    _core: ParallelCore
    _launcher: Any
    _framework: Framework  # "fabric" or "pytorch": which Lightning framework the adapter serves
    parallel_devices: list[torch.device] | None
    cluster_environment: ClusterEnvironment | None
    local_rank: int
    node_rank: int
    num_nodes: int

    def pipeline_step(
        self,
        model: torch.nn.Module,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        ignore_index: int = -100,
        grad_scale: float = 1.0,
        **forward_kwargs: Any,
    ) -> torch.Tensor:
        """Forward and backward of one global batch through the pipeline (``pipeline_parallel_size > 1``).

        ``inputs`` and ``targets`` are this data-parallel rank's batch (every rank of a pipeline passes the same);
        the batch is split into ``pipeline_microbatches`` micro-batches. ``loss_fn(output, target)`` returns a
        micro-batch's mean loss over its targets not equal to ``ignore_index`` (``F.cross_entropy`` does). The
        gradients are those of the global batch's exact token mean (times ``grad_scale``: ``1 / k`` to average
        ``k`` calls of gradient accumulation), and that mean is returned on every rank. Step the optimizer as
        usual; clip with ``clip_gradients`` (one norm over every stage). Other keyword arguments reach every
        stage's forward, tensors split along their batch dimension (``positions=batch["position_ids"]`` under
        context parallelism).
        """
        with self._forward_context():
            return self._core.pipeline_step(
                model,
                inputs,
                targets,
                loss_fn,
                ignore_index=ignore_index,
                grad_scale=grad_scale,
                forward_kwargs=forward_kwargs,
            )

    def pipeline_eval(
        self,
        model: torch.nn.Module,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        ignore_index: int = -100,
        **forward_kwargs: Any,
    ) -> torch.Tensor:
        """The loss of one global batch through the pipeline, forward only (validation): the same token mean as
        :meth:`pipeline_step`, returned on every rank; no gradients."""
        with self._forward_context():
            return self._core.pipeline_step(
                model, inputs, targets, loss_fn, ignore_index=ignore_index, forward_kwargs=forward_kwargs, train=False
            )

    def _forward_context(self) -> Any:
        """The precision's forward context (autocast where it applies): the Trainer's strategies hold a
        ``precision_plugin``, Fabric's a ``precision``; both have ``forward_context``."""
        precision = getattr(self, "precision_plugin", None) or getattr(self, "precision")  # noqa: B009
        return precision.forward_context()

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``("data_parallel", "tensor_parallel")`` mesh (3-D under HSDP); exists after ``setup_environment``."""
        return self._core.device_mesh

    @property
    def root_device(self) -> torch.device:
        if not self.parallel_devices:
            raise RuntimeError(
                f"`{type(self).__name__}.root_device` is unknown before `setup_environment()` (no devices yet)."
            )
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        """Processes (devices) per node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Split data by data-parallel rank only: tensor-parallel peers must see the same batches."""
        return self._core.sampler_kwargs()

    @property
    def process_group_backend(self) -> str | None:
        return self._core.process_group_backend

    def __repr__(self) -> str:
        return strategy_repr(self, self._framework)

    def _configure_launcher(self) -> None:
        """The subprocess launcher of the namespace (``lightning.*`` or standalone) that connected us."""
        assert self.cluster_environment is not None  # set by the framework's connector before this hook
        if not self.cluster_environment.creates_processes_externally:
            launcher_cls = load(
                self._framework, "strategies.launchers._SubprocessScriptLauncher", like=self.cluster_environment
            )
            self._launcher = launcher_cls(self.cluster_environment, self.num_processes, self.num_nodes)

    def _set_ranks(self) -> None:
        ParallelCore.set_world_ranks(
            self.cluster_environment,
            node_rank=self.node_rank,
            local_rank=self.local_rank,
            per_node=self.num_processes,
            nodes=self.num_nodes,
        )

    def _set_up_module(self, module: TModule) -> TModule:
        """The core's ``setup_module`` on this rank's device, FSDP1 wrappers refused first: that needs no
        environment, so a module wrapped with the old API gets Lightning's ``TypeError`` even before
        ``setup_environment`` (where ``root_device`` is still unknown), as with Lightning's strategy."""
        reject_fsdp1_modules(module, self._core.strategy_name)
        return self._core.setup_module(module, self.root_device)

    def _start_distributed(self) -> DeviceMesh:
        """Seed, ranks, then the core's validated process group and mesh (after the base's device set-up)."""
        reset_seed()
        self._set_ranks()
        assert self.cluster_environment is not None  # set by the connector, or detected standalone
        return self._core.setup_distributed(
            self.cluster_environment,
            self.root_device,
            num_nodes=self.num_nodes,
            devices_per_node=self.num_processes,
            precision=self._precision_name(),
        )

    def _precision_name(self) -> str:
        """The precision flag (``"bf16-mixed"``, ...): the FSDP2 mixed-precision policy is derived from it."""
        raise NotImplementedError

    def _checkpoint_path(self, path: Any, storage_options: Any = None) -> Location:
        """Rank 0's path for all ranks: a local path, or a URL (``s3://`` ...) read through fsspec.

        ``storage_options`` (a dict for the URL's fsspec file system: credentials, endpoint ...) only apply to
        URLs: for a local path they are refused as Lightning's strategy refuses them (it has no ``CheckpointIO``).
        """
        text = self.broadcast(str(path))  # one path for all ranks, even if they computed different ones
        location = self._core.checkpointer.location(text)
        if storage_options is None:
            return location
        if not isinstance(location, RemotePath):  # whatever they are, as Lightning refuses any
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported for the local"
                f" path {text!r}: the strategy writes local checkpoints with torch.distributed.checkpoint, not a"
                " `CheckpointIO` plugin. Remove the argument; storage_options applies to URLs (s3://, gs:// ...)."
            )
        if not isinstance(storage_options, Mapping):
            raise TypeError(
                f"`storage_options` must be a dict of fsspec options for a URL, got {type(storage_options).__name__}."
            )
        return to_location(text, {**self._core.checkpointer.storage_options, **storage_options})

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        barrier(self.root_device)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return broadcast_object(obj, src)

    def _teardown_all(self, precision: Any) -> None:
        """Finish background saves and free their staging copies, then release environment, precision, accelerator."""
        self._core.checkpointer.close()
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        precision.teardown()
        accelerator = getattr(self, "accelerator", None)
        if accelerator is not None:
            accelerator.teardown()
