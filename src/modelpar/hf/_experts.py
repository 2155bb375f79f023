"""Mixture-of-experts tensors: fused in the model, per expert in many Hugging Face folders.

transformers 5 models hold each MoE layer's experts fused: ``...mlp.experts.gate_up_proj`` ``[E, 2*I, H]``
(each expert's gate rows, then its up rows) and ``...mlp.experts.down_proj`` ``[E, H, I]``. Their folders
hold the experts one tensor each, as transformers 4 wrote them and transformers 5 still writes them
(``save_pretrained`` reverses the conversion it applies at load time); newer folders may hold the fused
tensors as the model does. Two per-expert layouts exist, named after transformers' conversion patterns:

- ``qwen2_moe`` (Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3 ...):
  ``...mlp.experts.{e}.gate_proj.weight``, ``.up_proj.weight`` ``[I, H]``, ``.down_proj.weight`` ``[H, I]``;
- ``mixtral`` (Mixtral, MiniMax): ``...block_sparse_moe.experts.{e}.w1.weight`` (gate), ``.w3.weight`` (up),
  ``.w2.weight`` (down), and the router as ``...block_sparse_moe.gate.weight``.

transformers keeps these rules in ``conversion_mapping.py`` as objects of its own loading machinery (no
documented reading API, reshaped between 5.x releases), so they are restated here as data, and a unit test
pins this table to transformers' own. Loading recognises either layout from the files' names (and the fused
one, by name as any tensor); saving writes what transformers' ``save_pretrained`` writes for the family
(:data:`SAVE_LAYOUTS` by ``config.model_type``; a family not listed is written fused, as its model holds it).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import torch

from modelpar._errors import CheckpointKeyError, CheckpointShapeError

__all__ = [
    "LAYOUTS",
    "SAVE_LAYOUTS",
    "ExpertLayout",
    "Stacked",
    "group_experts",
    "save_layout",
    "split_for_save",
    "stacked_shape",
]


@dataclass(frozen=True)
class ExpertLayout:
    """How a family's folders name one expert's tensors (``block``: the MoE module's name in the files)."""

    name: str
    block: str
    gate: str
    up: str
    down: str


QWEN2_MOE = ExpertLayout("qwen2_moe", "mlp", "gate_proj", "up_proj", "down_proj")
MIXTRAL = ExpertLayout("mixtral", "block_sparse_moe", "w1", "w3", "w2")
LAYOUTS = (QWEN2_MOE, MIXTRAL)

# config.model_type -> the per-expert layout transformers 5.23's save_pretrained writes (pinned by a unit test).
SAVE_LAYOUTS: dict[str, ExpertLayout] = {
    **dict.fromkeys(
        (
            "qwen2_moe",
            "qwen3_moe",
            "olmoe",
            "flex_olmo",
            "deepseek_v2",
            "deepseek_v3",
            "glm4_moe",
            "dots1",
            "hunyuan_v1_moe",
        ),
        QWEN2_MOE,
    ),
    **dict.fromkeys(("mixtral", "minimax"), MIXTRAL),
}

_FUSED = re.compile(r"(?P<prefix>(?:.*\.)?)mlp\.experts\.(?P<which>gate_up_proj|down_proj)")
_PER_EXPERT = re.compile(r"(?P<prefix>(?:.*\.)?)(?P<block>\w+)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.weight")


@dataclass(frozen=True)
class Stacked:
    """A model tensor that the files hold per expert: ``parts[e]`` are expert ``e``'s file tensors, whose rows
    are concatenated (gate then up) to give row block ``e`` of the model's tensor."""

    parts: tuple[tuple[str, ...], ...]

    @property
    def names(self) -> list[str]:
        return [name for expert in self.parts for name in expert]


def group_experts(
    to_model: Mapping[str, str], model_names: Collection[str], *, strict: bool = True
) -> tuple[dict[str, str], dict[str, Stacked]]:
    """Split ``to_model`` (file name -> model name) into the names loaded one to one and the fused model tensors
    gathered from per-expert file tensors (model name -> :class:`Stacked`).

    A file name is only reinterpreted when its own name is not the model's: a per-expert tensor whose fused
    tensor the model has joins it; ``block_sparse_moe.X`` becomes ``mlp.X`` where the model has that. A set of
    experts with gaps (``experts.0`` and ``experts.2`` only) raises :class:`~modelpar.CheckpointKeyError`, or with
    ``strict=False`` is left ungrouped (its fused tensor is then missing, its file tensors unexpected).
    """
    direct: dict[str, str] = {}
    found: dict[str, dict[int, dict[str, str]]] = {}  # fused model name -> expert -> projection -> file name
    layout_of: dict[str, ExpertLayout] = {}
    for file_name, name in to_model.items():
        match = None if name in model_names else _PER_EXPERT.fullmatch(name)
        layout = next(
            (lay for lay in LAYOUTS if match and match["block"] == lay.block and match["proj"] in _projs(lay)), None
        )
        if match is not None and layout is not None:
            which = "down_proj" if match["proj"] == layout.down else "gate_up_proj"
            fused = f"{match['prefix']}mlp.experts.{which}"
            if fused in model_names:
                found.setdefault(fused, {}).setdefault(int(match["e"]), {})[match["proj"]] = file_name
                layout_of[fused] = layout
                continue
        renamed = _to_mlp(name)
        direct[file_name] = renamed if name not in model_names and renamed in model_names else name
    stacked: dict[str, Stacked] = {}
    for fused, experts in found.items():
        gaps = _gaps(fused, experts, layout_of[fused])
        if gaps and strict:
            raise CheckpointKeyError(
                f"The folder holds {fused!r} per expert ({layout_of[fused].name} layout) with tensors missing:"
                f" {gaps[:4]}{' ...' if len(gaps) > 4 else ''}. Download or copy the complete folder, or pass"
                " `strict=False` to load the other tensors."
            )
        if gaps:
            direct.update({file_name: to_model[file_name] for e in experts.values() for file_name in e.values()})
        else:
            stacked[fused] = Stacked(tuple(tuple(experts[e].values()) for e in range(len(experts))))
    return direct, stacked


def _projs(layout: ExpertLayout) -> tuple[str, str, str]:
    return layout.gate, layout.up, layout.down


def _to_mlp(name: str) -> str:
    for layout in LAYOUTS:
        if layout.block != "mlp":
            name = name.replace(f".{layout.block}.", ".mlp.")
    return name


def _gaps(fused: str, experts: dict[int, dict[str, str]], layout: ExpertLayout) -> list[str]:
    """The per-expert tensors a complete set would add; orders each expert's file names gate first."""
    projs = (layout.down,) if fused.endswith("down_proj") else (layout.gate, layout.up)
    for e, by_proj in experts.items():
        experts[e] = {proj: by_proj[proj] for proj in projs if proj in by_proj}
    return [f"experts.{e}.{proj}" for e in range(max(experts) + 1) for proj in projs if proj not in experts.get(e, {})]


def stacked_shape(name: str, stacked: Stacked, shapes: Mapping[str, tuple[int, ...]], where: str) -> tuple[int, ...]:
    """The fused shape ``stacked`` gives (experts, summed rows, columns), from its parts' saved shapes."""
    per_expert = {tuple(shapes[part] for part in expert) for expert in stacked.parts}
    first = next(iter(per_expert))
    if len(per_expert) != 1 or any(len(shape) != 2 or shape[1] != first[0][1] for shape in first):
        raise CheckpointShapeError(
            f"The per-expert tensors for {name!r} in {where} do not stack: their shapes are"
            f" {sorted(per_expert)[:3]} (expected one 2-D shape per projection, the same for every expert)."
        )
    return (len(stacked.parts), sum(shape[0] for shape in first), first[0][1])


def save_layout(module: object) -> ExpertLayout | None:
    """The per-expert layout transformers writes for ``module``'s family, or None (written as the model holds)."""
    return SAVE_LAYOUTS.get(str(getattr(getattr(module, "config", None), "model_type", "")))


def split_for_save(
    name: str, shape: tuple[int, ...], layout: ExpertLayout | None
) -> list[tuple[str, tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]]:
    """The file tensors the model tensor ``name`` (full ``shape``) is written as: (file name, shape, how to cut
    it out of the full tensor). One for most tensors; one per expert (and gate/up) for fused experts."""
    fused = _FUSED.fullmatch(name) if layout is not None else None
    if layout is None or fused is None or len(shape) != 3 or (fused["which"] == "gate_up_proj" and shape[1] % 2):
        renamed = name if layout is None or layout.block == "mlp" else _to_block(name, layout)
        return [(renamed, shape, _whole)]
    base = f"{fused['prefix']}{layout.block}.experts"
    if fused["which"] == "down_proj":
        return [(f"{base}.{e}.{layout.down}.weight", shape[1:], _rows(e, 0, shape[1])) for e in range(shape[0])]
    rows = shape[1] // 2
    return [
        (f"{base}.{e}.{proj}.weight", (rows, shape[2]), _rows(e, start, rows))
        for e in range(shape[0])
        for proj, start in ((layout.gate, 0), (layout.up, rows))
    ]


def _to_block(name: str, layout: ExpertLayout) -> str:
    return re.sub(r"(^|\.)mlp\.", rf"\g<1>{layout.block}.", name, count=1)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _rows(expert: int, start: int, length: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def cut(full: torch.Tensor) -> torch.Tensor:
        return full[expert, start : start + length]

    return cut
