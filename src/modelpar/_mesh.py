"""The 2-D mesh layout: resolving ``"auto"`` sizes and validating them before any collective.

Everything here is pure arithmetic on values every rank already knows (world size, nodes, devices
per node), so every rank reaches the same verdict and raises the same error: no rank can sit in
``init_process_group`` or ``init_device_mesh`` while another has already failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from modelpar._errors import MeshSizeError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MESH_AXES", "MeshLayout", "SizeArg", "check_size_arg"]

#: Axis names of the mesh, outermost first. Data parallel is outermost so that tensor-parallel peers
#: are neighbouring ranks (on one node, with "auto"), where the frequent TP collectives are cheapest.
MESH_AXES = ("data_parallel", "tensor_parallel")

SizeArg = Literal["auto"] | int


def check_size_arg(name: str, value: object) -> None:
    """Reject anything but a positive int or ``"auto"`` (``bool`` is an ``int`` to Python, not to us).

    :class:`MeshSizeError` (a ``ValueError``): Lightning's strategy does not check them and mostly fails
    later, in its product check, with the ``RuntimeError`` the class derives from as well.
    """
    if value == "auto" and isinstance(value, str):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MeshSizeError(
            f"`{name}={value!r}` is not a valid size. Pass a positive integer (the number of processes"
            f' along the {name.replace("_size", "").replace("_", "-")} axis) or "auto".'
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class MeshLayout:
    """A resolved ``data_parallel x tensor_parallel`` layout whose product is the world size."""

    data_parallel_size: int
    tensor_parallel_size: int

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
    ) -> MeshLayout:
        """Turn user sizes (ints or ``"auto"``) into concrete ones, or raise a :class:`MeshSizeError` that says why.

        ``"auto"`` for both puts tensor parallelism within a node (``devices_per_node``) and data
        parallelism across nodes (``num_nodes``), because TP communicates on every layer and wants the
        fastest links. One size given and the other ``"auto"``: the other is ``world_size / given``.
        ``per_node_known=False`` says that no launcher variable told how many processes share a node (standalone
        detection, ``DetectedCluster.per_node_known``): ``"auto"`` for both sizes is then refused with more than
        one process, since it could put tensor parallelism across nodes; one size given still works.
        The error is a ``ValueError`` and, like Lightning's for sizes whose product is not the world size,
        a ``RuntimeError``.
        """
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
            return cls(num_nodes, devices_per_node)
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
            return cls(other, given) if dp == "auto" else cls(given, other)
        assert isinstance(dp, int) and isinstance(tp, int)
        if dp * tp != world_size:
            raise MeshSizeError(
                f"`data_parallel_size={dp}` x `tensor_parallel_size={tp}` = {dp * tp}, but the world size is"
                f' {world_size}. Choose sizes whose product is {world_size}, or pass "auto" for one of them.'
            )
        return cls(dp, tp)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data_parallel_size, self.tensor_parallel_size)

    def build(self, device_type: str) -> DeviceMesh:
        """Create the named ``DeviceMesh``; needs the default process group to exist already."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_AXES)
