"""Meta-device materialization in one process: the order of the hooks, real tensors kept, the warnings.

Every "equals eager" check builds the same module eagerly after the same seed: materialization must
consume the random stream as construction does and land on the same values, bit for bit.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from modelpar._materialize import materialize_module
from modelpar.models import Llama, LlamaConfig

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

    with pytest.warns(UserWarning, match=r"initialization incomplete.*: `bare\.scale` \(Bare\)\. "):
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
    from modelpar._full_size import Scratch

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
