"""Lightning ``FSDPStrategy``'s arguments, taken by both strategies: each one's FSDP2 meaning, or its refusal.

The translation runs in the constructor (one process, no group), so every case here is what every rank does
identically before any collective. The units an FSDP1 wrap policy selects are compared with the modules FSDP1's
own recursive wrapping wraps, on the same model.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, MixedPrecision, MixedPrecisionPolicy, ShardingStrategy
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    _recursive_wrap,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from modelpar import ModelParallelStrategy, ShardingStrategyError
from modelpar.legacy import wrap_policy_selector
from modelpar.models import Llama, LlamaConfig
from modelpar.models.llama import Attention, FeedForward, TransformerBlock
from modelpar.plans._units import select
from modelpar.trainer import ModelParallelStrategy as TrainerStrategy

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16)


def _options(front_end: type = ModelParallelStrategy, **kwargs: object) -> object:
    return front_end(**kwargs)._core.options  # type: ignore[operator]


def _meta_llama() -> Llama:
    with torch.device("meta"):
        return Llama(CFG)


@pytest.mark.parametrize("front_end", [ModelParallelStrategy, TrainerStrategy], ids=["fabric", "trainer"])
@pytest.mark.parametrize(
    ("sharding", "reshard", "replicate"),
    [
        ("FULL_SHARD", None, 1),
        ("SHARD_GRAD_OP", False, 1),
        ("HYBRID_SHARD", None, "auto"),
        ("_HYBRID_SHARD_ZERO2", False, "auto"),
        (ShardingStrategy.SHARD_GRAD_OP, False, 1),
        ("hybrid_shard", None, "auto"),
    ],
)
def test_each_sharding_strategy_becomes_its_fsdp2_options(front_end, sharding, reshard, replicate):
    options = _options(front_end, sharding_strategy=sharding)
    assert (options.reshard_after_forward, options.data_parallel_replicate_size) == (reshard, replicate)
    assert options.fsdp1_arguments == ("sharding_strategy",)


def test_hybrid_shard_with_a_device_mesh_takes_its_shape_and_refuses_disagreeing_sizes():
    options = _options(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 4))
    assert (options.data_parallel_replicate_size, options.data_parallel_size) == (2, 8)
    with pytest.raises(ValueError, match=r"`device_mesh=\(2, 4\)` makes `data_parallel_size=8`, but .*=2` was given"):
        ModelParallelStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 4), data_parallel_size=2)
    with pytest.raises(ValueError, match=r"gives \(replicas, shards\) for hybrid sharding, but .* 'FULL_SHARD'"):
        ModelParallelStrategy(sharding_strategy="FULL_SHARD", device_mesh=(2, 2))
    with pytest.raises(TypeError, match=r"`device_mesh` must be a tuple `\(replicas, shards\)` of positive ints"):
        ModelParallelStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=[2, 2])
    # an explicit replica count beside HYBRID_SHARD is that count, not one per node
    assert _options(sharding_strategy="HYBRID_SHARD", data_parallel_replicate_size=2).data_parallel_replicate_size == 2


def test_sharding_strategies_without_an_fsdp2_meaning_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"'NO_SHARD'.* is DDP.*`data_parallel_replicate_size=<world size>`"):
        ModelParallelStrategy(sharding_strategy="NO_SHARD")
    with pytest.raises(ShardingStrategyError, match=r"^`sharding_strategy='FULL'` is not a sharding strategy\. Use"):
        ModelParallelStrategy(sharding_strategy="FULL")
    with pytest.raises(KeyError):  # what Lightning's FSDPStrategy raises, so old except clauses still catch it
        ModelParallelStrategy(sharding_strategy="FULL")
    with pytest.raises(ValueError, match=r"both say when to reshard; pass one of them"):
        ModelParallelStrategy(sharding_strategy="SHARD_GRAD_OP", reshard_after_forward=True)


def test_state_dict_type_picks_the_checkpoint_format():
    assert _options(state_dict_type="full").save_distributed_checkpoint is False
    assert _options(TrainerStrategy, state_dict_type="sharded").save_distributed_checkpoint is True
    with pytest.raises(ValueError, match=r"`state_dict_type='sharded'` and `save_distributed_checkpoint=False`"):
        ModelParallelStrategy(state_dict_type="sharded", save_distributed_checkpoint=False)
    with pytest.raises(ValueError, match=r"`state_dict_type='dcp'` is not a checkpoint format"):
        ModelParallelStrategy(state_dict_type="dcp")


def test_fsdp1_cpu_offload_and_mixed_precision_become_fsdp2_policies():
    assert _options(cpu_offload=CPUOffload(offload_params=True)).cpu_offload is True
    assert _options(cpu_offload=None).cpu_offload is False
    assert isinstance(_options(cpu_offload=CPUOffloadPolicy()).cpu_offload, CPUOffloadPolicy)
    policy = _options(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    assert policy.mixed_precision == MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True
    )
    assert _options(mixed_precision=MixedPrecision(buffer_dtype=torch.float32)).mixed_precision is not None


@pytest.mark.parametrize(
    ("mixed_precision", "message"),
    [
        (MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16), "buffer_dtype=torch.bfloat16"),
        (MixedPrecision(keep_low_precision_grads=True), "keep_low_precision_grads=True"),
        (MixedPrecision(_module_classes_to_ignore=(nn.LayerNorm,)), "_module_classes_to_ignore"),
    ],
)
def test_mixed_precision_without_an_fsdp2_meaning_is_refused_with_the_reason(mixed_precision, message):
    with pytest.raises(ValueError, match=re.escape(message) + r".*has no FSDP2 meaning"):
        ModelParallelStrategy(mixed_precision=mixed_precision)


def test_switches_fsdp2_always_has_are_accepted_and_their_opposites_refused():
    assert _options(limit_all_gathers=True, use_orig_params=True).fsdp1_arguments == (
        "limit_all_gathers",
        "use_orig_params",
    )
    with pytest.raises(ValueError, match=r"`limit_all_gathers=False` cannot be honoured: FSDP2 always limits"):
        ModelParallelStrategy(limit_all_gathers=False)
    with pytest.raises(ValueError, match=r"`use_orig_params=False` cannot be honoured: .* no flat parameters"):
        ModelParallelStrategy(use_orig_params=False)


@pytest.mark.parametrize("front_end", [ModelParallelStrategy, TrainerStrategy], ids=["fabric", "trainer"])
@pytest.mark.parametrize(
    ("name", "equivalent"),
    [
        ("backward_prefetch", "set_modules_to_backward_prefetch"),
        ("forward_prefetch", "set_modules_to_forward_prefetch"),
        ("ignored_modules", "ignored_params"),
        ("param_init_fn", "empty_init=True"),
        ("process_group", "data_parallel_size"),
        ("device_id", "its own device"),
    ],
)
def test_other_fsdp1_arguments_are_refused_by_name_with_the_fsdp2_equivalent(front_end, name, equivalent):
    with pytest.raises(TypeError, match=rf"^`{name}` is an FSDP1 argument with no one-to-one FSDP2 meaning: .*"):
        front_end(**{name: object()})
    with pytest.raises(TypeError, match=re.escape(equivalent)):
        front_end(**{name: object()})


def test_trainer_fsdp_strategys_plugins_are_refused_with_where_they_go():
    with pytest.raises(TypeError, match=r"`precision_plugin` is an FSDP1 argument .*Trainer\(precision="):
        TrainerStrategy(precision_plugin=None)


def test_unit_options_and_a_parallelize_fn_are_refused_together_by_the_names_given():
    fn = lambda model, mesh: model  # noqa: E731
    with pytest.raises(ValueError, match=r"^`auto_wrap_policy` choose what the strategy shards .* a `parallelize_fn`"):
        ModelParallelStrategy(fn, auto_wrap_policy={TransformerBlock})
    with pytest.raises(ValueError, match=r"^`fsdp_units`, `activation_checkpointing` choose"):
        ModelParallelStrategy(fn, fsdp_units={TransformerBlock}, activation_checkpointing="full")
    with pytest.raises(ValueError, match=r"`auto_wrap_policy` and `fsdp_units` both name the FSDP units"):
        ModelParallelStrategy(auto_wrap_policy={TransformerBlock}, fsdp_units={TransformerBlock})
    with pytest.raises(ValueError, match=r"`activation_checkpointing='some'` is not a mode"):
        ModelParallelStrategy(activation_checkpointing="some")


def _fsdp1_wraps(model: nn.Module, policy: object) -> list[str]:
    """The modules torch's own FSDP1 recursive wrapping wraps with ``policy`` (a recording wrapper, no FSDP)."""
    wrapped: list[nn.Module] = []

    def record(module: nn.Module, **kwargs: object) -> nn.Module:
        wrapped.append(module)
        return module

    _recursive_wrap(model, policy, record, set(), set(), only_wrap_children=True)  # type: ignore[arg-type]
    names = {id(m): n for n, m in model.named_modules()}
    order = [n for n, _ in model.named_modules()]
    return sorted((names[id(m)] for m in wrapped), key=order.index)


@pytest.mark.parametrize(
    "policy",
    [
        ModuleWrapPolicy({TransformerBlock}),
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Attention, FeedForward}),
        functools.partial(size_based_auto_wrap_policy, min_num_params=5_000),
        functools.partial(size_based_auto_wrap_policy, min_num_params=1_000),
    ],
    ids=["module-wrap", "transformer", "size-5k", "size-1k"],
)
def test_a_wrap_policy_selects_the_modules_fsdp1_wraps(policy):
    model = _meta_llama()
    chosen = select(model, wrap_policy_selector(policy, "auto_wrap_policy"))
    assert chosen == _fsdp1_wraps(model, policy) and chosen


def test_sets_and_custom_policies_select_by_class_and_per_module_overrides_are_refused():
    model = _meta_llama()
    by_set = wrap_policy_selector({TransformerBlock}, "auto_wrap_policy")
    assert select(model, by_set) == ["layers.0", "layers.1", "layers.2"]
    assert by_set.description == "auto_wrap_policy={TransformerBlock}"  # what rank 0's units line says
    custom = wrap_policy_selector(CustomPolicy(lambda m: isinstance(m, TransformerBlock)), "auto_wrap_policy")
    assert select(model, custom) == ["layers.0", "layers.1", "layers.2"]
    overriding = CustomPolicy(lambda m: {"sharding_strategy": "SHARD_GRAD_OP"} if isinstance(m, Attention) else False)
    with pytest.raises(ValueError, match=r"gives some modules their own FSDP1 arguments \(layers\.0\.attention: "):
        select(model, wrap_policy_selector(overriding, "auto_wrap_policy"))
    with pytest.raises(TypeError, match=r"`auto_wrap_policy` must be a set of module classes .* but got int"):
        wrap_policy_selector(3, "auto_wrap_policy")


def test_selectors_from_policies_pickle_so_a_strategy_can_be_copied():
    import pickle

    model = _meta_llama()
    for policy in ({TransformerBlock}, ModuleWrapPolicy({TransformerBlock})):
        selector = pickle.loads(pickle.dumps(wrap_policy_selector(policy, "auto_wrap_policy")))
        assert select(model, selector) == ["layers.0", "layers.1", "layers.2"]
