"""Models on the meta device from a config alone, with their plans: what ``modelpar estimate`` reads."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import torch
from torch import nn

from modelpar.plans._plan import ParallelPlan

__all__ = ["hf_on_meta", "llama_on_meta"]


def llama_on_meta(config_json: str) -> tuple[nn.Module, ParallelPlan]:
    """``modelpar.models.Llama`` on the meta device from ``LlamaConfig`` fields as JSON, with ``LLAMA_PLAN``.

    With ``n_experts`` (the MoE variant) the plan is ``LLAMA_MOE_PLAN``, which can split the experts.
    """
    from modelpar.models import Llama, LlamaConfig
    from modelpar.plans import LLAMA_MOE_PLAN, LLAMA_PLAN

    values = json.loads(config_json)
    known = [f.name for f in fields(LlamaConfig)]
    if not isinstance(values, dict) or set(values) - set(known):
        unknown = sorted(set(values) - set(known)) if isinstance(values, dict) else values
        raise ValueError(
            f"--llama: {unknown!r} are not LlamaConfig fields. Pass a JSON object with some of {known}, e.g."
            ' \'{"dim": 4096, "n_layers": 32}\'.'
        )
    config = LlamaConfig(**values)
    with torch.device("meta"):
        return Llama(config), LLAMA_MOE_PLAN if config.n_experts else LLAMA_PLAN


def hf_on_meta(path: Path) -> tuple[nn.Module, ParallelPlan]:
    """A Hugging Face causal LM from its ``config.json`` (or the folder holding it) on the meta device, and its plan."""
    if not path.exists():
        raise FileNotFoundError(f"--hf-config: {str(path)!r} does not exist. Pass a model folder or its config.json.")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as err:
        raise ImportError("--hf-config needs transformers. Install the extra: pip install 'modelpar[hf]'") from err
    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    from modelpar.hf._plan import plan_for  # needs no transformers itself; the model above did

    return model, plan_for(model)
