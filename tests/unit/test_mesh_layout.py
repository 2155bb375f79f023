"""Mesh size resolution and its error messages (pure arithmetic, no process group)."""

from datetime import timedelta

import pytest

from modelpar import MeshLayout, MeshSizeError
from modelpar._mesh.groups import binds_device, world_group_reusable


def resolve(dp, tp, world=4, nodes=1, per_node=4):
    return MeshLayout.resolve(dp, tp, world_size=world, num_nodes=nodes, devices_per_node=per_node)


@pytest.mark.parametrize(
    ("dp", "tp", "nodes", "per_node", "expected"),
    [
        ("auto", "auto", 1, 4, (1, 4)),  # one node: all TP
        ("auto", "auto", 2, 2, (2, 2)),  # TP within a node, DP across nodes
        ("auto", "auto", 4, 1, (4, 1)),
        (2, "auto", 1, 4, (2, 2)),  # the other size is world / given
        ("auto", 4, 1, 4, (1, 4)),
        ("auto", 1, 2, 2, (4, 1)),
        (2, 2, 1, 4, (2, 2)),
    ],
)
def test_sizes_resolve_to_a_layout_whose_product_is_the_world_size(dp, tp, nodes, per_node, expected):
    layout = resolve(dp, tp, nodes=nodes, per_node=per_node)
    assert layout.shape == expected


def test_explicit_sizes_with_the_wrong_product_name_the_values_and_the_fix():
    with pytest.raises(MeshSizeError) as e:
        resolve(3, 2)
    assert str(e.value) == (
        "The sizes multiplied should equal the world size (4), but `data_parallel_size=3` x"
        ' `tensor_parallel_size=2` = 6. Choose sizes whose product is 4, or pass "auto" for one of them.'
    )


def test_a_given_size_that_does_not_divide_the_world_lists_the_divisors():
    with pytest.raises(ValueError, match=r"`data_parallel_size=3` with `tensor_parallel_size=\"auto\"` needs 3 to"):
        resolve(3, "auto", world=8, per_node=8)
    with pytest.raises(ValueError, match=r"Choose tensor_parallel_size among \[1, 2, 3, 6\]"):
        resolve("auto", 4, world=6, per_node=6)


def test_auto_sizes_that_disagree_with_the_world_size_say_so():
    with pytest.raises(
        ValueError, match=r"number of nodes \(2\) x devices per node \(4\) = 8, but the world size is 4"
    ):
        resolve("auto", "auto", world=4, nodes=2, per_node=4)


@pytest.mark.parametrize("bad", [0, -1, 2.0, "2", True, None, "AUTO"])
def test_sizes_that_are_not_positive_ints_or_auto_are_rejected(bad):
    with pytest.raises(ValueError, match=rf"`tensor_parallel_size={bad!r}` is not a valid size\. Pass a positive"):
        resolve(1, bad)


@pytest.mark.parametrize(
    ("dp", "tp", "replicate", "nodes", "per_node", "shape"),
    [
        (4, 1, 2, 1, 4, (2, 2, 1)),  # HSDP: replicate outermost, then shard, then TP
        (2, 2, 2, 1, 4, (2, 1, 2)),
        ("auto", 1, "auto", 2, 2, (2, 2, 1)),  # "auto": a replica per node, sharded within it
        ("auto", 1, "auto", 4, 2, (4, 2, 1)),
        ("auto", "auto", "auto", 2, 2, (2, 2)),  # TP within the node: sharding there would be size 1, so plain FSDP
        (4, 1, "auto", 1, 4, (4, 1)),  # one node: nothing to replicate across
        (4, 1, 1, 1, 4, (4, 1)),
    ],
)
def test_replicate_size_makes_a_3d_mesh_with_the_whole_data_parallel_size_kept(
    dp, tp, replicate, nodes, per_node, shape
):
    layout = MeshLayout.resolve(
        dp,
        tp,
        world_size=nodes * per_node,
        num_nodes=nodes,
        devices_per_node=per_node,
        data_parallel_replicate_size=replicate,
    )
    assert layout.shape == shape
    assert layout.data_parallel_size * layout.tensor_parallel_size == nodes * per_node
    assert layout.axes == (
        ("data_parallel_replicate", "data_parallel_shard", "tensor_parallel")
        if len(shape) == 3
        else ("data_parallel", "tensor_parallel")
    )


def test_auto_replicate_without_known_processes_per_node_is_plain_fsdp():
    layout = MeshLayout.resolve(
        4, 1, world_size=4, num_nodes=2, devices_per_node=2, per_node_known=False, data_parallel_replicate_size="auto"
    )
    assert layout.shape == (4, 1)


def test_a_replicate_size_that_does_not_divide_data_parallel_lists_the_choices():
    with pytest.raises(MeshSizeError) as e:
        MeshLayout.resolve(4, 2, world_size=8, num_nodes=1, devices_per_node=8, data_parallel_replicate_size=3)
    assert str(e.value) == (
        "`data_parallel_replicate_size=3` must divide the data-parallel size (4, the replicas x the ranks that shard"
        " each replica), but it does not. Choose it among [1, 2, 4], or change `data_parallel_size`."
    )
    with pytest.raises(MeshSizeError, match=r"`data_parallel_replicate_size=0` is not a valid size"):
        MeshLayout.resolve(4, 1, world_size=4, num_nodes=1, devices_per_node=4, data_parallel_replicate_size=0)


_MINUTE = timedelta(minutes=1)


@pytest.mark.parametrize(
    ("default_backend", "default_timeout", "backend", "cuda", "reusable"),
    [
        ("nccl", _MINUTE, "nccl", True, True),  # the strategy's own default group: one communicator over all ranks
        ("gloo", _MINUTE, "gloo", False, True),
        ("nccl", timedelta(minutes=2), "nccl", True, False),  # another timeout: the axis gets its own group
        ("nccl", None, "nccl", True, False),  # a timeout that cannot be read is not assumed equal
        ("gloo", _MINUTE, "nccl", True, False),  # a user's gloo group cannot serve a NCCL mesh
        ("gloo", _MINUTE, "gloo", True, False),  # init_device_mesh makes a new group here anyway: keep the timeout
    ],
)
def test_an_axis_over_all_ranks_reuses_the_default_group_only_when_it_communicates_alike(
    default_backend, default_timeout, backend, cuda, reusable
):
    got = world_group_reusable(
        default_backend=default_backend,
        default_timeout=default_timeout,
        backend=backend,
        timeout=_MINUTE,
        cuda_available=cuda,
    )
    assert got is reusable


@pytest.mark.parametrize(
    ("backend", "device_type", "bound"),
    [
        ("nccl", "cuda", True),  # NCCL's communicator on the right GPU, split per axis
        ("NCCL", "cuda", True),
        (
            "gloo",
            "cuda",
            False,
        ),  # ranks sharing one GPU over gloo: a bound group sends the mesh down a split gloo lacks
        ("cpu:gloo,cuda:nccl", "cuda", True),  # the CUDA entry decides
        ("cpu:gloo,cuda:gloo", "cuda", False),
        ("cpu:gloo", "cuda", False),
        ("nccl", "cpu", False),  # nothing to bind on the CPU
        ("gloo", "cpu", False),
        ("mpi", "cuda", False),
    ],
)
def test_the_default_group_is_bound_to_the_device_only_for_nccl_on_cuda(backend, device_type, bound):
    assert binds_device(backend, device_type) is bound


def resolve_cp(dp, tp, cp, world=8, nodes=1, per_node=8, replicate=1):
    return MeshLayout.resolve(
        dp,
        tp,
        world_size=world,
        num_nodes=nodes,
        devices_per_node=per_node,
        data_parallel_replicate_size=replicate,
        context_parallel_size=cp,
    )


@pytest.mark.parametrize(
    ("dp", "tp", "cp", "replicate", "nodes", "per_node", "axes", "shape"),
    [
        (2, 2, 2, 1, 1, 8, ("data_parallel", "context_parallel", "tensor_parallel"), (2, 2, 2)),
        ("auto", 2, 2, 1, 1, 8, ("data_parallel", "context_parallel", "tensor_parallel"), (2, 2, 2)),
        (2, "auto", 4, 1, 1, 8, ("data_parallel", "context_parallel", "tensor_parallel"), (2, 4, 1)),
        ("auto", "auto", 2, 1, 2, 4, ("data_parallel", "context_parallel", "tensor_parallel"), (2, 2, 2)),
        (
            4,
            1,
            2,
            2,
            1,
            8,
            ("data_parallel_replicate", "data_parallel_shard", "context_parallel", "tensor_parallel"),
            (2, 2, 2, 1),
        ),
        (8, 1, 1, 1, 1, 8, ("data_parallel", "tensor_parallel"), (8, 1)),  # cp=1: Lightning's 2-D mesh
    ],
)
def test_context_parallelism_adds_its_axis_inside_data_and_outside_tensor_parallel(
    dp, tp, cp, replicate, nodes, per_node, axes, shape
):
    layout = resolve_cp(dp, tp, cp, nodes=nodes, per_node=per_node, replicate=replicate)
    assert (layout.axes, layout.shape) == (axes, shape)
    assert layout.world_size == 8
    # FSDP shards over one replica's data-parallel ranks x the context-parallel ranks
    assert layout.fsdp_shard_size == layout.data_parallel_shard_size * cp


def test_context_parallel_sizes_that_cannot_fit_name_the_values_and_the_fix():
    with pytest.raises(
        MeshSizeError, match=r"`context_parallel_size=3` must divide the world size \(8\).*\[1, 2, 4, 8\]"
    ):
        resolve_cp("auto", 1, 3)
    with pytest.raises(
        MeshSizeError,
        match=r"should equal the world size \(8\), but `data_parallel_size=2` x `context_parallel_size=2` x"
        r" `tensor_parallel_size=1` = 4\.",
    ):
        resolve_cp(2, 1, 2)
    with pytest.raises(MeshSizeError, match=r"`context_parallel_size=4` does not divide the 2 devices per node"):
        resolve_cp("auto", "auto", 4, nodes=4, per_node=2)
    for bad in (0, "auto", 1.5, True):
        with pytest.raises(MeshSizeError, match=r"is not a valid size. Pass a positive integer: the number of ranks"):
            resolve_cp(1, 1, bad)
    assert issubclass(MeshSizeError, ValueError) and issubclass(MeshSizeError, RuntimeError)


def test_the_strategies_validate_context_parallel_size_at_construction():
    from modelpar import ModelParallelStrategy
    from modelpar.trainer import ModelParallelStrategy as TrainerStrategy

    for make in (
        lambda: ModelParallelStrategy(lambda m, d: m, context_parallel_size=0),
        lambda: TrainerStrategy(context_parallel_size="2"),
    ):
        with pytest.raises(MeshSizeError, match="context_parallel_size"):
            make()
