"""Lightning ``FSDPStrategy``'s arguments (FSDP1's) translated into the strategy's FSDP2 options, or refused by name.

Changing the class is the whole migration: ``FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy=...)``
becomes ``ModelParallelStrategy(auto_wrap_policy={Block}, sharding_strategy=...)``. Each argument that has an
FSDP2 meaning becomes that option here (a wrap policy -> the FSDP units, ``SHARD_GRAD_OP`` -> no resharding
after forward, ``HYBRID_SHARD`` -> HSDP, an FSDP1 ``MixedPrecision`` -> a ``MixedPrecisionPolicy`` ...); every
other one is refused with its FSDP2 equivalent, never silently dropped. It runs in the strategy's constructor,
identically on every rank, before any process group exists. ``docs/migrating-from-fsdp1.md`` has the table.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffload, MixedPrecision, MixedPrecisionPolicy, ShardingStrategy
from torch.nn.modules.batchnorm import _BatchNorm

from modelpar._errors import ShardingStrategyError
from modelpar.plans._units import ModuleSelector, SelectedBy, describe_selector, normalize_selector, select

__all__ = ["FSDP1_ARGUMENTS", "translate_fsdp1_arguments", "wrap_policy_selector"]

#: Lightning ``FSDPStrategy``'s own arguments that both strategies accept under the same names (``cpu_offload``
#: and ``mixed_precision`` are the strategy's own options, which also take FSDP1's objects). ``None``: not given.
FSDP1_ARGUMENTS = (
    "auto_wrap_policy",
    "activation_checkpointing_policy",
    "sharding_strategy",
    "state_dict_type",
    "device_mesh",
    "limit_all_gathers",
    "use_orig_params",
)

#: FSDP1 constructor arguments without a one-to-one FSDP2 meaning, each with what to do instead.
_REFUSED = {
    "process_group": "the strategy builds its process groups and mesh itself: give sizes (`data_parallel_size`,"
    " `device_mesh=(replicas, shards)` with `sharding_strategy='HYBRID_SHARD'`)",
    "backward_prefetch": "FSDP2 prefetches the next unit's all-gather in backward by itself; for explicit control call"
    " `FSDPModule.set_modules_to_backward_prefetch` in a `parallelize_fn`",
    "forward_prefetch": "FSDP2 overlaps the next unit's all-gather in forward by itself; for explicit control call"
    " `FSDPModule.set_modules_to_forward_prefetch` in a `parallelize_fn`",
    "ignored_modules": "pass `fully_shard(..., ignored_params=...)` in a `parallelize_fn`",
    "ignored_states": "pass `fully_shard(..., ignored_params=...)` in a `parallelize_fn`",
    "param_init_fn": "build the model on the meta device (`fabric.init_module(empty_init=True)`, or the Trainer's"
    " `configure_model`): the strategy materializes each rank's shards with the modules' `reset_parameters`",
    "device_id": "the strategy places the model on its own device (`fabric.device`)",
    # Lightning Trainer FSDPStrategy's plugins and devices: the Trainer's own arguments
    "checkpoint_io": "the strategy saves and loads checkpoints itself (sharded or full, `state_dict_type`), without"
    " a `CheckpointIO` plugin",
    "precision_plugin": "pass the precision to the Trainer (`Trainer(precision='bf16-mixed')`), or an FSDP2 policy as"
    " `mixed_precision`",
    "accelerator": "pass it to the Trainer (`Trainer(accelerator=...)`)",
    "parallel_devices": "pass the devices to the Trainer (`Trainer(devices=...)`)",
    "cluster_environment": "pass it to the Trainer (`Trainer(plugins=[environment])`)",
}

_SHARDING: dict[str, dict[str, Any]] = {
    "FULL_SHARD": {},
    "SHARD_GRAD_OP": {"reshard_after_forward": False},
    "HYBRID_SHARD": {"data_parallel_replicate_size": "auto"},
    "_HYBRID_SHARD_ZERO2": {"data_parallel_replicate_size": "auto", "reshard_after_forward": False},
}


def translate_fsdp1_arguments(
    options: Mapping[str, Any], fsdp1: Mapping[str, Any], others: Mapping[str, Any]
) -> dict[str, Any]:
    """``options`` (the strategy's own, by name) with ``fsdp1``'s (:data:`FSDP1_ARGUMENTS`) folded into them.

    ``others``: any further keyword arguments, each refused with a ``TypeError`` (an FSDP1 one with its FSDP2
    equivalent). Conflicts between an FSDP1 argument and the strategy's own option for the same thing are a
    ``ValueError`` naming both.
    """
    for name in others:
        if name in _REFUSED:
            raise TypeError(f"`{name}` is an FSDP1 argument with no one-to-one FSDP2 meaning: {_REFUSED[name]}.")
        raise TypeError(
            f"got an unexpected keyword argument {name!r}: it is neither an option of this strategy nor one of"
            f" Lightning `FSDPStrategy`'s ({', '.join(FSDP1_ARGUMENTS)}, `cpu_offload`, `mixed_precision`)."
        )
    out = dict(options)
    out["cpu_offload"] = _cpu_offload(out["cpu_offload"])
    out["mixed_precision"] = _mixed_precision(out["mixed_precision"])
    _bool_only_true(fsdp1["limit_all_gathers"], "limit_all_gathers", _WHY_LIMIT)
    _bool_only_true(fsdp1["use_orig_params"], "use_orig_params", _WHY_ORIG)
    if fsdp1["auto_wrap_policy"] is not None:
        if out["fsdp_units"] is not None:
            raise ValueError(
                "`auto_wrap_policy` and `fsdp_units` both name the FSDP units; pass one of them (`fsdp_units` takes"
                " the same sets of classes)."
            )
        out["fsdp_units"] = wrap_policy_selector(fsdp1["auto_wrap_policy"], "auto_wrap_policy")
    if fsdp1["activation_checkpointing_policy"] is not None:
        if out["activation_checkpointing"] is not None:
            raise ValueError(
                "`activation_checkpointing_policy` and `activation_checkpointing` both choose what to checkpoint;"
                " pass one of them."
            )
        out["activation_checkpointing"] = wrap_policy_selector(
            fsdp1["activation_checkpointing_policy"], "activation_checkpointing_policy"
        )
    out.update(_sharding(fsdp1["sharding_strategy"], fsdp1["device_mesh"], out))
    if fsdp1["state_dict_type"] is not None:
        if fsdp1["state_dict_type"] not in ("full", "sharded"):
            raise ValueError(
                f"`state_dict_type={fsdp1['state_dict_type']!r}` is not a checkpoint format. Use 'sharded' (a folder"
                " of shards, reshardable) or 'full' (one file)."
            )
        sharded = fsdp1["state_dict_type"] == "sharded"
        if out["save_distributed_checkpoint"] is False and sharded:
            raise ValueError(
                "`state_dict_type='sharded'` and `save_distributed_checkpoint=False` disagree; pass one of them."
            )
        out["save_distributed_checkpoint"] = sharded
    return out


def wrap_policy_selector(policy: Any, name: str) -> ModuleSelector:
    """The modules an FSDP1 wrap policy selects, as the plan's unit selector.

    A set (or list) of classes, as Lightning accepts them; a ``ModuleWrapPolicy`` or any callable in FSDP1's
    policy signature ``(module, recurse, nonwrapped_numel) -> bool`` (``transformer_auto_wrap_policy``,
    ``size_based_auto_wrap_policy`` through ``functools.partial``, your own), run over the model exactly as FSDP1
    runs it (children first, each told the parameters its wrapped children have not taken); or a
    ``CustomPolicy``, whose per-module argument overrides have no FSDP2 counterpart here and are refused. The
    selector pickles whenever the policy does (no closures), as strategies are sometimes copied between processes.
    """
    if isinstance(policy, (set, frozenset, list, tuple, type)):
        classes = normalize_selector(policy, "ModelParallelStrategy", name)
        if not isinstance(classes, frozenset):
            raise TypeError(f"`{name}` takes module classes, such as {{TransformerBlock}}, but got {policy!r}.")
        return SelectedBy(functools.partial(select, selector=classes), f"{name}={describe_selector(classes)}")
    description = getattr(policy, "__name__", None) or getattr(getattr(policy, "func", None), "__name__", None)
    description = description or type(policy).__name__
    if callable(policy):
        return SelectedBy(functools.partial(_fsdp1_wrapped, policy=policy), f"{name}={description}")
    run = getattr(policy, "_run_policy", None)  # CustomPolicy: FSDP1 reads it only through this method
    if callable(run):
        return SelectedBy(functools.partial(_custom_policy_modules, run=run, name=name), f"{name}={description}")
    raise TypeError(
        f"`{name}` must be a set of module classes (such as {{TransformerBlock}}), a `ModuleWrapPolicy`, a"
        f" `CustomPolicy` or a callable `(module, recurse, nonwrapped_numel) -> bool`, but got {type(policy).__name__}."
    )


def _fsdp1_wrapped(model: nn.Module, policy: Callable[..., bool]) -> list[str]:
    """The names FSDP1's recursive wrapping would wrap with ``policy`` (the root aside: it is always a unit)."""
    names = {id(m): n for n, m in model.named_modules()}
    wrapped: list[str] = []

    def visit(module: nn.Module, root: bool) -> int:
        numel = sum(p.numel() for p in module.parameters())
        if not policy(module=module, recurse=True, nonwrapped_numel=numel):
            return 0
        taken = sum(visit(child, False) for child in module.children())
        if not root and policy(module=module, recurse=False, nonwrapped_numel=numel - taken):
            wrapped.append(names[id(module)])
            return numel
        return taken

    visit(model, True)
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(wrapped, key=order.__getitem__)


def _custom_policy_modules(model: nn.Module, run: Callable[..., Any], name: str) -> list[str]:
    chosen = run(model, set(), {})
    overrides = {m: kwargs for m, kwargs in chosen.items() if kwargs}
    names = {id(m): n for n, m in model.named_modules()}
    if overrides:
        shown = ", ".join(f"{names[id(m)] or '<root>'}: {kwargs}" for m, kwargs in list(overrides.items())[:3])
        raise ValueError(
            f"`{name}` is a `CustomPolicy` that gives some modules their own FSDP1 arguments ({shown}); FSDP2 units"
            " here all take the strategy's options. Return True instead of a dict, or shard those modules with"
            " their own `fully_shard` arguments in a `parallelize_fn`."
        )
    return [names[id(m)] for m in chosen if names[id(m)]]


def _sharding(strategy: Any, device_mesh: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(strategy, ShardingStrategy):
        strategy = strategy.name
    if strategy is not None and not isinstance(strategy, str):
        raise TypeError(
            f"`sharding_strategy` must be a name such as 'FULL_SHARD' or a `ShardingStrategy`, but got {strategy!r}."
        )
    key = strategy.upper() if strategy is not None else None
    if key == "NO_SHARD":
        raise ValueError(
            "`sharding_strategy='NO_SHARD'` (every rank a whole replica, gradients all-reduced) is DDP, which FSDP2"
            " does not call sharding. Keep a replica per rank with `data_parallel_replicate_size=<world size>`"
            " (HSDP with shards of one rank: DDP's all-reduce through FSDP2), or use Lightning's `strategy='ddp'`."
        )
    if key is not None and key not in _SHARDING:
        raise ShardingStrategyError(
            f"`sharding_strategy={strategy!r}` is not a sharding strategy. Use 'FULL_SHARD', 'SHARD_GRAD_OP',"
            " 'HYBRID_SHARD' or '_HYBRID_SHARD_ZERO2' (or a `torch.distributed.fsdp.ShardingStrategy`)."
        )
    changes: dict[str, Any] = dict(_SHARDING[key]) if key is not None else {}
    if options["reshard_after_forward"] is not None and "reshard_after_forward" in changes:
        raise ValueError(
            f"`sharding_strategy={strategy!r}` and `reshard_after_forward={options['reshard_after_forward']!r}` both"
            " say when to reshard; pass one of them."
        )
    replicate = options["data_parallel_replicate_size"]
    if device_mesh is None:
        if replicate != 1:  # an explicit replica count beside HYBRID_SHARD: that count, not one per node
            changes.pop("data_parallel_replicate_size", None)
        return changes
    if key not in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        raise ValueError(
            f"`device_mesh={device_mesh!r}` gives (replicas, shards) for hybrid sharding, but `sharding_strategy` is"
            f" {strategy!r}. Pass `sharding_strategy='HYBRID_SHARD'` with it, or leave `device_mesh` out."
        )
    if not (
        isinstance(device_mesh, tuple)
        and len(device_mesh) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in device_mesh)
    ):
        raise TypeError(
            f"`device_mesh` must be a tuple `(replicas, shards)` of positive ints, but got {device_mesh!r}; the"
            " strategy builds the `DeviceMesh` itself, so a `DeviceMesh` object cannot be taken over."
        )
    replicas, shards = device_mesh
    for given, wanted, option in (
        (replicate, replicas, "data_parallel_replicate_size"),
        (options["data_parallel_size"], replicas * shards, "data_parallel_size"),
    ):
        if given not in (1 if option == "data_parallel_replicate_size" else "auto", wanted):
            raise ValueError(
                f"`device_mesh={device_mesh!r}` makes `{option}={wanted}`, but `{option}={given!r}` was given too;"
                " pass one of them."
            )
        changes[option] = wanted
    return changes


def _cpu_offload(value: Any) -> Any:
    """FSDP1's ``CPUOffload`` and Lightning's ``None`` as FSDP2's: offloading parameters offloads their gradients
    and optimizer state too, as in FSDP1."""
    if value is None:
        return False
    if isinstance(value, CPUOffload):
        return bool(value.offload_params)
    return value


def _mixed_precision(value: Any) -> Any:
    """An FSDP1 ``MixedPrecision`` as the FSDP2 policy it amounts to, or refused where it has no FSDP2 meaning."""
    if not isinstance(value, MixedPrecision):
        return value
    if value.buffer_dtype is not None and value.buffer_dtype != torch.float32:
        raise ValueError(
            f"`MixedPrecision(buffer_dtype={value.buffer_dtype})` has no FSDP2 meaning: FSDP2 leaves buffers in the"
            " dtype they were created in. Drop `buffer_dtype` (buffers then stay fp32, which rotary frequencies and"
            " norms' running statistics want), or create the buffers in that dtype in your model."
        )
    if value.keep_low_precision_grads:
        raise ValueError(
            "`MixedPrecision(keep_low_precision_grads=True)` has no FSDP2 meaning: FSDP2 gives the optimizer gradients"
            " in the sharded parameters' dtype. Drop it; `reduce_dtype` still sets the dtype of the reduction."
        )
    ignored = tuple(getattr(value, "_module_classes_to_ignore", (_BatchNorm,)))
    if ignored not in ((_BatchNorm,), ()):
        raise ValueError(
            f"`MixedPrecision(_module_classes_to_ignore={ignored})` has no FSDP2 meaning here: every unit takes the"
            " strategy's policy. Shard those modules with their own `mp_policy` in a `parallelize_fn`."
        )
    return MixedPrecisionPolicy(
        param_dtype=value.param_dtype,
        reduce_dtype=value.reduce_dtype,
        cast_forward_inputs=value.cast_forward_inputs or value.cast_root_forward_inputs,
    )


_WHY_LIMIT = (
    "FSDP2 always limits the all-gathers in flight (at most the current and the next unit's), so there is no"
    " rate limiter to turn off"
)
_WHY_ORIG = (
    "FSDP2 always keeps the original parameters (each a DTensor with its own name); it has no flat parameters to"
    " hand the optimizer instead"
)


def _bool_only_true(value: Any, name: str, why: str) -> None:
    """An FSDP1 switch whose ``True`` is what FSDP2 always does (accepted) and whose ``False`` it cannot do."""
    if value is None or value is True:
        return
    if value is False:
        raise ValueError(f"`{name}=False` cannot be honoured: {why}. Leave `{name}` out.")
    raise TypeError(f"`{name}` must be True, False or None, but got {value!r}.")
