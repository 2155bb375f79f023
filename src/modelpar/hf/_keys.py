"""How a model's tensors meet the names in a Hugging Face weight folder: stable names, tied weights, prefixes.

A model's state dict is read with ``keep_vars=True``, so tensors shared by several names (tied embeddings:
``lm_head.weight`` is ``model.embed_tokens.weight``) are recognised by identity, also after FSDP2 and our
materialization, which keep such tensors shared. Hugging Face writes a tied tensor once, under its first
name, and loads it into all of them; so do we. Names lose wrapper segments (``_checkpoint_wrapped_module``,
``_orig_mod`` ...), as in every modelpar checkpoint.

A checkpoint of a model with a head loads into its base model and back, as ``from_pretrained`` allows: when
only one side's names start with the model's ``base_model_prefix`` (``"model"`` for Llama), the prefix is
added to or removed from the file's names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from lightning_fabric.wrappers import is_wrapped
from torch import nn

from modelpar.checkpoint._names import clean_name

__all__ = ["ModelTensors", "ignored_unexpected", "map_file_keys", "model_tensors", "unwrap"]


def unwrap(model: Any) -> nn.Module:
    """The module itself: Fabric's wrapper (``fabric.setup_module``'s result) is taken off."""
    if is_wrapped(model):
        model = model.module
    if not isinstance(model, nn.Module):
        raise TypeError(f"Expected a torch `nn.Module` (a Hugging Face `PreTrainedModel`), got {type(model).__name__}.")
    return model


@dataclass(frozen=True)
class ModelTensors:
    """The state dict by stable name, which names to fill (each tensor once), and the ties between them."""

    tensors: dict[str, torch.Tensor]  # every name, tied ones included
    aliases: dict[str, list[str]]  # first name of each tensor -> all of its names (itself first)

    @property
    def unique(self) -> list[str]:
        """One name per tensor, in state-dict order (what Hugging Face writes)."""
        return list(self.aliases)


def model_tensors(model: nn.Module) -> ModelTensors:
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, list[str]] = {}
    first_by_id: dict[int, str] = {}
    for raw_name, tensor in model.state_dict(keep_vars=True).items():
        name = clean_name(raw_name)
        tensors[name] = tensor
        first = first_by_id.setdefault(id(tensor), name)
        aliases.setdefault(first, []).append(name)
    return ModelTensors(tensors, aliases)


def map_file_keys(file_keys: Iterable[str], model_names: Iterable[str], prefix: str) -> dict[str, str]:
    """File name -> model name, adding or removing ``prefix.`` where only one side uses it."""
    keys, names = list(file_keys), set(model_names)
    if not prefix:
        return {k: k for k in keys}
    dotted = prefix + "."
    file_has = any(k.startswith(dotted) for k in keys)
    model_has = any(n.startswith(dotted) for n in names)
    if file_has and not model_has:  # a model with a head's file into its base model
        return {k: k.removeprefix(dotted) for k in keys}
    if model_has and not file_has:  # a base model's file into a model with a head
        return {k: dotted + k for k in keys}
    return {k: k for k in keys}


def ignored_unexpected(model: nn.Module) -> list[re.Pattern[str]]:
    """The patterns of file names the model class declares it ignores (e.g. old ``rotary_emb.inv_freq``)."""
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    return [re.compile(p) for p in patterns if isinstance(p, str)]
