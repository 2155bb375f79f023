"""The process groups of the mesh's axes: the strategy's timeout on each, and the default group reused where it can be.

``init_device_mesh`` takes a group's timeout only through backend options, and reads none back through a public
API; these helpers build those options, read a group's timeout, and decide when an axis over every rank can be the
default group itself (:meth:`modelpar._mesh.MeshLayout.build` uses all three). :func:`binds_device` decides whether
the default group is bound to a device, which decides how ``init_device_mesh`` creates the axes' groups.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

__all__ = ["binds_device", "group_options", "group_timeout", "world_group_reusable"]


def binds_device(backend: str, device_type: str) -> bool:
    """Whether the default group is created bound to the rank's device (``device_id``): only for NCCL on CUDA.

    Binding creates NCCL's communicator eagerly on the right GPU, and ``init_device_mesh`` then splits it for each
    axis (one ``ncclCommSplit`` per axis instead of one group per sub-mesh). A bound gloo group sends
    ``init_device_mesh`` down that same split path, which gloo cannot take (torch 2.11: "No device(s) specified";
    with no override, the deep copy of gloo's options fails), so ranks sharing one GPU over gloo could build no
    mesh. Unbound, each axis is a ``new_group`` that takes the strategy's timeout from the options.

    ``backend`` is what ``init_process_group`` is given: a name (``"nccl"``, ``"gloo"``) or a per-device list
    (``"cpu:gloo,cuda:nccl"``), in which the CUDA entry decides.
    """
    if device_type != "cuda":
        return False
    by_device = [part.split(":", 1) for part in backend.lower().replace(" ", "").split(",") if part]
    names = [entry[1] for entry in by_device if len(entry) == 2 and entry[0] == "cuda"]
    names += [entry[0] for entry in by_device if len(entry) == 1]
    return names[:1] == ["nccl"]


def world_group_reusable(
    *,
    default_backend: str,
    default_timeout: timedelta | None,
    backend: str,
    timeout: timedelta,
    cuda_available: bool,
) -> bool:
    """Whether a mesh axis over all ranks can be the default process group rather than a new one.

    Only if that group communicates as the mesh must (the same ``backend``) and gives up after the same
    ``timeout`` (``default_timeout``: ``None`` where it cannot be read). ``init_device_mesh`` itself refuses
    a gloo default group on a machine with CUDA (it creates a group for the mesh's device), and then that group
    needs the timeout override.
    """
    if default_backend != backend or default_timeout != timeout:
        return False
    return not (cuda_available and backend == "gloo")


def group_options(backend: str, timeout: timedelta) -> Any:
    """Backend options carrying ``timeout``, the only way ``init_device_mesh`` takes a timeout for its groups.

    For NCCL and gloo; other backends (MPI, vendor plugins) have no options type torch exposes, so their mesh
    groups keep torch's default timeout (``None`` here) while the default group still gets the strategy's.
    """
    import torch.distributed as dist

    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
    elif backend == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    else:
        return None
    options._timeout = timeout
    return options


def group_timeout(device_type: str, group: Any = None) -> timedelta | None:
    """The timeout of ``group``'s backend (the default group's: ``None``) for ``device_type``; ``None`` if unknown.

    Read from the backend's options, where torch keeps it (no public getter in torch 2.13/2.14), to reuse the
    default group for an axis over all ranks only when this is the strategy's timeout.
    """
    import torch
    import torch.distributed as dist

    try:
        pg: Any = group if group is not None else dist.group.WORLD
        timeout = pg._get_backend(torch.device(device_type)).options._timeout
    except (AttributeError, RuntimeError, ValueError):  # no such backend for the device, or another torch
        return None
    return timeout if isinstance(timeout, timedelta) else None
