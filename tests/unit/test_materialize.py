"""Meta-device materialization in one process: the order of the hooks, real tensors kept, the warnings.

Every "equals eager" check builds the same module eagerly after the same seed: materialization must
consume the random stream as construction does and land on the same values, bit for bit.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from modelpar._init.expert_blocks import blocks_equal_one_draw, expert_blocks, is_fused_experts
from modelpar._init.materialize import materialize_module
from modelpar.models import Llama, LlamaConfig
from modelpar.models.moe import GroupedExperts

CPU = torch.device("cpu")
CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=64, max_seq_len=16)


def on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return build()


def eager(build: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build()


def materialized(build: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    module = on_meta(build)
    torch.manual_seed(seed)
    materialize_module(module, CPU)
    return module


def assert_same_tensors(got: nn.Module, want: nn.Module) -> None:
    want_state = want.state_dict()
    for name, t in got.state_dict().items():
        torch.testing.assert_close(t, want_state[name], atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def messages(fn: Callable[[], object]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught]


class Bare(nn.Module):
    """Owns a tensor and has no ``reset_parameters``: only a parent hook can initialize it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(4))


class ParentWins(nn.Module):
    """A parent whose ``reset_parameters`` customizes its children (runs after them, as in ``__init__``)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 3)
        self.bare = Bare()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.first.weight, 0.5)
        nn.init.ones_(self.bare.scale)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = ParentWins()
        self.head = nn.Linear(3, 2)


class WithRootHook(nn.Module):
    """No tensors of its own; ``init_weights`` (the root hook) overrides everything below it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.bare = Bare()
        self.calls = 0

    def init_weights(self) -> None:
        self.calls += 1
        with torch.no_grad():
            self.body[1].weight.copy_(torch.arange(16.0).view(4, 4))
            self.bare.scale.fill_(2.0)


def test_children_are_initialized_first_and_a_parent_reset_parameters_wins_as_in_eager_construction() -> None:
    got, want = materialized(Outer), eager(Outer)
    assert_same_tensors(got, want)
    assert torch.equal(got.inner.first.weight, torch.full((4, 4), 0.5))  # the parent's value, not kaiming
    assert torch.equal(got.inner.bare.scale, torch.ones(4))


def test_a_model_of_default_initializers_equals_eager_construction() -> None:
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8), nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(8, 2))

    assert_same_tensors(materialized(build), eager(build))


def test_the_root_init_weights_is_called_once_last_and_wins() -> None:
    module = materialized(WithRootHook)
    assert module.calls == 1
    assert torch.equal(module.body[1].weight, torch.arange(16.0).view(4, 4))
    assert torch.equal(module.bare.scale, torch.full((4,), 2.0))
    # body[0] keeps its own default init, drawn as in eager construction.
    assert torch.equal(module.body[0].weight, eager(WithRootHook).body[0].weight)


def test_llama_built_on_meta_equals_eager_construction_and_leaves_the_random_stream_where_eager_does() -> None:
    want = eager(lambda: Llama(CFG))
    want_rng = torch.get_rng_state()
    torch.manual_seed(0)  # before construction, as a user does; the meta device draws nothing
    with torch.device("meta"):
        got = Llama(CFG)
    materialize_module(got, CPU)
    assert_same_tensors(got, want)
    assert torch.equal(torch.get_rng_state(), want_rng)


def test_a_partly_meta_model_keeps_its_real_tensors_and_initializes_the_meta_ones() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # real, like loaded weights
    with torch.device("meta"):
        model.append(nn.Linear(4, 4))
        model[1].bias = nn.Parameter(torch.empty(4))  # a meta tensor beside a real one in one module
    real = {name: (t, t.detach().clone()) for name, t in model.state_dict(keep_vars=True).items() if not t.is_meta}
    torch.manual_seed(0)
    materialize_module(model, CPU)
    for name, (t, value) in real.items():
        assert model.get_parameter(name) is t, name
        assert torch.equal(t, value), f"{name} changed"
    # model[1] ran its reset_parameters for the bias (drawing weight, then bias) and got its weight back;
    # model[2] is initialized from the stream that follows.
    torch.manual_seed(0)
    want_1, want_2 = nn.Linear(4, 4), nn.Linear(4, 4)
    assert torch.equal(model[1].bias, want_1.bias)
    assert torch.equal(model[2].weight, want_2.weight)
    assert torch.equal(model[2].bias, want_2.bias)


def test_a_module_without_meta_tensors_is_not_touched() -> None:
    calls = []

    class Counting(nn.Linear):
        def reset_parameters(self) -> None:
            calls.append(self.weight.is_meta)
            super().reset_parameters()

    model = nn.Sequential(Counting(4, 4))
    calls.clear()
    with torch.device("meta"):
        model.append(Counting(4, 4))
    calls.clear()
    materialize_module(model, CPU)
    assert calls == [False]  # only the new, meta one


def test_tied_weights_stay_tied_after_materialization() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.out = nn.Linear(4, 8, bias=False)
            self.out.weight = self.embed.weight

    model = materialized(Tied)
    assert model.out.weight is model.embed.weight
    assert not model.embed.weight.is_meta
    assert torch.isfinite(model.embed.weight).all()


class ParentForgets(nn.Module):
    """A parent ``reset_parameters`` that initializes one child and forgets the other (which has no init of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.bare = Bare()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.linear.bias)


def test_a_tensor_no_initializer_wrote_is_named_with_its_module_path_in_a_warning_and_holds_nan() -> None:
    class Uncovered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2)
            self.bare = Bare()

    with pytest.warns(
        UserWarning, match=r"initialization incomplete.*: `bare\.scale` \(Bare\)\. .*re-initialization: Bare\.$"
    ):
        materialized(Uncovered)
    # A parent's reset_parameters() runs, but does not touch the child's tensor: named all the same.
    with pytest.warns(UserWarning, match=r"initialization incomplete.*: `inner\.bare\.scale` \(Bare\)\. "):
        model = materialized(lambda: nn.ModuleDict({"inner": ParentForgets()}))
    assert torch.isnan(model.inner.bare.scale).all()  # a marker, not stray memory such as -2.35e38
    # Written by a parent (ParentWins) or the root hook (WithRootHook): no warning.
    for covered in (ParentWins, WithRootHook, Outer):
        assert not [m for m in messages(lambda c=covered: materialized(c)) if "incomplete" in m], covered


def test_a_tensor_written_only_partly_is_named_as_partly_written() -> None:
    class Half(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bare = Bare()

        def reset_parameters(self) -> None:
            with torch.no_grad():
                self.bare.scale.data[:2] = 1.0  # through .data: no version counter would see it

    with pytest.warns(UserWarning, match=r"`bare\.scale` \(Bare, partly\)"):
        model = materialized(Half)
    assert torch.equal(model.bare.scale[:2], torch.ones(2)) and torch.isnan(model.bare.scale[2:]).all()


def test_a_parent_hook_is_skipped_with_a_warning_when_its_subtree_has_real_tensors() -> None:
    torch.manual_seed(0)
    model = Outer()
    loaded = model.inner.first.weight.detach().clone() * 3  # a "loaded" value the parent's hook would overwrite
    with torch.no_grad():
        model.inner.first.weight.copy_(loaded)
    with torch.device("meta"):
        model.inner.second = nn.Linear(4, 3)
    with pytest.warns(
        UserWarning, match=r"`inner` \(ParentWins\)\.reset_parameters\(\) was not called.*`inner\.first\.weight`"
    ):
        materialize_module(model, CPU)
    assert torch.equal(model.inner.first.weight, loaded)
    assert not model.inner.second.weight.is_meta


def test_the_root_hook_is_skipped_with_a_warning_when_the_model_has_real_tensors() -> None:
    model = WithRootHook()
    with torch.device("meta"):
        model.body.append(nn.Linear(4, 4))
    with pytest.warns(UserWarning, match=r"the root WithRootHook\.init_weights\(\) was not called"):
        materialize_module(model, CPU)
    assert model.calls == 0
    assert not model.body[2].weight.is_meta


def test_a_reset_parameters_that_recreates_a_tensor_on_meta_raises() -> None:
    class Recreates(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(2))

        def reset_parameters(self) -> None:
            self.weight = nn.Parameter(torch.empty(2, device="meta"))

    with pytest.raises(RuntimeError, match=r"still on the meta device: weight\."):
        materialized(Recreates)


def test_full_size_buffers_are_reused_from_tensor_to_tensor_and_hold_no_more_than_were_in_use_at_once() -> None:
    from modelpar._init.full_size import Scratch

    scratch = Scratch()
    like = torch.empty(4, 6)
    first = scratch.take(like)
    assert first.shape == (4, 6) and first.is_contiguous()
    scratch.give(first)
    smaller = scratch.take(torch.empty(3, 5))
    assert smaller.data_ptr() == first.data_ptr()  # the same memory, no new pages to fault in
    other = scratch.take(like)  # in use at the same time: a second buffer
    assert other.data_ptr() != smaller.data_ptr()
    scratch.give(smaller)
    scratch.give(other)
    larger = scratch.take(torch.empty(10, 10))  # replaces the largest free one that is too small
    scratch.give(larger)
    assert sorted(b.numel() for b in scratch._free[(torch.float32, CPU)]) == [24, 100]


# Fused expert tensors ([experts, rows, cols]) are drawn a few experts at a time. One rank's FSDP mesh makes them
# DTensors (the sharded path) in one process; tests/distributed/test_meta_init_on_cpu.py checks uneven shards.


@pytest.fixture
def one_rank_mesh() -> Iterator[DeviceMesh]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


class LargestAllocation(TorchDispatchMode):
    """The most elements of any plain tensor allocated (shards are DTensors here, so only the scratch counts)."""

    _FACTORIES = frozenset(
        [torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.empty_like, torch.ops.aten.new_empty]
    )

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in self._FACTORIES and not isinstance(out, DTensor):
            self.numel = max(self.numel, out.numel())
        return out


def sharded_on_meta(
    build: Callable[[], nn.Module], mesh: DeviceMesh, blocks: Callable[[nn.Module], list[nn.Module]]
) -> nn.Module:
    with torch.device("meta"):
        model = build()
    for block in blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def materialized_measured(model: nn.Module, seed: int = 0) -> int:
    """Materialize ``model`` after ``seed``; the most elements of one plain allocation meanwhile."""
    torch.manual_seed(seed)
    with LargestAllocation() as largest:
        materialize_module(model, CPU)
    return largest.numel


def assert_same_full_tensors(got: nn.Module, want: nn.Module) -> None:
    want_state = want.state_dict()
    for name, t in got.state_dict().items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        torch.testing.assert_close(full, want_state[name], atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_expert_blocks_hold_a_multiple_of_16_elements_and_the_remainder_joins_the_last_block() -> None:
    assert expert_blocks(4, 48) == [(0, 1), (1, 1), (2, 1), (3, 1)]  # 48 = 3 x 16: one expert a block
    assert expert_blocks(40, 15) == [(0, 16), (16, 24)]  # 16 x 15 elements; 8 left over join the last
    assert expert_blocks(5, 6) == [(0, 5)]  # fewer experts than a block: one draw
    assert expert_blocks(6, 8) == [(0, 2), (2, 2), (4, 2)]


def test_only_the_cpu_generator_draws_blocks_with_the_values_of_one_draw() -> None:
    assert blocks_equal_one_draw(torch.device("cpu"))
    # CUDA's Philox offsets a launch by the elements before it: a block is not the full draw's part.
    assert not blocks_equal_one_draw(torch.device("cuda", 0))


def test_a_sharded_3d_tensor_is_drawn_in_blocks_and_others_whole(one_rank_mesh: DeviceMesh) -> None:
    # The device type is not asked (CUDA draws in blocks too, coherent but not eager's values): GPU suite.
    assert is_fused_experts(distribute_tensor(torch.zeros(4, 3, 5), one_rank_mesh, [Shard(0)]))
    assert not is_fused_experts(distribute_tensor(torch.zeros(4, 3), one_rank_mesh, [Shard(0)]))  # 2-D: whole
    assert not is_fused_experts(torch.zeros(4, 3, 5))  # not sharded: no stand-in needed


class ExpertsAndHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = GroupedExperts(16, 32, 8)
        self.head = nn.Linear(16, 4)


def test_fused_experts_are_drawn_one_expert_at_a_time_with_the_values_of_eager_construction(
    one_rank_mesh: DeviceMesh,
) -> None:
    model = sharded_on_meta(ExpertsAndHead, one_rank_mesh, lambda m: [m.experts])
    largest = materialized_measured(model)
    assert_same_full_tensors(model, eager(ExpertsAndHead))
    # w1 is [8, 32, 16]: one expert (512 elements, a multiple of 16) at a time, not the 4096 of the whole.
    assert largest == 32 * 16, largest


def test_a_llama_moe_built_on_meta_and_sharded_equals_eager_construction(one_rank_mesh: DeviceMesh) -> None:
    cfg = LlamaConfig(**{**CFG.__dict__, "n_experts": 4, "top_k": 2})
    model = sharded_on_meta(lambda: Llama(cfg), one_rank_mesh, lambda m: list(m.layers))
    largest = materialized_measured(model)
    assert_same_full_tensors(model, eager(lambda: Llama(cfg)))
    experts = model.layers[0].moe.experts.w1
    assert largest < experts.numel(), (largest, experts.shape)


class ParentInitializesExperts(nn.Module):
    """A root ``init_weights`` over another module's fused tensors, as Hugging Face's ``_init_weights`` does."""

    def __init__(self, shape: tuple[int, int, int], initializers: list[str]) -> None:
        super().__init__()
        self.initializers = initializers
        self.experts = nn.ModuleList([Holder(torch.empty(shape)) for _ in initializers])
        self.init_weights()

    def init_weights(self) -> None:
        for holder, name in zip(self.experts, self.initializers, strict=True):
            {**FUSED_INITIALIZERS, **REFUSED_INITIALIZERS}[name](holder.weight)


class Holder(nn.Module):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(value)


def normal_(tensor: torch.Tensor) -> torch.Tensor:
    """Named and dispatched like ``nn.init``'s (so handled whole); it catches the refusal of an op inside."""
    if torch.overrides.has_torch_function_unary(tensor):
        return torch.overrides.handle_torch_function(normal_, (tensor,), tensor)  # type: ignore[no-any-return]
    with torch.no_grad():
        tensor.normal_()
        with contextlib.suppress(Exception):
            tensor.bernoulli_(torch.full(tensor.shape, 0.5))  # a tensor of probabilities: refused in blocks
    return tensor


FUSED_INITIALIZERS: dict[str, Callable[[torch.Tensor], Any]] = {
    "normal_": lambda t: nn.init.normal_(t, std=0.02),
    "uniform_": lambda t: nn.init.uniform_(t, -0.1, 0.1),
    "trunc_normal_": lambda t: nn.init.trunc_normal_(t, std=0.02),  # uniform_, erfinv_, mul_, add_, clamp_
    "kaiming_uniform_": lambda t: nn.init.kaiming_uniform_(t, a=math.sqrt(5)),
    "xavier_normal_": nn.init.xavier_normal_,  # fan_out counts the experts: the full shape's
    "zeros_": nn.init.zeros_,
    "constant_": lambda t: nn.init.constant_(t, 0.5),
    "Tensor.normal_ through .data": lambda t: t.data.normal_(0.0, 0.02),
    "Tensor.bernoulli_ with a float p": lambda t: t.data.bernoulli_(0.3),
    "Tensor.exponential_": lambda t: t.data.exponential_(),
    "Tensor.log_normal_": lambda t: t.data.log_normal_(),
    "Tensor.cauchy_": lambda t: t.data.cauchy_(),
    "Tensor.geometric_": lambda t: t.data.geometric_(0.3),
    "Tensor.random_": lambda t: t.data.random_(0, 100),
}
#: Refused in blocks, so drawn at full size from the random state before them.
REFUSED_INITIALIZERS: dict[str, Callable[[torch.Tensor], Any]] = {
    # Blocks would draw from that generator before falling back.
    "normal_ with a generator of its own": lambda t: nn.init.normal_(t, generator=torch.Generator().manual_seed(1)),
    "normal_, then a refused op caught": normal_,
}


@pytest.mark.parametrize("shape", [(6, 4, 4), (40, 3, 5), (3, 7, 5)])
def test_initializers_on_fused_experts_equal_one_full_draw_in_blocks_and_fall_back_to_it_where_they_must(
    one_rank_mesh: DeviceMesh, shape: tuple[int, int, int]
) -> None:
    """(6, 4, 4): one expert a block; (40, 3, 5): 16 experts, then 24 (the last 8 joined); (3, 7, 5): one block."""
    names = list(FUSED_INITIALIZERS)
    for initializers in (names + list(REFUSED_INITIALIZERS), names):

        def build(initializers: list[str] = initializers) -> nn.Module:
            return ParentInitializesExperts(shape, initializers)

        model = sharded_on_meta(build, one_rank_mesh, lambda m: list(m.experts))
        largest = materialized_measured(model)
        assert_same_full_tensors(model, eager(build))
        if initializers != names:  # the refused ones are drawn at full size
            assert largest == math.prod(shape), largest
        else:
            assert largest == max(n for _, n in expert_blocks(shape[0], shape[1] * shape[2])) * shape[1] * shape[2]


class OwnUnusualInit(nn.Module):
    """A ``reset_parameters`` that writes its fused tensor in a way blocks cannot: it runs again at full size."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.weight = nn.Parameter(torch.empty(4, 4, 8))
        self.bias = nn.Parameter(torch.empty(4))
        self.calls = 0
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.calls += 1
        nn.init.normal_(self.bias)  # drawn before the refused op: drawn again from the same state
        if self.how == "orthogonal_":  # QR of a flattened copy
            nn.init.orthogonal_(self.weight)
            return
        try:
            with torch.no_grad():
                self.weight.copy_(torch.randn(4, 4, 8))
        except Exception:
            if self.how != "swallows the refusal":
                raise


@pytest.mark.parametrize("how", ["copy_", "swallows the refusal", "orthogonal_"])
def test_a_hook_that_writes_a_fused_tensor_otherwise_runs_again_at_full_size_from_the_same_random_state(
    one_rank_mesh: DeviceMesh, how: str
) -> None:
    model = sharded_on_meta(lambda: OwnUnusualInit(how), one_rank_mesh, lambda m: [])
    want = eager(lambda: OwnUnusualInit(how))
    want_rng = torch.get_rng_state()
    materialized_measured(model)
    assert_same_full_tensors(model, want)
    assert torch.equal(torch.get_rng_state(), want_rng)
    assert model.calls == 3  # at construction (on meta), the refused run, then the full-size one


def test_a_hugging_face_qwen3_moe_draws_its_fused_experts_in_blocks_with_the_values_of_one_process(
    one_rank_mesh: DeviceMesh,
) -> None:
    """The one-process build here is the same meta model materialized unsharded (plain tensors, the same hooks in
    the same order): eager construction draws each ``nn.Linear`` before ``post_init`` and so consumes more."""
    pytest.importorskip("transformers")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from hf_tiny import TINY_SIZES

    sizes = {"num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "head_dim": 8}
    config = Qwen3MoeConfig(**{**TINY_SIZES, **sizes})
    want = on_meta(lambda: Qwen3MoeForCausalLM(config))
    torch.manual_seed(0)
    materialize_module(want, CPU)
    model = sharded_on_meta(lambda: Qwen3MoeForCausalLM(config), one_rank_mesh, lambda m: list(m.model.layers))
    largest = materialized_measured(model)
    assert_same_full_tensors(model, want)
    gate_up = want.model.layers[0].mlp.experts.gate_up_proj  # [16, 48, 32]: 24576 elements, 1536 an expert
    assert largest < gate_up.numel() // 4, (largest, tuple(gate_up.shape))  # the embedding (4096) is the largest
