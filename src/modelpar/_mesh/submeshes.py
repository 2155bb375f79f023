"""The submeshes a built mesh is used through: the one ``fully_shard`` takes (:func:`fsdp_mesh`), the
context-parallel axis (:func:`context_parallel_mesh`) and the ranks that hold different tokens (:func:`token_mesh`).

The layout (:mod:`.layout`) decides the axes; these read them back off a ``DeviceMesh``, so a plan, the loss or
the router's statistics take the right ranks without knowing which axes the layout had.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from modelpar._mesh.layout import (
    CONTEXT_PARALLEL_AXIS,
    EXPERT_PARALLEL_AXIS,
    HSDP_MESH_AXES,
    MESH_AXES,
    SHARD_CONTEXT_AXIS,
    TOKEN_AXIS,
)

__all__ = ["context_parallel_mesh", "fsdp_mesh", "token_mesh"]


def fsdp_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``fully_shard`` takes: 2-D ``(replicate, shard)`` for HSDP, the 1-D ``"data_parallel"`` axis otherwise.

    FSDP2 does HSDP when given a 2-D mesh and plain FSDP when given a 1-D one, so passing the flattened
    ``"data_parallel"`` axis of an HSDP mesh would silently shard over every data-parallel rank instead.
    With context parallelism the shard dimension takes in the context-parallel ranks (the flattened
    ``"data_parallel_context_parallel"`` axis, or ``"data_parallel_shard_context_parallel"`` under HSDP): they
    hold the same weights and see different tokens, so their gradients must be averaged too.
    """
    names = device_mesh.mesh_dim_names or ()
    if CONTEXT_PARALLEL_AXIS in names:
        if HSDP_MESH_AXES[0] in names:
            return device_mesh[(HSDP_MESH_AXES[0], SHARD_CONTEXT_AXIS)]
        return device_mesh[TOKEN_AXIS]
    if HSDP_MESH_AXES[0] in names:
        return device_mesh[HSDP_MESH_AXES[:2]]
    if MESH_AXES[0] not in names and EXPERT_PARALLEL_AXIS not in names:
        raise ValueError(
            f"The mesh has axes {list(names)}, but a strategy mesh has {list(MESH_AXES)} or {list(HSDP_MESH_AXES)}."
            " Pass the `device_mesh` the strategy gave `parallelize_fn` (or `self.device_mesh` in `configure_model`)."
        )
    return device_mesh[MESH_AXES[0]]


def context_parallel_mesh(device_mesh: DeviceMesh) -> DeviceMesh | None:
    """The 1-D ``"context_parallel"`` axis of a strategy mesh, or ``None`` when the mesh has none (``cp = 1``).

    A bare 1-D mesh named ``("context_parallel",)`` is that axis itself (no slicing on every attention call).
    """
    names = tuple(device_mesh.mesh_dim_names or ())
    if names == (CONTEXT_PARALLEL_AXIS,):
        return device_mesh
    return device_mesh[CONTEXT_PARALLEL_AXIS] if CONTEXT_PARALLEL_AXIS in names else None


def token_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh of every rank that sees distinct tokens: ``"data_parallel_context_parallel"`` under context
    parallelism, ``"data_parallel"`` otherwise (tensor-parallel peers see the same tokens and are left out).
    A bare 1-D ``("context_parallel",)`` mesh is its own token mesh.
    """
    names = tuple(device_mesh.mesh_dim_names or ())
    if names == (CONTEXT_PARALLEL_AXIS,):
        return device_mesh
    if CONTEXT_PARALLEL_AXIS in names:
        return device_mesh[TOKEN_AXIS]
    return device_mesh[MESH_AXES[0]]
