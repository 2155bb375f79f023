"""Which linear layers train in float8, and their conversion with torchao, on the meta device, before TP and FSDP.

:func:`convert` is the first step of a plan that names a recipe (float8 -> TP -> activation checkpointing ->
compile -> FSDP, torchtitan's order): tensor parallelism then shards ``Float8Linear`` layers, and FSDP2 shards
their high-precision weights (all-gathered in float8 under the tensorwise recipe where FSDP2 shards them over
more than one rank). The choice reads only names, types, shapes and the mesh's sizes, so every rank makes the same
one, and refuses the same way, before any collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from modelpar._mesh.submeshes import fsdp_mesh
from modelpar._rank_zero import rank_zero_info
from modelpar.float8._spec import Float8Training
from modelpar.float8._state import keep_state_dicts_plain
from modelpar.float8._torchao import require_torchao
from modelpar.plans._checks import matches, resolve_units
from modelpar.plans._styles import StyleSpec, sharded_dims

__all__ = ["FLOAT8_CAPABILITY", "check_float8_device", "convert", "float8_layers", "lm_heads"]

#: The CUDA compute capability of the first GPUs with float8 matrix multiplies (Ada, Hopper and newer).
FLOAT8_CAPABILITY = (8, 9)
#: The float8 kernels need both sizes of a matrix multiply's operands to be multiples of this.
_MULTIPLE = 16
#: The last name segment of a mixture-of-experts router: its few outputs pick the experts, kept precise.
_ROUTER_NAMES = ("gate", "router")


def check_float8_device(device_type: str, capability: tuple[int, int] | None, *, emulate: bool) -> None:
    """Refuse float8 kernels where there are none: any device but a CUDA GPU of :data:`FLOAT8_CAPABILITY` or newer.

    ``capability`` is the GPU's ``torch.cuda.get_device_capability()`` (``None`` off CUDA). Emulation runs anywhere.
    """
    if emulate or (device_type == "cuda" and capability is not None and capability >= FLOAT8_CAPABILITY):
        return
    where = (
        f"a CUDA GPU of compute capability {capability[0]}.{capability[1]}"
        if device_type == "cuda" and capability is not None
        else f"the {device_type!r} device"
    )
    raise RuntimeError(
        f"Float8 training needs float8 matrix multiplies, which {where} does not have (they need a CUDA GPU of"
        f" compute capability {FLOAT8_CAPABILITY[0]}.{FLOAT8_CAPABILITY[1]} or newer: L4, L40, H100, H200, B200)."
        " Train in bf16 here (`float8=None`), or pass `Float8Training(recipe, emulate=True)` to run float8's"
        " numerics with high-precision multiplies (for tests; no faster)."
    )


def lm_heads(model: nn.Module, styles: Mapping[str, StyleSpec]) -> set[str]:
    """The LM head's name: the plan's ``"output"`` layer, a Hugging Face model's output embeddings, or a last
    ``nn.Linear`` whose outputs are an embedding's vocabulary."""
    heads = {name for name, style in styles.items() if style == "output"}
    names = {module: name for name, module in model.named_modules()}
    get_output = getattr(model, "get_output_embeddings", None)
    if callable(get_output):
        head = get_output()
        if head in names:
            heads.add(names[head])
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    vocabularies = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    if linears and linears[-1][1].out_features in vocabularies:
        heads.add(linears[-1][0])
    return heads


def float8_layers(
    model: nn.Module,
    spec: Float8Training,
    *,
    styles: Mapping[str, StyleSpec] | None = None,
    tensor_parallel_size: int = 1,
    experts: tuple[str, ...] = (),
) -> tuple[list[str], dict[str, str]]:
    """The ``nn.Linear`` layers to convert, in module order, and those kept in high precision with the reason.

    ``styles`` are the plan's resolved tensor-parallel styles: a layer's sizes count per tensor-parallel rank.
    ``experts`` are the plan's expert modules, whose layers stay in high precision.
    """
    styles = styles or {}
    modules = dict(model.named_modules())
    kept: dict[str, str] = {}
    if spec.modules is None:
        candidates = [name for name, m in modules.items() if name and _plain_linear(m)]
        heads = lm_heads(model, styles)
        in_experts = {n for n in candidates for e in _matching(modules, experts) if n.startswith(e + ".")}
        for name in candidates:
            if name in heads:
                kept[name] = "the LM head"
            elif name in in_experts:
                kept[name] = "in a mixture-of-experts module"
            elif name.rsplit(".", 1)[-1] in _ROUTER_NAMES:
                kept[name] = "a mixture-of-experts router"
            else:
                linear = modules[name]
                assert isinstance(linear, nn.Linear)
                shape = _shape_problem(linear, styles.get(name), tensor_parallel_size)
                if shape:
                    kept[name] = shape
        return [n for n in candidates if n not in kept], kept
    chosen: list[str] = []
    for name in resolve_units(model, spec.modules, "float8.modules"):
        module = modules[name]
        if isinstance(module, nn.Linear):
            chosen.append(name)
            continue
        _refuse_fused(name, module)
        chosen.extend(n for n, m in module.named_modules(prefix=name) if n != name and isinstance(m, nn.Linear))
    chosen = [n for n in modules if n in set(chosen) and _plain_linear(modules[n])]
    linears = {n: m for n, m in modules.items() if isinstance(m, nn.Linear)}
    bad = {n: p for n in chosen if (p := _shape_problem(linears[n], styles.get(n), tensor_parallel_size))}
    if bad:
        shown = "; ".join(f"{n}: {p}" for n, p in list(bad.items())[:4])
        raise ValueError(
            f"Float8Training(modules=...) selects linear layers the float8 kernels cannot take ({shown}"
            f"{f'; and {len(bad) - 4} more' if len(bad) > 4 else ''}): each size must be a multiple of {_MULTIPLE}"
            " per tensor-parallel rank. Leave them out of `modules`, or leave `modules` unset to skip them."
        )
    return chosen, kept


def convert(
    model: nn.Module,
    spec: Float8Training,
    *,
    device_type: str | None = None,
    device_mesh: DeviceMesh | None = None,
    styles: Mapping[str, StyleSpec] | None = None,
    tensor_parallel_size: int = 1,
    experts: tuple[str, ...] = (),
) -> list[str]:
    """Swap the chosen ``nn.Linear`` layers of ``model`` for torchao's ``Float8Linear`` in place; their names.

    ``device_mesh`` (the strategy's, as ``parallelize_fn`` gets it) gives the device and how many ranks FSDP2
    shards each weight over, which decides the tensorwise recipe's float8 all-gather when ``spec.all_gather`` is
    unset (:meth:`Float8Training.gathers_in_float8_over`); ``device_type`` alone leaves that number unknown, and
    the all-gather on. Parameters keep their names and their (meta or real) tensors. Raises, identically on every
    rank, for no torchao, a device without float8 kernels (unless emulating) and layers the kernels cannot take.
    """
    device_type, shard_size = _placement(device_type, device_mesh)
    float8 = require_torchao()
    capability = torch.cuda.get_device_capability() if device_type == "cuda" and torch.cuda.is_available() else None
    check_float8_device(device_type, capability, emulate=spec.emulate)
    chosen, kept = float8_layers(model, spec, styles=styles, tensor_parallel_size=tensor_parallel_size, experts=experts)
    gathers = spec.gathers_in_float8_over(shard_size)
    config = dataclasses.replace(
        float8.Float8LinearConfig.from_recipe_name(spec.recipe),
        emulate=spec.emulate,
        enable_fsdp_float8_all_gather=gathers,
    )
    wanted = set(chosen)
    float8.convert_to_float8_training(model, module_filter_fn=lambda _, fqn: fqn in wanted, config=config)
    keep_state_dicts_plain(model)
    _report(model, spec, chosen, kept, gathers=gathers, shard_size=shard_size)
    return chosen


def _placement(device_type: str | None, device_mesh: DeviceMesh | None) -> tuple[str, int | None]:
    """The device type and FSDP2's shard size (``None``: unknown) from :func:`convert`'s arguments."""
    if device_mesh is None:
        if device_type is None:
            raise TypeError(
                "modelpar.float8.convert() needs `device_mesh` (the strategy's, as `parallelize_fn` gets it) or"
                " `device_type`."
            )
        return device_type, None
    if device_type is not None and device_type != device_mesh.device_type:
        raise ValueError(
            f"modelpar.float8.convert(device_type={device_type!r}) disagrees with its `device_mesh`, whose device"
            f" type is {device_mesh.device_type!r}. Pass `device_mesh` alone."
        )
    return device_mesh.device_type, fsdp_mesh(device_mesh).shape[-1]


def _plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` not converted yet (torchao's ``Float8Linear`` is one too; known by name, so that choosing
    layers needs no torchao)."""
    return isinstance(module, nn.Linear) and type(module).__name__ != "Float8Linear"


def _matching(modules: Mapping[str, nn.Module], patterns: tuple[str, ...]) -> list[str]:
    return [name for name in modules if name and any(matches(p, name) for p in patterns)]


def _shape_problem(module: nn.Linear, style: StyleSpec | None, tensor_parallel_size: int) -> str:
    """Why the float8 kernels cannot take this layer's sizes on one tensor-parallel rank ('' when they can)."""
    sizes = {"in_features": module.in_features, "out_features": module.out_features}
    split = dict(sharded_dims(module, style)) if style is not None and tensor_parallel_size > 1 else {}
    for attribute, size in sizes.items():
        local = size // tensor_parallel_size if attribute in split else size
        if local % _MULTIPLE:
            per_rank = f" ({local} per tensor-parallel rank)" if attribute in split else ""
            return f"{attribute}={size}{per_rank} is not a multiple of {_MULTIPLE}"
    return ""


def _refuse_fused(name: str, module: nn.Module) -> None:
    """A selected module that holds its own 3-D (fused experts) weights: grouped GEMMs, not ``nn.Linear``."""
    fused = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
    if fused:
        raise NotImplementedError(
            f"Float8Training(modules=...) selects {name!r} ({type(module).__name__}), whose experts are fused"
            f" weights ({', '.join(fused)}) multiplied as grouped GEMMs, not `nn.Linear` layers. torchao's float8"
            " grouped GEMMs (`torchao.prototype.moe_training`) are a CUDA-only prototype, not offered here: experts"
            " train in high precision. Leave them out of `modules`."
        )


def _report(
    model: nn.Module,
    spec: Float8Training,
    chosen: list[str],
    kept: dict[str, str],
    *,
    gathers: bool,
    shard_size: int | None,
) -> None:
    if gathers:
        gathered = ", all-gathered in float8 by FSDP2"
    elif spec.gathers_in_float8:  # would gather in float8 over several ranks: the rule's choice here, so said
        gathered = f", all-gathered in high precision: FSDP2 shards over {shard_size} rank, nothing to gather"
    else:
        gathered = ""
    emulated = ", emulated" if spec.emulate else ""
    message = (
        f"float8 ({spec.recipe}{gathered}{emulated}): {len(chosen)} linear layer(s) of {type(model).__name__}"
        " train in float8"
    )
    if kept:
        reasons: dict[str, list[str]] = {}
        for name, reason in kept.items():
            reasons.setdefault(reason, []).append(name)
        shown = "; ".join(
            f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''} ({why})" for why, names in reasons.items()
        )
        message += f"; kept in high precision: {shown}"
    rank_zero_info(message + ".")
