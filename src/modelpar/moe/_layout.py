"""Where experts live on the strategy's mesh: the expert axis, and the mesh the experts' FSDP shards over.

See ``modelpar._mesh.layout`` for the layout: the expert axis (``"expert_parallel"``) borrows the inner ranks of the
data-parallel shard ranks; ``"expert_data_parallel"`` (x ``"data_parallel_replicate"`` under HSDP) are the ranks that
hold the same experts, over which FSDP shards them. Every token rank (``"data_parallel"``) sees distinct tokens, so
the expert gradients, summed over the expert axis by the all-to-all's backward, are averaged over all of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modelpar._mesh.layout import EXPERT_PARALLEL_AXIS, EXPERT_SHARD_AXIS, HSDP_MESH_AXES
from modelpar._mesh.submeshes import token_mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["expert_fsdp_mesh", "expert_parallel_mesh", "expert_parallel_size", "token_ranks"]


def expert_parallel_mesh(device_mesh: DeviceMesh) -> DeviceMesh | None:
    """The 1-D ``"expert_parallel"`` axis of a strategy mesh, or ``None`` when it has none (``ep = 1``)."""
    names = tuple(device_mesh.mesh_dim_names or ())
    if names == (EXPERT_PARALLEL_AXIS,):
        return device_mesh
    return device_mesh[EXPERT_PARALLEL_AXIS] if EXPERT_PARALLEL_AXIS in names else None


def expert_parallel_size(device_mesh: DeviceMesh) -> int:
    mesh = expert_parallel_mesh(device_mesh)
    return mesh.size() if mesh is not None else 1


def expert_fsdp_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``fully_shard`` takes for expert weights split over the expert axis: the ranks holding the same ones.

    1-D ``"expert_data_parallel"``, or 2-D ``("data_parallel_replicate", "expert_data_parallel")`` under HSDP
    (replicas all-reduce, the shard ranks reduce-scatter). Raises ``ValueError`` on a mesh without an expert axis.
    """
    names = tuple(device_mesh.mesh_dim_names or ())
    if EXPERT_SHARD_AXIS not in names:
        raise ValueError(
            f"The mesh has axes {list(names)} and no {EXPERT_SHARD_AXIS!r} axis: expert parallelism is off. Pass the"
            " strategy's mesh of a run with `expert_parallel_size > 1`."
        )
    if HSDP_MESH_AXES[0] in names:
        return device_mesh[(HSDP_MESH_AXES[0], EXPERT_SHARD_AXIS)]
    return device_mesh[EXPERT_SHARD_AXIS]


def token_ranks(device_mesh: DeviceMesh) -> int:
    """How many ranks see distinct tokens (data parallel x context parallel): the expert gradients' divisor."""
    return token_mesh(device_mesh).size()
