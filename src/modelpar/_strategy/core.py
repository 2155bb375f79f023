"""What every front end of the strategy shares: configuration, mesh, module set-up, sync and clipping.

The Fabric adapter (``modelpar.fabric``), the Trainer adapter and standalone ``torchrun`` use all hold one
``ParallelCore`` and forward to it, so behaviour cannot drift between them. The core knows nothing of
Fabric or the Trainer: it is given devices, a cluster environment and a precision, and does the work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, ExitStack
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from lightning_fabric.plugins.environments import ClusterEnvironment
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor

from modelpar._init.materialize import has_meta_tensors
from modelpar._init.placement import materialize, move_to_device, offloads
from modelpar._mesh.collective import broadcast_module_states
from modelpar._mesh.layout import (
    CONTEXT_PARALLEL_AXIS,
    EXPERT_PARALLEL_AXIS,
    HSDP_MESH_AXES,
    MESH_AXES,
    SHARD_CONTEXT_AXIS,
    TOKEN_AXIS,
    MeshLayout,
)
from modelpar._mesh.process_group import DEFAULT_TIMEOUT, default_backend, init_process_group
from modelpar._mesh.sizes import SizeArg
from modelpar._mesh.watchdog import resolve_peer_timeout, watch_peers
from modelpar._rank_zero import rank_zero_warn
from modelpar._strategy.applied import (
    check_context_parallel_applied,
    check_expert_parallel_applied,
    check_fsdp_mesh_applied,
    parallelized,
)
from modelpar._strategy.default_plan import default_plan
from modelpar._strategy.float8 import keep_scales_current, with_float8
from modelpar._strategy.options import StrategyOptions
from modelpar._strategy.pipelined import setup_pipeline
from modelpar._train.clip import clip_grad_norm, clip_grad_value
from modelpar._train.fsdp import FSDPOptions, cast_root_outputs, handed_out, register_mesh
from modelpar._train.grad_sync import GradientSyncControl
from modelpar.checkpoint import Checkpointer
from modelpar.pipeline._run import pipeline_of

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParallelCore", "ParallelizeFn"]

TModel = TypeVar("TModel", bound=nn.Module)
ParallelizeFn = Callable[[Any, "DeviceMesh"], Any]

#: Attribute ``setup_module`` sets on a module it has set up: the mesh it was parallelized on, as plain data
#: (so the module still copies and pickles). Like FSDP2's own state, it lives on the module, so any strategy
#: in the process knows not to parallelize or initialize it again.
_SET_UP_ON = "_modelpar_set_up_on"
#: Attribute ``setup_module`` sets beside it: whether the parameters ``fully_shard`` manages are offloaded to the
#: CPU, so that meta tensors the module gains later are materialized where they belong (``modelpar._init.placement``).
_OFFLOADS = "_modelpar_offloads"


class ParallelCore:
    """Configuration and state of one N-D parallel run, independent of the front end driving it."""

    def __init__(self, *, strategy_name: str, parallelize_fn: ParallelizeFn | None, options: StrategyOptions) -> None:
        # Validated at construction (``StrategyOptions``): identically on every rank, long before any collective.
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise TypeError(
                f"`parallelize_fn` must be a callable `(model, device_mesh) -> model`, but got"
                f" {type(parallelize_fn).__name__}."
            )
        if parallelize_fn is not None and options.chooses_units:
            given = ", ".join(f"`{n}`" for n in options.chooses_units)
            raise ValueError(
                f"{given} choose what the strategy shards and checkpoints when it parallelizes the model itself, but"
                f" a `parallelize_fn` was given too, and it decides that. Apply them in your function (the plan's"
                f" `fsdp_units` / `activation_checkpointing`), or drop the `parallelize_fn`."
            )
        self.options = options
        self.strategy_name = strategy_name
        self.parallelize_fn = with_float8(parallelize_fn, options.float8, strategy_name)  # type: ignore[arg-type]
        #: Set by the Trainer adapter: the LightningModule overrides ``configure_model``, where Lightning users shard
        #: the model themselves. Without a ``parallelize_fn`` or unit options, the strategy then keeps Lightning's
        #: ``"auto"`` sizes and shards only a model the hook left unsharded on a mesh without tensor parallelism.
        self.user_shards_in_hook = False
        self.data_parallel_size = options.data_parallel_size
        self.tensor_parallel_size = options.tensor_parallel_size
        self.data_parallel_replicate_size = options.data_parallel_replicate_size
        self.context_parallel_size = options.context_parallel_size
        self.expert_parallel_size = options.expert_parallel_size
        self.mixed_precision = options.mixed_precision
        self.cpu_offload = options.cpu_offload
        self.reshard_after_forward = options.reshard_after_forward
        #: Resolved in ``setup_distributed`` (they depend on the precision, the device and the layout).
        self.fsdp_options = FSDPOptions()
        #: False when a ``"bf16-mixed"`` run's FSDP2 policy casts the parameters: autocast on top would only copy.
        self.autocast = True
        self.save_distributed_checkpoint = options.save_distributed_checkpoint
        self.process_group_backend = options.process_group_backend
        self.timeout = options.timeout if options.timeout is not None else DEFAULT_TIMEOUT
        #: Seconds after which a silent peer ends every rank with a clear error (``_mesh.watchdog``); None: off.
        self.peer_timeout = resolve_peer_timeout(options.peer_timeout)
        self.layout: MeshLayout | None = None
        #: False only when standalone detection could not tell the processes per node ("auto" is refused then).
        self.per_node_known = True
        self._device_mesh: DeviceMesh | None = None
        self._mesh_world: Any = None  # the default process group the mesh was built in
        self.grad_sync = GradientSyncControl(options.gradient_accumulation)
        self.checkpointer = Checkpointer(
            async_save=options.async_save, timeout=self.timeout, storage_options=options.storage_options
        )

    # -- environment ---------------------------------------------------------------------------------
    @staticmethod
    def set_world_ranks(
        cluster_environment: ClusterEnvironment | None, *, node_rank: int, local_rank: int, per_node: int, nodes: int
    ) -> int:
        """Tell the environment this process's global rank and the world size; return the global rank.

        Also points Lightning's rank-zero utilities at it, so rank-0-only logging and warnings work the same
        with Fabric, the Trainer and standalone scripts.
        """
        from lightning_fabric.utilities import rank_zero_only
        from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

        global_rank = node_rank * per_node + local_rank
        if cluster_environment is not None:
            cluster_environment.set_global_rank(global_rank)
            cluster_environment.set_world_size(nodes * per_node)
            global_rank = cluster_environment.global_rank()  # some environments (torchrun) know better
        # rank_zero_only is a decorator whose `rank` attribute decides which process logs.
        rank_zero_only.rank = utils_rank_zero_only.rank = global_rank  # type: ignore[attr-defined]
        return global_rank

    def setup_distributed(
        self,
        cluster_environment: ClusterEnvironment,
        root_device: torch.device,
        *,
        num_nodes: int,
        devices_per_node: int,
        precision: str = "32-true",
    ) -> DeviceMesh:
        """Resolve and validate the layout and FSDP2 options, then create the process group and the mesh.

        The layout is resolved from values every rank knows before any communication, so a bad size
        raises the same ``ValueError`` on every rank instead of hanging some of them in a collective.
        Called again (each Trainer ``fit`` / ``validate`` / ... runs it), it keeps the mesh it built in the
        same process group: modules parallelized on it stay on the strategy's mesh, and no process groups leak.
        """
        layout = MeshLayout.resolve(
            self.data_parallel_size,
            self._tensor_parallel_arg(),
            world_size=cluster_environment.world_size(),
            num_nodes=num_nodes,
            devices_per_node=devices_per_node,
            per_node_known=self.per_node_known,
            data_parallel_replicate_size=self.data_parallel_replicate_size,
            context_parallel_size=self.context_parallel_size,
            expert_parallel_size=self.expert_parallel_size,
            pipeline_parallel_size=self.options.pipeline_parallel_size,
        )
        self.fsdp_options = FSDPOptions.resolve(
            mixed_precision=self.mixed_precision,
            cpu_offload=self.cpu_offload,
            reshard_after_forward=self.reshard_after_forward,
            precision=precision,
            device=root_device,
            shard_size=layout.fsdp_shard_size,
            strategy_name=self.strategy_name,
        )
        backend = self.process_group_backend or default_backend(root_device)
        self.process_group_backend = backend
        init_process_group(cluster_environment, backend, self.timeout, root_device)
        watch_peers(self.peer_timeout)  # a rank that dies must not leave the others waiting for the timeout
        mesh, world = self._device_mesh, dist.group.WORLD
        if (
            mesh is None
            or world is not self._mesh_world
            or (layout, root_device.type) != (self.layout, mesh.device_type)
        ):
            mesh, self._mesh_world = layout.build(root_device.type, backend, self.timeout), world
        self.layout, self._device_mesh = layout, mesh
        register_mesh(mesh, self.fsdp_options)
        return mesh

    @property
    def shards_for_user(self) -> bool:
        """Whether the strategy parallelizes the model itself (the default plan): no ``parallelize_fn``, and nothing
        else that shards it (a Trainer ``configure_model``) unless unit options or Lightning ``FSDPStrategy``'s
        arguments (which come from a strategy that always shards the model itself) say the strategy should."""
        options = self.options
        return self.parallelize_fn is None and (
            not self.user_shards_in_hook or bool(options.chooses_units) or bool(options.fsdp1_arguments)
        )

    def _tensor_parallel_arg(self) -> SizeArg:
        """``"auto"`` means no tensor parallelism when the strategy shards the model itself and nothing asks for
        it (both sizes ``"auto"``); otherwise Lightning's meaning (the devices of a node)."""
        if self.shards_for_user and self.tensor_parallel_size == "auto" and self.data_parallel_size == "auto":
            return 1
        return self.tensor_parallel_size

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError(
                f"Accessing the device mesh before it exists is not allowed: `{self.strategy_name}.device_mesh` is"
                " created in `setup_environment()`: after `fabric.launch()` with Fabric, when `trainer.fit` starts"
                " with the Trainer, or by calling `strategy.setup_environment()` yourself under torchrun."
            )
        return self._device_mesh

    def sampler_kwargs(self) -> dict[str, Any]:
        """Tensor-parallel peers must see identical batches, so the sampler splits by data-parallel rank only.

        Under HSDP that rank is the combined one (replica x shard), on the flattened ``"data_parallel"`` axis.
        """
        dp_mesh = self.device_mesh["data_parallel"]
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    def axis_names(self) -> list[str]:
        """Every axis a group can be named by: the mesh's own, plus the flattened ones (HSDP, context parallel)."""
        names = list(self.device_mesh.mesh_dim_names or ())
        flattened = [MESH_AXES[0]] if MESH_AXES[0] not in names else []
        if EXPERT_PARALLEL_AXIS in names and HSDP_MESH_AXES[0] in names:
            flattened.append(HSDP_MESH_AXES[1])
        if CONTEXT_PARALLEL_AXIS in names:
            flattened.append(TOKEN_AXIS)
            if HSDP_MESH_AXES[0] in names:
                flattened.append(SHARD_CONTEXT_AXIS)
        return [*names, *flattened]

    def resolve_group(self, group: Any) -> Any:
        """Accept a mesh axis name (``"data_parallel"``, ``"tensor_parallel"``, ...) wherever a group is expected."""
        if isinstance(group, str):
            names = self.axis_names()
            if group not in names:
                raise ValueError(f"`group={group!r}` is not a mesh axis. Use one of {names} or a ProcessGroup.")
            return self.device_mesh[group].get_group()
        return group

    # -- modules -------------------------------------------------------------------------------------
    @staticmethod
    def init_context(precision_context: AbstractContextManager[Any], empty_init: bool | None) -> ExitStack:
        """Meta device when ``empty_init`` (materialized later in ``setup_module``), plus the precision's dtype."""
        stack = ExitStack()
        if empty_init:
            stack.enter_context(torch.device("meta"))
        stack.enter_context(precision_context)
        return stack

    def setup_module(self, module: TModel, root_device: torch.device) -> TModel:
        """Apply ``parallelize_fn``, then materialize meta tensors where they belong (the adapters refuse FSDP1
        wrappers before, in ``_set_up_module``).

        That is ``root_device``, except the shards of FSDP units that offload to the CPU, which are materialized
        in host memory (see ``modelpar._init.placement``). Once per module: a module set up before (a second Trainer
        run, a new strategy on the same layout) is neither parallelized again nor re-initialized; only tensors it
        gained on the meta device since are materialized (real ones keep their values). It must be on a mesh of
        the same layout and ranks, as modules cannot be re-sharded in place.
        """
        mesh_key = _mesh_key(self.device_mesh)
        set_up_on = getattr(module, _SET_UP_ON, None)
        if set_up_on is not None:
            if set_up_on != mesh_key:
                raise ValueError(
                    f"The module was set up on a {_describe(set_up_on)}, but this strategy's mesh is a"
                    f" {_describe(mesh_key)}; a parallelized module cannot be re-sharded in place. Use the layout it"
                    " was set up on, or save a checkpoint and load it into a new module on this layout."
                )
            # only what is on the meta device; trained tensors are kept
            materialize(module, root_device, offload=getattr(module, _OFFLOADS, False))
            return module
        if self.options.sync_module_states:
            broadcast_module_states(module)
        parallelize_fn = self.parallelize_fn or self._default_plan(module)
        if self.layout is not None and self.layout.pipeline_parallel_size > 1:
            offload = setup_pipeline(self, module, parallelize_fn, root_device)
            setattr(module, _SET_UP_ON, mesh_key)
            setattr(module, _OFFLOADS, offload)
            return module
        if parallelize_fn is not None:
            module = parallelized(parallelize_fn, parallelize_fn(module, self.device_mesh))  # type: ignore[assignment]
        offloading = self.check_fsdp_applied(module)
        if self.layout is not None:
            check_context_parallel_applied(module, self.layout)
            check_expert_parallel_applied(module, self.layout)
        offload = offloads(
            offloading, root_device=root_device, has_meta=has_meta_tensors(module), strategy_name=self.strategy_name
        )
        materialize(module, root_device, offload=offload)
        keep_scales_current(module)
        self.warn_if_unsharded(module)
        setattr(module, _SET_UP_ON, mesh_key)
        setattr(module, _OFFLOADS, offload)
        return module

    def _default_plan(self, module: nn.Module) -> ParallelizeFn | None:
        """The plan that shards ``module`` when no ``parallelize_fn`` was given (``_strategy.default_plan``).

        None when something else parallelized it already (the Trainer's ``configure_model``), which unit options
        cannot change any more, or when that hook was meant to and a tensor-parallel mesh awaits its plan (the
        warning about an unsharded model then says so).
        """
        parallelized = any(isinstance(m, FSDPModule) for m in module.modules()) or any(
            isinstance(p, DTensor) for p in module.parameters()
        )
        if parallelized:
            if self.options.chooses_units:
                given = ", ".join(f"`{n}`" for n in self.options.chooses_units)
                raise ValueError(
                    f"The model was parallelized before the strategy got it (in `configure_model`), so {given} cannot"
                    " apply any more. Drop them, or leave the sharding to the strategy."
                )
            return None
        layout = self.layout
        tp = layout.tensor_parallel_size if layout is not None else 1
        ep = layout.expert_parallel_size if layout is not None else 1
        if not self.shards_for_user and tp > 1:
            return None
        return default_plan(
            module,
            fsdp_units=self.options.fsdp_units,
            activation_checkpointing=self.options.activation_checkpointing,
            tensor_parallel_size=tp,
            expert_parallel_size=ep,
            strategy_name=self.strategy_name,
            float8=self.options.float8,  # type: ignore[arg-type]
        )

    @staticmethod
    def module_to_device(module: nn.Module, root_device: torch.device) -> None:
        """Move what is left off ``root_device`` there (Lightning's ``model.to(root_device)``), but no FSDP shard.

        Lightning's Trainer strategy calls it after set-up for parameters and buffers no parallelization placed;
        the shards of units that offload to the CPU must stay in host memory (``modelpar._init.placement``).
        """
        move_to_device(module, root_device)

    def check_fsdp_applied(self, module: nn.Module) -> list[bool]:
        """After ``parallelize_fn``: FSDP on the layout's mesh, explicit FSDP options used; pick autocast or policy.

        Runs identically on every rank (it looks only at the module and the configuration), so the errors are
        raised everywhere. The strategy's options reach ``fully_shard`` only through ``fsdp_kwargs``; what it
        handed out since the mesh was registered tells whether the model got them. Returns, per ``fsdp_kwargs``
        call, whether it handed out CPU offloading.
        """
        layout, options = self.layout, self.fsdp_options
        given = handed_out(self.device_mesh)
        sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
        if layout is not None:
            check_fsdp_mesh_applied(module, layout)
        if options.explicit and sharded and not given:
            raise ValueError(
                f"The strategy was given {', '.join(f'`{n}`' for n in options.explicit)}, but `parallelize_fn` called"
                " `fully_shard` without them, so they would be ignored. Pass them on with"
                " `fully_shard(module, **modelpar.fsdp_kwargs(device_mesh))`."
            )
        took_policy = bool(given) and all(o.casts_parameters for o in given)
        self.autocast = not took_policy
        if took_policy and options.root_output_dtype is not None:
            cast_root_outputs(module)  # fp32 logits and losses, as under autocast
        if sharded and not given and options.casts_parameters:
            rank_zero_warn(
                "precision='bf16-mixed' runs as autocast here, because `parallelize_fn` called `fully_shard` without"
                " `modelpar.fsdp_kwargs(device_mesh)`: FSDP2 then all-gathers and reduce-scatters in fp32 (twice the"
                " traffic) and autocast keeps bf16 weight copies until backward. Pass"
                " `**modelpar.fsdp_kwargs(device_mesh)` to `fully_shard` for FSDP2's bf16 policy instead."
            )
        return [isinstance(o.offload_policy, CPUOffloadPolicy) for o in given]

    def warn_if_unsharded(self, module: nn.Module) -> None:
        if self.device_mesh.size() > 1 and not any(isinstance(p, DTensor) for p in module.parameters()):
            rank_zero_warn(
                f"The model has no DTensor parameters after `parallelize_fn`, but the mesh has"
                f" {self.device_mesh.size()} ranks: nothing is sharded and gradients are not synchronized, so"
                " each rank trains its own copy. Apply `fully_shard` (and/or a tensor-parallel plan) in"
                " `parallelize_fn`."
            )

    # -- gradients -----------------------------------------------------------------------------------
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager[None]:
        return self.grad_sync.no_sync(module, enabled)

    def clip_gradients_norm(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float, error_if_nonfinite: bool
    ) -> torch.Tensor:
        """One norm over every mesh, and under pipeline parallelism over every stage (each rank holds other
        parameters, so the pipeline ranks' sums add up: ``modelpar._train.clip``)."""
        pp = self.layout.pipeline_parallel_size if self.layout is not None else 1
        return clip_grad_norm(parameters, max_norm, norm_type, error_if_nonfinite, pipeline_parallel_size=pp)

    def pipeline_step(
        self,
        model: nn.Module,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        ignore_index: int = -100,
        grad_scale: float = 1.0,
        forward_kwargs: dict[str, Any] | None = None,
        train: bool = True,
    ) -> torch.Tensor:
        """Forward and backward (``train=False``: forward only) of one global batch through the pipeline; the
        token-mean loss on every rank (``modelpar.pipeline._run.Pipeline.step``)."""
        return pipeline_of(model).step(
            inputs,
            targets,
            loss_fn,
            ignore_index=ignore_index,
            grad_scale=grad_scale,
            forward_kwargs=forward_kwargs,
            train=train,
        )

    @staticmethod
    def clip_gradients_value(parameters: Iterable[torch.Tensor], clip_val: float) -> None:
        clip_grad_value(parameters, clip_val)


def _mesh_key(mesh: DeviceMesh) -> tuple[str, tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """What a parallelized module needs of a mesh to run on it: device type, axes, shape and ranks."""
    return (mesh.device_type, tuple(mesh.mesh_dim_names or ()), tuple(mesh.shape), tuple(mesh.mesh.flatten().tolist()))


def _describe(key: tuple[str, tuple[str, ...], tuple[int, ...], tuple[int, ...]]) -> str:
    device_type, axes, shape, ranks = key
    return f"{'x'.join(map(str, shape))} {device_type} mesh {axes} over ranks {list(ranks)}"
