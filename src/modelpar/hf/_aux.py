"""A Hugging Face MoE model's load-balancing loss over the global batch, as one process computes it.

A Hugging Face MoE ``...ForCausalLM`` called with ``output_router_logits=True`` returns ``aux_loss =
load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)`` and adds
``router_aux_loss_coef * aux_loss`` to ``loss``. That loss is Switch Transformer's ``E x sum_e f_e x P_e``, a
*product* of two means over the tokens, computed over each rank's own tokens: under data (or context)
parallelism neither its value nor its gradient is the one-process loss of the whole batch, and averaging it over
ranks does not make it so. :func:`router_aux_loss` computes the same per-rank sums transformers does (top-k
assignments per expert, router probabilities per expert, token rows; padding weighted out by the attention mask),
adds them up over the token ranks with one differentiable all-reduce of ``2E + 1`` floats, and finishes the
formula, which gives the one-process value; the all-reduce's backward sums the ranks' gradients, which the
data-parallel gradient average divides back out, leaving the one-process gradient (as
``modelpar.models.moe.router_losses`` does for modelpar's own MoE). :func:`with_global_router_loss` swaps the
per-rank term in ``outputs.loss`` for it.

Thirty transformers 5.x families share that ``load_balancing_loss_func`` word for word (Qwen2/3-MoE, Qwen3-Next,
Mixtral, GPT-OSS, OLMoE, Jamba, DBRX, GraniteMoE, MiniMax, Ernie 4.5 MoE, PhiMoE, JetMoE ...; GPT-OSS's
``router_logits`` are the raw logits its top-k-then-softmax routing starts from, and the loss softmaxes all of
them, as here). Three compute another loss and are refused with ``NotImplementedError``: Doge (product-key
routing), NLLB-MoE and Switch Transformers (encoder-decoder, per-group means, Switch's router z-loss).
DeepSeek-V3 and GLM-4-MoE return router logits but no auxiliary loss in transformers (bias-based balancing): there
is no per-rank loss to fix (their own sequence-wise loss, sigmoid-based, is not this formula).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from modelpar._mesh.layout import CONTEXT_PARALLEL_AXIS, MESH_AXES
from modelpar._mesh.submeshes import token_mesh
from modelpar.moe import sum_over_group

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["router_aux_loss", "with_global_router_loss"]

#: Config attributes naming the routed experts and the experts per token, in the order they are looked up.
EXPERT_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_ATTRS = ("num_experts_per_tok", "moe_top_k")
COEF_ATTRS = ("router_aux_loss_coef", "aux_loss_coef", "moe_loss_weight")
#: Sub-configs that hold the MoE settings: vision-language models' ``text_config``, DBRX's ``ffn_config``.
SUB_CONFIGS = ("text_config", "ffn_config")
#: Families whose transformers aux loss is not the shared ``load_balancing_loss_func``.
OTHER_LOSSES = {
    "doge": "product-key routing (two top-k over `num_keys`)",
    "nllb-moe": "an encoder and a decoder loss with their own masks",
    "switch_transformers": "per-group means, top-1, plus the router z-loss",
}


def _config_of(model_or_config: Any) -> Any:
    config = model_or_config.config if isinstance(model_or_config, nn.Module) else model_or_config
    if not hasattr(config, "to_dict"):
        raise TypeError(
            f"router_aux_loss takes a Hugging Face model or its config, got {type(model_or_config).__name__}."
            " Pass the model (or `model.config`)."
        )
    model_type = getattr(config, "model_type", "")
    if model_type in OTHER_LOSSES:
        raise NotImplementedError(
            f"`{model_type}` models compute another auxiliary loss in transformers ({OTHER_LOSSES[model_type]}),"
            " not the shared `load_balancing_loss_func` router_aux_loss reproduces."
        )
    return config


def _lookup(config: Any, names: tuple[str, ...]) -> tuple[str, Any] | None:
    for holder in (config, *(getattr(config, sub, None) for sub in SUB_CONFIGS)):
        for name in names:
            value = getattr(holder, name, None) if holder is not None else None
            if value is not None:
                return name, value
    return None


def _int_setting(config: Any, names: tuple[str, ...], what: str) -> int:
    found = _lookup(config, names)
    if found is None:
        raise ValueError(
            f"The {type(config).__name__} has no {what}: none of the config attributes"
            f" {', '.join(f'`{n}`' for n in names)} is set (nor in {' / '.join(SUB_CONFIGS)})."
            " Pass the config of a mixture-of-experts model."
        )
    name, value = found
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"The config's `{name}` is {value!r}; it must be a positive int.")
    return value


def moe_sizes(model_or_config: Any) -> tuple[int, int]:
    """``(num_experts, top_k)`` of a Hugging Face MoE model or config, read as each family names them."""
    config = _config_of(model_or_config)
    n_experts = _int_setting(config, EXPERT_ATTRS, "number of experts")
    top_k = _int_setting(config, TOP_K_ATTRS, "number of experts per token")
    if top_k > n_experts:
        raise ValueError(f"The config routes each token to {top_k} of {n_experts} experts; top_k must be <= that.")
    return n_experts, top_k


def _token_group(device_mesh: DeviceMesh | None) -> Any:
    """The process group of the ranks holding distinct tokens, or ``None`` when this process holds them all."""
    if device_mesh is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                f"router_aux_loss(device_mesh=None) with {dist.get_world_size()} processes would give each rank"
                " the loss of its own tokens. Pass the strategy's `device_mesh` (`self.device_mesh` in"
                " `configure_model`, or the one `parallelize_fn` receives)."
            )
        return None
    try:  # the strategy's meshes reach "data_parallel" also when it is a flattened axis (HSDP, expert parallelism)
        tokens = token_mesh(device_mesh)
    except (KeyError, RuntimeError, ValueError) as err:
        names = list(device_mesh.mesh_dim_names or ())
        raise ValueError(
            f"The mesh has axes {names}, but router_aux_loss sums over its `{MESH_AXES[0]}` axis (and"
            f" `{CONTEXT_PARALLEL_AXIS}`). Pass the strategy's `device_mesh` (or name your data-parallel axis"
            f" `{MESH_AXES[0]}`)."
        ) from err
    return tokens.get_group() if tokens.size() > 1 else None


def router_aux_loss(
    router_logits: Sequence[torch.Tensor] | None,
    model_or_config: Any,
    *,
    device_mesh: DeviceMesh | None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The load-balancing loss of the global batch, exactly as transformers computes it on one process.

    ``router_logits``: ``outputs.router_logits`` of a model called with ``output_router_logits=True`` (one
    ``[tokens, num_experts]`` tensor per MoE layer, this rank's tokens). ``model_or_config``: the model or its config
    (``num_experts`` / ``num_local_experts`` / ``n_routed_experts`` and ``num_experts_per_tok``).
    ``device_mesh``: the strategy's mesh; the sums go over its token ranks (data-parallel, and context-parallel when
    there is that axis; tensor-parallel peers hold the same tokens and are left out). ``None`` only on one process.
    ``attention_mask``: the mask given to the model (``[batch, seq]`` of this rank's rows), so padding counts for
    nothing, as in transformers. Every token rank must call this in the same forward (it all-reduces once).
    """
    n_experts, top_k = moe_sizes(model_or_config)
    if router_logits is None or isinstance(router_logits, torch.Tensor) or len(router_logits) == 0:
        raise ValueError(
            f"router_aux_loss needs the per-layer router logits, got {type(router_logits).__name__}. Call the model"
            " with `output_router_logits=True` (or set it in the config) and pass `outputs.router_logits`."
        )
    group = _token_group(device_mesh)
    device = router_logits[0].device
    rows = router_logits[0].shape[0]
    flat_mask: torch.Tensor | None = None
    if attention_mask is not None:
        flat_mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    counts = torch.zeros(n_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(n_experts, dtype=torch.float32, device=device)
    total_rows = torch.zeros((), dtype=torch.float32, device=device)
    for i, layer in enumerate(router_logits):
        if layer.dim() != 2 or layer.shape[-1] != n_experts or layer.shape[0] != rows:
            raise ValueError(
                f"router_logits[{i}] has shape {tuple(layer.shape)}, but the config has {n_experts} experts and"
                f" router_logits[0] {rows} rows: each layer's logits must be [tokens, {n_experts}]."
            )
        if flat_mask is not None and flat_mask.numel() != rows:
            raise ValueError(
                f"attention_mask has {flat_mask.numel()} entries for {rows} rows of router logits. Pass the"
                " [batch, seq] mask given to the model, of this rank's tokens."
            )
        # The same operations, in the same order, as transformers' load_balancing_loss_func (one process: bitwise).
        weights = torch.nn.functional.softmax(layer.to(device), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        if flat_mask is None:
            ones = torch.ones(chosen.numel(), dtype=torch.float32, device=device)
            counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen.reshape(-1), ones)
            prob_sum = prob_sum + weights.float().sum(dim=0)
            total_rows = total_rows + weights.shape[0]
        else:
            counts = counts + torch.zeros_like(counts).scatter_add_(
                0, chosen.reshape(-1), flat_mask.repeat_interleave(top_k)
            )
            prob_sum = prob_sum + (weights.float() * flat_mask.unsqueeze(-1)).sum(dim=0)
            total_rows = total_rows + flat_mask.sum()
    stats = torch.cat([counts, prob_sum, total_rows[None]])
    if group is not None:
        stats = sum_over_group(stats, group)
    counts, prob_sum, total_rows = stats[:n_experts], stats[n_experts:-1], stats[-1]
    tokens_per_expert = counts / total_rows
    router_prob_per_expert = prob_sum / total_rows
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * n_experts


def aux_loss_coef(model: Any) -> float:
    """The coefficient a Hugging Face MoE model puts on its aux loss (``router_aux_loss_coef`` and the like)."""
    for name in ("router_aux_loss_coef", "aux_loss_coef"):
        value = getattr(model, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    found = _lookup(_config_of(model), COEF_ATTRS)
    if found is None:
        raise ValueError(
            f"{type(model).__name__} has no aux-loss coefficient: none of {', '.join(f'`{n}`' for n in COEF_ATTRS)}"
            " is set on the model or its config."
        )
    return float(found[1])


def with_global_router_loss(
    outputs: Any, model: nn.Module, *, device_mesh: DeviceMesh | None, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``outputs.loss`` with its per-rank ``coef x aux_loss`` replaced by ``coef x`` :func:`router_aux_loss`.

    ``outputs``: what ``model(input_ids, labels=..., attention_mask=..., output_router_logits=True)`` returned on
    this rank; pass the same ``attention_mask``. The result is ``outputs.loss - coef x outputs.aux_loss + coef x
    global_aux``: the two per-rank terms cancel in value and exactly in gradient (autograd adds ``coef`` and
    ``-coef``), so backward gives, after the data-parallel average, the one-process gradient of
    ``cross_entropy + coef x aux_loss`` over the whole batch (with equal token counts per rank, as the
    cross-entropy mean needs anyway).
    """
    loss, local_aux = getattr(outputs, "loss", None), getattr(outputs, "aux_loss", None)
    if loss is None or local_aux is None:
        missing = (
            "`labels`"
            if loss is None
            else "`output_router_logits=True` (a family with no aux loss in transformers, such as DeepSeek-V3 or"
            " GLM-4-MoE, has none to replace)"
        )
        absent = "loss" if loss is None else "aux_loss"
        raise ValueError(
            f"with_global_router_loss needs `outputs.loss` and `outputs.aux_loss`, but `outputs.{absent}` is None."
            f" Call the model with {missing}."
        )
    coef = aux_loss_coef(model)
    global_aux = router_aux_loss(outputs.router_logits, model, device_mesh=device_mesh, attention_mask=attention_mask)
    result: torch.Tensor = loss - coef * local_aux.to(loss.device) + coef * global_aux.to(loss.device)
    return result
