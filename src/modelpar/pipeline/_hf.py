"""A Hugging Face causal LM as pipeline stages: the family's own forward, fed hidden states between stages.

transformers declares for each decoder family how its base model passes data along (``config.base_model_pp_plan``:
``embed_tokens`` -> ``layers`` -> ``norm``). A stage's view keeps the base model's forward, which already takes
``inputs_embeds`` in place of token ids, and builds the causal mask, positions and rotary tables for any stage. So
a stage runs: token ids (first stage) or the previous stage's hidden states (the others) through the base model,
whose final norm is an identity on every stage but the last, then the LM head on the last stage only.

Refused, by name (:class:`~modelpar.PipelineSplitError`): a family without ``base_model_pp_plan``, or whose plan
passes more than the hidden states, or whose base forward scales the embeddings (Gemma's ``normalizer``): fed
hidden states it would scale them again on every stage.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
from torch import nn

from modelpar._errors import PipelineSplitError

__all__ = ["check_hugging_face_pipeline", "hugging_face_stage"]

_STANDARD_PLAN = {"embed_tokens", "layers", "norm"}
_SCALES_EMBEDDINGS = ("normalizer", "embed_scale")


def _base(model: nn.Module) -> Any:
    prefix = getattr(model, "base_model_prefix", "") or ""
    return getattr(model, prefix, None) if prefix and hasattr(model, prefix) else model


def check_hugging_face_pipeline(model: nn.Module) -> None:
    """Raise unless ``model``'s family can run as pipeline stages (see the module docstring)."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None)
    if not plan:
        raise PipelineSplitError(
            f"{name} declares no pipeline plan (`config.base_model_pp_plan` is empty), so how its base model passes"
            " data between layers is unknown. Use a family that declares one (Llama, Qwen2, Qwen3, Mistral ...),"
            " or `pipeline_parallel_size=1`."
        )
    if set(plan) != _STANDARD_PLAN:
        raise PipelineSplitError(
            f"{name}'s pipeline plan passes {sorted(plan)} between stages, not the embedding -> layers -> norm of a"
            " plain decoder; that is not supported yet. Use `pipeline_parallel_size=1` for it."
        )
    base = _base(model)
    source = inspect.getsource(type(base).forward)
    scales = [token for token in _SCALES_EMBEDDINGS if token in source]
    if scales:
        raise PipelineSplitError(
            f"{type(base).__name__}.forward scales the embeddings ({scales[0]}), and a later stage, fed the hidden"
            " states in their place, would scale them again. This family is not supported with pipeline"
            " parallelism yet; use `pipeline_parallel_size=1`."
        )
    if not isinstance(getattr(model, "lm_head", None), nn.Module) and base is not model:
        raise PipelineSplitError(f"{name} has no `lm_head`: only causal language models are cut into stages.")


def hugging_face_stage(view: nn.Module, *, first: bool, last: bool) -> None:
    """Make ``view`` (a stage of a Hugging Face causal LM) run as a stage: ids or hidden states in, logits out last."""
    base = _base(view)
    if not last and isinstance(base, nn.Module) and base._modules.get("norm", None) is None:
        base._modules["norm"] = nn.Identity()  # the base forward always calls it

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        stage_base = _base(self)
        fed = {"input_ids": x} if first else {"inputs_embeds": x}
        out = stage_base(**fed, use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        head = getattr(self, "lm_head", None) if stage_base is not self else None
        return head(hidden) if last and head is not None else hidden

    view.forward = types.MethodType(forward, view)
