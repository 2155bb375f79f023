"""The mesh layout: resolving ``"auto"`` sizes, validating them before any collective, and building the mesh.

Everything but :meth:`MeshLayout.build` is pure arithmetic on values every rank already knows (world size,
nodes, devices per node), so every rank reaches the same verdict and raises the same error: no rank can sit
in ``init_process_group`` or ``init_device_mesh`` while another has already failed.

Two shapes. Without replication (``data_parallel_replicate_size=1``, the default) the mesh is Lightning's 2-D
``("data_parallel", "tensor_parallel")``. With it, data parallelism splits into replicas of sharded groups
(HSDP: shard within a node, replicate across nodes, so the per-layer all-gathers stay on fast links and only
the gradient all-reduce, once per step and on shards, crosses nodes) and the mesh is 3-D
``("data_parallel_replicate", "data_parallel_shard", "tensor_parallel")``, replicate outermost. Its two
data-parallel axes are also flattened into a ``"data_parallel"`` axis, so samplers, ``sync_dist`` and user
code that reduce over the whole data-parallel group work unchanged on both shapes.

Context parallelism (``context_parallel_size > 1``) adds a ``"context_parallel"`` axis between the data-parallel
axes and ``"tensor_parallel"`` (torchtitan's order: tensor-parallel peers stay neighbours, the sequence shards of
one sample are next out). The ranks of one context-parallel group hold the same weights and different tokens, so
FSDP shards over data parallel x context parallel: a flattened ``"data_parallel_context_parallel"`` axis (every
rank with distinct tokens, replicas included; losses and token counts reduce over it), and under HSDP a flattened
``"data_parallel_shard_context_parallel"`` axis that is the shard dimension of FSDP's 2-D mesh. ``data_parallel_size``
keeps its meaning: the number of distinct sample streams (what the sampler splits by).

Pipeline parallelism (``pipeline_parallel_size > 1``) is the outermost axis, ``"pipeline_parallel"`` (torchtitan's
place: its point-to-point sends are the least frequent and smallest traffic, so they may cross nodes). Each
coordinate along it is a whole data x context x tensor mesh that holds one stage (or, with virtual stages, several)
of the model; every axis below is sliced per stage, so ``device_mesh["data_parallel"]`` is this stage's data-parallel
group and the sampler, FSDP and the plans are unchanged.

Expert parallelism (``expert_parallel_size > 1``) borrows its ranks from the ranks that shard each replica, as in
torchtitan: ``"data_parallel"`` (or ``"data_parallel_shard"`` under HSDP) splits into ``"expert_data_parallel"``
(outer) x ``"expert_parallel"`` (inner, neighbouring ranks: the all-to-all stays on the fastest links), and the
data-parallel axes are flattened back, so dense weights keep their FSDP over every data-parallel rank and the
sampler is unchanged. Each MoE layer's experts are split over ``"expert_parallel"``; the ranks of one
``"expert_data_parallel"`` group hold the same experts and FSDP-shard them (see ``modelpar.moe``).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from modelpar._errors import MeshSizeError
from modelpar._mesh.groups import group_options, group_timeout, world_group_reusable
from modelpar._mesh.sizes import (
    SizeArg,
    check_context_parallel_size,
    check_expert_parallel_size,
    check_pipeline_parallel_size,
    check_size_arg,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "CONTEXT_PARALLEL_AXIS",
    "EXPERT_PARALLEL_AXIS",
    "EXPERT_SHARD_AXIS",
    "HSDP_MESH_AXES",
    "MESH_AXES",
    "PIPELINE_PARALLEL_AXIS",
    "TOKEN_AXIS",
    "MeshLayout",
    "SHARD_CONTEXT_AXIS",
]

#: Axis names of the 2-D mesh, outermost first. Data parallel is outermost so that tensor-parallel peers
#: are neighbouring ranks (on one node, with "auto"), where the frequent TP collectives are cheapest.
MESH_AXES = ("data_parallel", "tensor_parallel")

#: Axis names of the 3-D (HSDP) mesh, outermost first; ``"data_parallel"`` is their first two, flattened.
HSDP_MESH_AXES = ("data_parallel_replicate", "data_parallel_shard", "tensor_parallel")

#: The context-parallel axis (``context_parallel_size > 1``): the ranks that hold one sample's sequence in shards.
#: It sits inside data parallelism and outside tensor parallelism, as in torchtitan.
CONTEXT_PARALLEL_AXIS = "context_parallel"

#: The flattened axis of every rank that sees distinct tokens (data parallel, replicas included, x context
#: parallel), present when ``context_parallel_size > 1``: token counts and losses are reduced over it.
TOKEN_AXIS = "data_parallel_context_parallel"

#: Under HSDP with context parallelism: the flattened shard dimension of FSDP's 2-D (replicate, shard) mesh.
SHARD_CONTEXT_AXIS = "data_parallel_shard_context_parallel"

#: The pipeline-parallel axis (``pipeline_parallel_size > 1``), outermost: its ranks hold different stages of the model.
PIPELINE_PARALLEL_AXIS = "pipeline_parallel"

#: The expert-parallel axis (``expert_parallel_size > 1``): the ranks over which each MoE layer's experts are split.
EXPERT_PARALLEL_AXIS = "expert_parallel"

#: Under expert parallelism: the data-parallel ranks outside the expert axis, which hold the same experts and
#: FSDP-shard them (torchtitan's ``dp_shard_mod_ep``).
EXPERT_SHARD_AXIS = "expert_data_parallel"

#: torch warns when a flattened axis is sliced from the root mesh, asking callers to keep the flattened mesh
#: themselves. ``device_mesh["data_parallel"]`` is this library's documented contract (Lightning-style code
#: relies on it), so the warning is silenced for that message only; the test suite runs against each
#: supported torch and would catch the day slicing stops working.
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class MeshLayout:
    """A resolved layout: ``data_parallel x context_parallel x tensor_parallel`` ranks, data parallel in replicas.

    ``data_parallel_size`` is the whole data-parallel size (replicas x shards), as without replication, so
    code that reads it keeps its meaning. The product of the three sizes is the world size.
    """

    data_parallel_size: int
    tensor_parallel_size: int
    data_parallel_replicate_size: int = 1
    context_parallel_size: int = 1
    expert_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    @classmethod
    def resolve(
        cls,
        data_parallel_size: SizeArg,
        tensor_parallel_size: SizeArg,
        *,
        world_size: int,
        num_nodes: int,
        devices_per_node: int,
        per_node_known: bool = True,
        data_parallel_replicate_size: SizeArg = 1,
        context_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
    ) -> MeshLayout:
        """Turn user sizes (ints or ``"auto"``) into concrete ones, or raise a :class:`MeshSizeError` that says why.

        ``"auto"`` for both puts tensor parallelism within a node (``devices_per_node``) and data
        parallelism across nodes (``num_nodes``), because TP communicates on every layer and wants the
        fastest links. One size given and the other ``"auto"``: the other is ``world_size / given``.
        ``per_node_known=False`` says that no launcher variable told how many processes share a node (standalone
        detection, ``DetectedCluster.per_node_known``): ``"auto"`` for both sizes is then refused with more than
        one process, since it could put tensor parallelism across nodes; one size given still works.

        ``data_parallel_replicate_size`` splits the data-parallel ranks into that many replicas (HSDP); it must
        divide ``data_parallel_size``. ``"auto"`` replicates across nodes and shards within one
        (``num_nodes`` replicas) when tensor parallelism is off and there is more than one node, and is 1
        (plain FSDP) otherwise: with TP inside a node, a shard group per node would hold one rank, so nothing
        would be sharded at all. Unknown processes per node also give 1.
        ``context_parallel_size`` (an int) takes its ranks first: the data-parallel and tensor-parallel sizes are
        resolved as above over ``world_size / cp`` ranks and ``devices_per_node / cp`` devices per node.
        ``expert_parallel_size`` borrows its ranks from the ranks that shard each replica (it does not change the
        world size) and must divide ``data_parallel_size / data_parallel_replicate_size``.
        ``pipeline_parallel_size`` (an int) takes its ranks before everything else: the rest is resolved as above
        over ``world_size / pp`` ranks, per stage (with ``"auto"`` for both sizes, over ``num_nodes / pp`` nodes when
        the stages divide the nodes, else within the devices a stage gets).
        The error is a ``ValueError`` and, like Lightning's for sizes whose product is not the world size,
        a ``RuntimeError``.
        """
        check_size_arg("data_parallel_replicate_size", data_parallel_replicate_size)
        cp = check_context_parallel_size(context_parallel_size)
        ep = check_expert_parallel_size(expert_parallel_size)
        pp = check_pipeline_parallel_size(pipeline_parallel_size)
        if world_size % pp:
            raise MeshSizeError(
                f"`pipeline_parallel_size={pp}` must divide the world size ({world_size}), but it does not. Choose it"
                f" among {_divisors(world_size)}."
            )
        if pp > 1:  # resolve one stage's mesh; the pipeline axis goes outside it
            stage_nodes = num_nodes // pp if num_nodes % pp == 0 else 1
            try:
                stage = cls.resolve(
                    data_parallel_size,
                    tensor_parallel_size,
                    world_size=world_size // pp,
                    num_nodes=stage_nodes,
                    devices_per_node=world_size // pp // stage_nodes,
                    per_node_known=per_node_known,
                    data_parallel_replicate_size=data_parallel_replicate_size,
                    context_parallel_size=context_parallel_size,
                    expert_parallel_size=expert_parallel_size,
                )
            except MeshSizeError as error:
                raise MeshSizeError(
                    f"With `pipeline_parallel_size={pp}`, each stage's mesh has {world_size // pp} of the {world_size}"
                    f" ranks (the world size below is a stage's): {error}"
                ) from None
            return dataclasses.replace(stage, pipeline_parallel_size=pp)
        if ep > 1 and cp > 1:
            raise MeshSizeError(
                f"`expert_parallel_size={ep}` with `context_parallel_size={cp}` is not supported yet: the expert axis"
                " would have to span the context-parallel ranks too. Use one of them, or set the other to 1."
            )
        if world_size % cp:
            raise MeshSizeError(
                f"`context_parallel_size={cp}` must divide the world size ({world_size}), but it does not. Choose it"
                f" among {_divisors(world_size)}."
            )
        if data_parallel_size == "auto" and tensor_parallel_size == "auto" and cp > 1 and devices_per_node % cp:
            raise MeshSizeError(
                f'`data_parallel_size="auto"` and `tensor_parallel_size="auto"` put tensor parallelism within a node,'
                f" but `context_parallel_size={cp}` does not divide the {devices_per_node} devices per node. Pass"
                " explicit sizes, or a context-parallel size among"
                f" {[d for d in _divisors(devices_per_node) if world_size % d == 0]}."
            )
        dp, tp = cls._resolve_2d(
            data_parallel_size,
            tensor_parallel_size,
            world_size=world_size // cp,
            num_nodes=num_nodes,
            devices_per_node=max(devices_per_node // cp, 1),
            per_node_known=per_node_known,
            context_parallel_size=cp,
        )
        replicate = data_parallel_replicate_size
        if replicate == "auto":
            auto_hsdp = (
                tp == 1 and cp == 1 and num_nodes > 1 and per_node_known and num_nodes * devices_per_node == world_size
            )
            return cls._with_experts(dp, tp, num_nodes if auto_hsdp else 1, cp, ep)
        assert isinstance(replicate, int)  # narrowed by check_size_arg; not user-facing
        if dp % replicate:
            raise MeshSizeError(
                f"`data_parallel_replicate_size={replicate}` must divide the data-parallel size ({dp}, the replicas"
                f" x the ranks that shard each replica), but it does not. Choose it among {_divisors(dp)}, or"
                " change `data_parallel_size`."
            )
        return cls._with_experts(dp, tp, replicate, cp, ep)

    @classmethod
    def _with_experts(cls, dp: int, tp: int, replicate: int, cp: int, ep: int) -> MeshLayout:
        """The layout, once the expert axis is known to fit in the ranks that shard each replica."""
        shard = dp // replicate
        if shard % ep:
            where = (
                f"the ranks that shard each replica (`data_parallel_size={dp}` / `data_parallel_replicate_size="
                f"{replicate}` = {shard})"
                if replicate > 1
                else f"the data-parallel size ({dp})"
            )
            raise MeshSizeError(
                f"`expert_parallel_size={ep}` must divide {where}: the expert axis borrows its ranks from them, and"
                f" tensor-parallel peers keep the same experts. Choose it among {_divisors(shard)}, or change the"
                " data-parallel sizes."
            )
        return cls(dp, tp, replicate, cp, ep)

    @staticmethod
    def _resolve_2d(
        data_parallel_size: SizeArg,
        tensor_parallel_size: SizeArg,
        *,
        world_size: int,
        num_nodes: int,
        devices_per_node: int,
        per_node_known: bool,
        context_parallel_size: int = 1,
    ) -> tuple[int, int]:
        check_size_arg("data_parallel_size", data_parallel_size)
        check_size_arg("tensor_parallel_size", tensor_parallel_size)
        dp, tp = data_parallel_size, tensor_parallel_size
        if dp == "auto" and tp == "auto":
            if not per_node_known and world_size > 1:
                raise MeshSizeError(
                    f'`data_parallel_size="auto"` and `tensor_parallel_size="auto"` need the number of processes per'
                    f" node, but the launcher did not say how many of the {world_size} processes share a node (no"
                    " LOCAL_WORLD_SIZE, SLURM_NTASKS_PER_NODE, OMPI_COMM_WORLD_LOCAL_SIZE or similar). Pass the sizes,"
                    " e.g. `tensor_parallel_size=<processes per node>` (data parallelism takes the rest), or set"
                    " LOCAL_WORLD_SIZE to the number of processes per node."
                )
            if num_nodes * devices_per_node != world_size:
                raise MeshSizeError(
                    f'`data_parallel_size="auto"` and `tensor_parallel_size="auto"` resolve to the number of'
                    f" nodes ({num_nodes}) x devices per node ({devices_per_node}) = {num_nodes * devices_per_node},"
                    f" but the world size is {world_size}. Pass explicit sizes whose product is {world_size}."
                )
            return num_nodes, devices_per_node
        if dp == "auto" or tp == "auto":
            given_name = "tensor_parallel_size" if dp == "auto" else "data_parallel_size"
            other_name = "data_parallel_size" if dp == "auto" else "tensor_parallel_size"
            given = tp if dp == "auto" else dp
            assert isinstance(given, int)  # narrowed by check_size_arg; not user-facing
            if world_size % given != 0:
                raise MeshSizeError(
                    f'`{given_name}={given}` with `{other_name}="auto"` needs {given} to divide the world size'
                    f" ({world_size}), but it does not. Choose {given_name} among {_divisors(world_size)}."
                )
            other = world_size // given
            return (other, given) if dp == "auto" else (given, other)
        assert isinstance(dp, int) and isinstance(tp, int)
        if dp * tp != world_size:
            cp = context_parallel_size
            if cp > 1:
                raise MeshSizeError(
                    f"The sizes multiplied should equal the world size ({world_size * cp}), but"
                    f" `data_parallel_size={dp}` x `context_parallel_size={cp}` x `tensor_parallel_size={tp}` ="
                    f' {dp * cp * tp}. Choose sizes whose product is {world_size * cp}, or pass "auto" for the data-'
                    " or tensor-parallel size."
                )
            raise MeshSizeError(
                f"The sizes multiplied should equal the world size ({world_size}), but `data_parallel_size={dp}` x"
                f' `tensor_parallel_size={tp}` = {dp * tp}. Choose sizes whose product is {world_size}, or pass "auto"'
                " for one of them."
            )
        return dp, tp

    @property
    def hsdp(self) -> bool:
        """Whether data parallelism is replicated across groups that each shard the model (a 3-D mesh)."""
        return self.data_parallel_replicate_size > 1

    @property
    def data_parallel_shard_size(self) -> int:
        """Ranks that shard one replica of the model."""
        return self.data_parallel_size // self.data_parallel_replicate_size

    @property
    def fsdp_shard_size(self) -> int:
        """Ranks FSDP shards each parameter over: one replica's shards x the context-parallel ranks."""
        return self.data_parallel_shard_size * self.context_parallel_size

    @property
    def expert_shard_size(self) -> int:
        """Ranks of one replica that hold the same experts and FSDP-shard them (``"expert_data_parallel"``)."""
        return self.data_parallel_shard_size // self.expert_parallel_size

    @property
    def world_size(self) -> int:
        return (
            self.pipeline_parallel_size
            * self.data_parallel_size
            * self.context_parallel_size
            * self.tensor_parallel_size
        )

    @property
    def axes(self) -> tuple[str, ...]:
        stage = self._stage_axes
        return (PIPELINE_PARALLEL_AXIS, *stage) if self.pipeline_parallel_size > 1 else stage

    @property
    def shape(self) -> tuple[int, ...]:
        stage = self._stage_shape
        return (self.pipeline_parallel_size, *stage) if self.pipeline_parallel_size > 1 else stage

    @property
    def _stage_axes(self) -> tuple[str, ...]:
        """The axes of one pipeline stage's mesh (the whole mesh without pipeline parallelism)."""
        axes = HSDP_MESH_AXES if self.hsdp else MESH_AXES
        if self.expert_parallel_size > 1:  # the shard axis splits in two; it is flattened back in build()
            return (*axes[:-2], EXPERT_SHARD_AXIS, EXPERT_PARALLEL_AXIS, axes[-1])
        if self.context_parallel_size > 1:
            return (*axes[:-1], CONTEXT_PARALLEL_AXIS, axes[-1])
        return axes

    @property
    def _stage_shape(self) -> tuple[int, ...]:
        shard: tuple[int, ...] = (self.data_parallel_shard_size,)
        if self.expert_parallel_size > 1:
            shard = (self.expert_shard_size, self.expert_parallel_size)
        if self.hsdp:
            data: tuple[int, ...] = (self.data_parallel_replicate_size, *shard)
        else:
            data = shard
        cp = (self.context_parallel_size,) if self.context_parallel_size > 1 else ()
        return (*data, *cp, self.tensor_parallel_size)

    def build(self, device_type: str, backend: str, timeout: timedelta) -> DeviceMesh:
        """Create the named ``DeviceMesh`` (and, for HSDP, its flattened ``"data_parallel"`` axis).

        Needs the default process group to exist already. Every group the mesh creates gets ``timeout`` (with NCCL
        and gloo): left alone, ``init_device_mesh`` gives its sub-groups torch's default instead of the strategy's, so a
        hang inside a tensor-parallel collective would outlast the timeout the user set. An axis over all ranks
        (``1 x N``, ``N x 1``) is the default group itself when that group already has ``backend`` and ``timeout``
        (the strategy creates it so): a second communicator over every rank would cost memory on each GPU and
        nothing else.
        """
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        reusable = world_group_reusable(
            default_backend=dist.get_backend(),
            default_timeout=group_timeout(device_type),
            backend=backend,
            timeout=timeout,
            cuda_available=torch.cuda.is_available(),
        )

        def override(size: int) -> Any:  # fresh options per axis: torch writes each group's name and ranks into them
            if reusable and size == world:
                return None  # init_device_mesh takes the default group for an axis over all ranks with no override
            options = group_options(backend, timeout)
            return (backend, options) if options is not None else None

        overrides = {name: override(size) for name, size in zip(self.axes, self.shape, strict=True)}
        by_axis: dict[int | str, Any] = {name: value for name, value in overrides.items() if value is not None}
        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=self.axes, backend_override=by_axis or None)
        # No public API names a flattened axis in torch 2.13/2.14; torchtitan relies on the same method.
        if self.expert_parallel_size > 1:
            experts: tuple[str, ...] = (EXPERT_SHARD_AXIS, EXPERT_PARALLEL_AXIS)
            if self.hsdp:
                mesh[experts]._flatten(HSDP_MESH_AXES[1], backend_override=override(self.data_parallel_shard_size))
                experts = (HSDP_MESH_AXES[0], *experts)
            mesh[experts]._flatten(MESH_AXES[0], backend_override=override(self.data_parallel_size))
        elif self.hsdp:
            mesh[HSDP_MESH_AXES[:2]]._flatten(MESH_AXES[0], backend_override=override(self.data_parallel_size))
        if self.context_parallel_size > 1:
            data_axes = HSDP_MESH_AXES[:2] if self.hsdp else MESH_AXES[:1]
            tokens = self.data_parallel_size * self.context_parallel_size
            mesh[tuple([*data_axes, CONTEXT_PARALLEL_AXIS])]._flatten(TOKEN_AXIS, backend_override=override(tokens))
            if self.hsdp:
                mesh[(HSDP_MESH_AXES[1], CONTEXT_PARALLEL_AXIS)]._flatten(
                    SHARD_CONTEXT_AXIS, backend_override=override(self.fsdp_shard_size)
                )
        return mesh
