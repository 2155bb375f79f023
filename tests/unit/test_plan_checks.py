"""``ParallelPlan`` without a process group: construction, pattern matching, pre-flight checks and their messages.

The checks run on meta-device models, as they do on every rank before anything is sharded.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import modelpar.plans
from modelpar.models import Llama, LlamaConfig
from modelpar.plans import LLAMA_PLAN, STYLE_NAMES, ParallelPlan, UnsupportedStyleError, loss_parallel
from modelpar.plans._checkpointing import checkpoint_module, is_checkpointed
from modelpar.plans._checks import matches

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=64, max_seq_len=16)


def meta_llama(cfg: LlamaConfig = CFG) -> Llama:
    with torch.device("meta"):
        return Llama(cfg)


def test_public_surface_is_what_we_mean():
    assert set(modelpar.plans.__all__) == {
        "LLAMA_MOE_PLAN",
        "LLAMA_PLAN",
        "STYLE_NAMES",
        "ActivationCheckpointing",
        "LlamaParallelConfig",
        "ModuleSelector",
        "ParallelPlan",
        "UnsupportedStyleError",
        "llama_tp_plan",
        "loss_parallel",
        "parallelize_llama",
    }
    assert STYLE_NAMES == ("colwise", "rowwise", "colwise_gather", "embedding", "output", "norm", "sequence_gather")


# -- patterns --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "name", "expected"),
    [
        ("layers.*", "layers.0", True),
        ("layers.*", "layers.0.attention", False),  # a star never crosses a dot
        ("layers.*.attention.wq", "layers.11.attention.wq", True),
        ("layers.*.attention.w[qk]", "layers.1.attention.wk", True),
        ("layers.*.attention.w[qk]", "layers.1.attention.wv", False),
        ("norm", "layers.0.norm", False),
        ("*.norm", "layers.norm", True),
        ("Output", "output", False),  # case-sensitive, as module names are
    ],
)
def test_patterns_match_names_segment_by_segment(pattern, name, expected):
    assert matches(pattern, name) is expected


def test_the_llama_plan_gives_each_llama_submodule_its_style():
    styles, units = LLAMA_PLAN._resolve(meta_llama(), 4)
    assert units == ["layers.0", "layers.1"]
    assert styles["tok_embeddings"] == "embedding" and styles["output"] == "output" and styles["norm"] == "norm"
    assert styles["layers.1.attention"] == "sequence_gather" and styles["layers.1.feed_forward.w2"] == "rowwise"
    assert len(styles) == 3 + 2 * 11


# -- construction and replace ----------------------------------------------------------------------------


def test_replace_returns_a_validated_copy_and_leaves_the_original():
    sp = LLAMA_PLAN.replace(sequence_parallel=True, activation_checkpointing="selective", ac_every=2)
    assert sp.sequence_parallel and sp.ac_every == 2 and sp.tensor_parallel == LLAMA_PLAN.tensor_parallel
    assert not LLAMA_PLAN.sequence_parallel and LLAMA_PLAN.activation_checkpointing == "none"
    with pytest.raises(ValueError, match=r"ac_every=0\) must be a positive int"):
        LLAMA_PLAN.replace(ac_every=0)


def test_a_plan_is_frozen_including_its_style_mapping():
    with pytest.raises(dataclasses.FrozenInstanceError):
        LLAMA_PLAN.compile = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        LLAMA_PLAN.tensor_parallel["output"] = "colwise"  # type: ignore[index]
    styles = {"output": "output"}
    plan = ParallelPlan(tensor_parallel=styles)
    styles["output"] = "colwise"  # the caller's dict is copied
    assert plan.tensor_parallel["output"] == "output"


def test_a_plan_accepts_torch_styles_and_lists_of_units():
    plan = ParallelPlan(tensor_parallel={"layers.*.attention.wq": ColwiseParallel()}, fsdp_units=["layers.*"])
    assert plan.fsdp_units == ("layers.*",)
    plan.check(meta_llama(), 4)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"tensor_parallel": {"output": "colwise_rep"}},
            ValueError,
            "ParallelPlan.tensor_parallel: 'output' has the unknown style 'colwise_rep'. Use one of ['colwise', 'rowwise',"
            " 'colwise_gather', 'embedding', 'output', 'norm', 'sequence_gather'], or a"
            " `torch.distributed.tensor.parallel.ParallelStyle`.",
        ),
        (
            {"tensor_parallel": {"output": nn.Linear}},
            TypeError,
            "ParallelPlan.tensor_parallel: 'output' maps to type; a style is one of",
        ),
        ({"tensor_parallel": [("output", "output")]}, TypeError, "must be a mapping of submodule pattern -> style"),
        (
            {"fsdp_units": "layers.*"},
            TypeError,
            "ParallelPlan(fsdp_units='layers.*') must be a tuple of non-empty patterns, such as ('layers.*',), a set of"
            " `nn.Module` classes, such as {TransformerBlock}, or a callable `(module) -> bool`, not a single str.",
        ),
        (
            {"activation_checkpointing": "op"},
            ValueError,
            "ParallelPlan(activation_checkpointing='op') is not a mode. Use one of ['none', 'full', 'selective'].",
        ),
        ({"ac_every": True}, ValueError, "ParallelPlan(ac_every=True) must be a positive int"),
        (
            {"activation_checkpointing": "full", "compile": True},
            ValueError,
            "ParallelPlan(activation_checkpointing='full', compile=True) applies to the FSDP units, but `fsdp_units` is"
            " empty. Name the blocks, e.g. `fsdp_units=('layers.*',)`.",
        ),
        (
            {"loss_parallel": True, "tensor_parallel": {"output": "colwise_gather"}},
            ValueError,
            "ParallelPlan(loss_parallel=True) keeps the LM head's logits vocab-sharded, but no submodule has the style"
            " 'output'.",
        ),
    ],
)
def test_bad_options_are_refused_at_construction(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        ParallelPlan(**kwargs)


# -- pre-flight checks -------------------------------------------------------------------------------------


def test_a_pattern_that_matches_nothing_names_it_and_suggests_the_closest():
    plan = LLAMA_PLAN.replace(tensor_parallel={"layers.*.attn.wq": "colwise"})
    with pytest.raises(ValueError) as caught:
        plan.check(meta_llama(), 2)
    assert str(caught.value).startswith(
        "ParallelPlan.tensor_parallel: the pattern 'layers.*.attn.wq' matches no submodule of Llama. Did you mean"
        " 'layers.*.attention.wq' or "
    )
    assert "Patterns match module names segment by segment ('*' stands for one segment); this model has" in str(
        caught.value
    )
    assert str(caught.value).endswith("Fix the pattern or remove it.")


def test_an_fsdp_unit_pattern_that_matches_nothing_is_refused():
    with pytest.raises(ValueError, match=r"^ParallelPlan\.fsdp_units: the pattern 'blocks\.\*' matches no submodule"):
        LLAMA_PLAN.replace(fsdp_units=("blocks.*",)).check(meta_llama(), 1)


def test_two_styles_for_one_submodule_are_refused():
    plan = ParallelPlan(tensor_parallel={"layers.*.attention.wq": "colwise", "layers.0.*.wq": "rowwise"})
    with pytest.raises(
        ValueError,
        match=re.escape(
            "ParallelPlan.tensor_parallel: 'layers.0.attention.wq' gets two styles, 'colwise' from"
            " 'layers.*.attention.wq' and 'rowwise' from 'layers.0.*.wq'. Give each submodule one pattern."
        ),
    ):
        plan.check(meta_llama(), 2)


def test_a_style_on_a_module_of_another_kind_raises_what_torch_raises():
    plan = ParallelPlan(tensor_parallel={"layers.*.attention": "colwise"})
    with pytest.raises(
        UnsupportedStyleError,
        match=re.escape(
            "ParallelPlan.tensor_parallel: style 'colwise' shards nn.Linear modules, but 'layers.0.attention' (from"
            " 'layers.*.attention') is `Attention`. Point the pattern at its parallelizable children, or use"
            " 'sequence_gather' / 'norm' for a container or a norm."
        ),
    ):
        plan.check(meta_llama(), 2)
    assert issubclass(UnsupportedStyleError, TypeError) and issubclass(UnsupportedStyleError, NotImplementedError)
    with pytest.raises(NotImplementedError):  # torch's own style on the same module
        ColwiseParallel()._apply(nn.LayerNorm(4), None)  # type: ignore[arg-type]


def test_sequence_parallel_needs_a_gather_before_the_column_parallel_projections():
    styles = {k: v for k, v in LLAMA_PLAN.tensor_parallel.items() if k != "layers.*.feed_forward"}
    plan = LLAMA_PLAN.replace(tensor_parallel=styles, sequence_parallel=True)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "ParallelPlan(sequence_parallel=True): 'layers.0.feed_forward.w1' (style 'colwise') would receive the"
            " sequence-sharded residual stream, but no enclosing module gathers it first. Add"
            " {'layers.*.feed_forward': 'sequence_gather'} to tensor_parallel (one all-gather for all the projections"
            " inside), or turn sequence parallelism off."
        ),
    ):
        plan.check(meta_llama(), 2)
    plan.replace(sequence_parallel=False).check(meta_llama(), 2)


def test_dimensions_that_do_not_divide_by_the_tp_size_are_named_with_the_sizes_that_do():
    with pytest.raises(ValueError) as caught:
        LLAMA_PLAN.check(meta_llama(), 3)
    assert str(caught.value) == (
        "tensor_parallel_size=3 must divide every dimension the plan splits across the tensor-parallel ranks, but it"
        " does not divide 'tok_embeddings' num_embeddings=64 (style 'embedding'); 'layers.*.attention.wq'"
        " out_features=32 (style 'colwise'); 'layers.*.attention.wk' out_features=16 (style 'colwise');"
        " 'layers.*.attention.wv' out_features=16 (style 'colwise'); and 7 more. Choose a tensor_parallel_size that"
        " divides them all (1, 2, 4), or change the model."
    )


def test_head_counts_from_the_config_must_divide_even_when_the_shapes_do():
    # dim 64 = 4 heads of 16: every Linear divides by 8, but 4 query and 2 key/value heads do not.
    cfg = LlamaConfig(vocab_size=256, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=128)
    with pytest.raises(ValueError) as caught:
        LLAMA_PLAN.check(meta_llama(cfg), 8)
    assert str(caught.value).endswith(
        "but it does not divide config.n_heads=4 (heads); config.n_kv_heads=2 (heads). Choose a"
        " tensor_parallel_size that divides them all (1, 2), or change the model."
    )
    LLAMA_PLAN.check(meta_llama(cfg), 2)


def test_hugging_face_head_counts_and_torch_styles_are_checked_too():
    model = nn.Sequential(nn.Linear(9, 9), nn.Linear(9, 9))
    model.config = SimpleNamespace(num_attention_heads=6, num_key_value_heads=3, n_heads=None)  # type: ignore[assignment]
    plan = ParallelPlan(tensor_parallel={"0": ColwiseParallel(), "1": RowwiseParallel()})
    plan.check(model, 3)
    with pytest.raises(ValueError) as caught:
        plan.check(model, 2)
    assert str(caught.value).endswith(
        "does not divide '0' out_features=9 (style ColwiseParallel); '1' in_features=9 (style RowwiseParallel);"
        " config.num_key_value_heads=3 (heads). Choose a tensor_parallel_size that divides them all (1, 3), or change"
        " the model."
    )
    model.config.num_attention_heads = 10
    with pytest.raises(
        ValueError, match=r"Only 1 divides them all: turn tensor parallelism off \(tensor_parallel_size=1\)"
    ):
        plan.check(model, 3)


def test_without_tensor_parallelism_no_size_is_checked():
    LLAMA_PLAN.check(meta_llama(LlamaConfig(vocab_size=7, dim=6, n_heads=3, n_kv_heads=1, ffn_hidden=5)), 1)


# -- activation checkpointing and loss parallelism, in one process ------------------------------------------


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_blocks_give_the_same_gradients_and_keep_their_names(mode):
    torch.manual_seed(0)
    ref = Llama(CFG)
    torch.manual_seed(0)
    model = Llama(CFG)
    keys = list(model.state_dict())
    for block in model.layers:
        checkpoint_module(block, mode)
    assert is_checkpointed(model.layers[0]) == mode and is_checkpointed(model.norm) is None
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_parameters()] == [
        n for n, _ in ref.named_parameters()
    ]
    calls = []
    model.layers[0].feed_forward.w1.register_forward_hook(lambda *_: calls.append(1))
    tokens = torch.randint(0, CFG.vocab_size, (2, 8))
    for m in (model, ref):
        F.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten()).backward()
    assert len(calls) == 2  # forward, then recomputed in backward
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, msg=name)


def test_loss_parallel_is_a_no_op_for_plain_logits():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    with loss_parallel(logits):
        loss = F.cross_entropy(logits.flatten(0, 1), torch.zeros(6, dtype=torch.long))
        loss.backward()
    assert logits.grad is not None


def _tiny_hf_llama(layers: int = 1):
    """(the transformers module, a tiny Llama config, a model from it drawn from seed 0)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return transformers, config, model


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_hugging_face_layers_do_not_write_their_kv_cache_twice(mode):
    """HF decoder layers append to ``past_key_values`` when ``use_cache`` (the default): inside a recomputed region
    that is written twice, and selective checkpointing fails; gradients must equal the unchecked model's."""
    transformers, config, plain = _tiny_hf_llama(layers=2)
    checked = transformers.AutoModelForCausalLM.from_config(config)
    checked.load_state_dict(plain.state_dict())
    for layer in checked.model.layers:
        checkpoint_module(layer, mode)
    tokens = torch.randint(0, 128, (2, 12))
    plain(tokens).logits.sum().backward()
    checked(tokens).logits.sum().backward()
    for (name, p), q in zip(plain.named_parameters(), checked.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")
    with torch.no_grad():  # generation without gradients keeps its cache
        assert checked(tokens, use_cache=True).past_key_values.get_seq_length() == 12


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("passed_as", ["current keyword", "past_key_values keyword", "positional"])
def test_checkpointed_hugging_face_layer_never_writes_a_cache_given_under_any_name(mode, passed_as):
    """transformers 5.24 renamed the layers' ``past_key_values`` to ``cache`` (the old name still accepted): the
    cache is found by its type, whether the layer gets it under the installed release's name, the deprecated one
    or positionally, so this holds on both sides of the rename. Gradients equal the plain layer's without a cache,
    and the cache stays empty."""
    transformers, config, model = _tiny_hf_llama()
    layer = model.model.layers[0]
    plain = copy.deepcopy(layer)
    checkpoint_module(layer, mode)
    params = list(inspect.signature(type(layer).forward).parameters)
    current = "cache" if "cache" in params else "past_key_values"  # 5.24 and later / 5.23 and earlier
    hidden = torch.randn(2, 12, 32)
    position_ids = torch.arange(12).expand(2, -1)
    position_embeddings = model.model.rotary_emb(hidden, position_ids)
    common = {"position_ids": position_ids, "position_embeddings": position_embeddings, "use_cache": True}
    cache = transformers.DynamicCache(config=config)
    if passed_as == "positional":
        assert params.index(current) == 4  # self, hidden_states, attention_mask, position_ids, cache
        call = lambda m, x, c: m(x, None, position_ids, c, True, position_embeddings=position_embeddings)  # noqa: E731
    else:
        keyword = current if passed_as == "current keyword" else "past_key_values"
        call = lambda m, x, c: m(x, **common, **{keyword: c})  # noqa: E731
    x_plain, x_checked = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    out_plain = call(plain, x_plain, None)
    out_checked = call(layer, x_checked, cache)
    torch.testing.assert_close(out_checked, out_plain)
    out_plain.square().sum().backward()
    out_checked.square().sum().backward()
    torch.testing.assert_close(x_checked.grad, x_plain.grad)
    for (name, p), q in zip(plain.named_parameters(), layer.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")
    assert cache.get_seq_length() == 0
    with torch.no_grad():  # without gradients the cache is the caller's to fill
        call(layer, hidden, cache)
    assert cache.get_seq_length() == 12


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_drops_a_hugging_face_cache_under_an_argument_name_of_its_own(mode):
    """A module of the user's that takes a transformers ``Cache`` under a name nobody told us about."""
    transformers, config, _ = _tiny_hf_llama()

    class Appends(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, memo: object = None) -> torch.Tensor:
            k = self.proj(x).view(1, 2, 4, 4)  # (batch, kv heads, seq, head dim)
            if memo is not None:
                k, _ = memo.update(k, k, layer_idx=0)
            return F.softmax(k, dim=-1).sum()

    module = Appends()
    checkpoint_module(module, mode)
    cache = transformers.DynamicCache(config=config)
    module(torch.randn(4, 8), memo=cache).backward()
    assert cache.get_seq_length() == 0 and module.proj.weight.grad is not None


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_keeps_the_cache_of_a_layer_transformers_marks_as_only_reading_it(mode):
    """transformers marks layers that read a cache without writing it ``_can_checkpoint_with_cache``: the
    recomputation reads the same states, so the cache stays (dropping it would change the layer's output)."""
    transformers, config, _ = _tiny_hf_llama()

    class Reads(nn.Module):
        _can_checkpoint_with_cache = True

        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, cache: object = None, use_cache: bool = False) -> torch.Tensor:
            assert not use_cache
            keys = cache.layers[0].keys  # (batch, kv heads, seq, head dim), read only
            return (self.proj(x) @ keys[0, 0].T).sum()

    cache = transformers.DynamicCache(config=config)
    cache.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), layer_idx=0)
    plain, module = Reads(), Reads()
    module.load_state_dict(plain.state_dict())
    checkpoint_module(module, mode)
    x = torch.randn(5, 4)
    plain(x, cache=cache).backward()
    module(x, cache=cache, use_cache=True).backward()
    torch.testing.assert_close(module.proj.weight.grad, plain.proj.weight.grad)
    assert cache.get_seq_length() == 3
