"""Cutting a model into this rank's stages before anything is sharded: which stages, their modules, what is absent.

The model arrives whole, usually on the meta device (``fabric.init_module(empty_init=True)``: nothing allocated).
Every rank computes the same cut; each keeps only its stages' modules; the other modules are never allocated on
it (they stay on the meta device until the model is pruned, and materialization only runs their initializers on
throwaway storage, so this rank's modules get the values one process gives them: ``modelpar._init.materialize``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from modelpar.pipeline._hf import check_hugging_face_pipeline, hugging_face_stage
from modelpar.pipeline._schedules import ScheduleSpec, stage_ids
from modelpar.pipeline._split import StageCut, cut_model
from modelpar.pipeline._stage import stage_view
from modelpar.plans._checks import WHOLE_MODEL_NAMES
from modelpar.plans._context import is_hugging_face

__all__ = ["LocalStages", "local_stages"]


@dataclass(frozen=True)
class LocalStages:
    """This rank's stages: their indices, their modules (shallow views of the model), the names they keep, and the
    ids of the model's modules this rank does not hold."""

    cut: StageCut
    indices: tuple[int, ...]
    views: tuple[nn.Module, ...]
    kept: tuple[str, ...]
    absent: frozenset[int]


def local_stages(
    model: nn.Module,
    *,
    spec: ScheduleSpec,
    pipeline_rank: int,
    pipeline_parallel_size: int,
    per_rank: int,
    pipeline_split: Sequence[Sequence[str]] | None,
) -> LocalStages:
    """Cut ``model`` into ``pipeline_parallel_size x per_rank`` stages and build the views of this rank's."""
    hugging_face = is_hugging_face(model)
    if hugging_face:
        check_hugging_face_pipeline(model)
    cut = cut_model(model, pipeline_parallel_size * per_rank, pipeline_split)
    indices = tuple(
        stage_ids(spec, rank=pipeline_rank, pipeline_parallel_size=pipeline_parallel_size, per_rank=per_rank)
    )
    names = frozenset(name for name, _ in model.named_modules() if name)
    views = []
    for index in indices:
        view = stage_view(model, cut.stages[index])
        setattr(view, WHOLE_MODEL_NAMES, names)
        if hugging_face:
            hugging_face_stage(view, first=index == 0, last=index == len(cut.stages) - 1)
        views.append(view)
    kept = tuple(name for index in indices for name in cut.stages[index])
    present = {id(m) for view in views for m in view.modules()}
    ancestors = {id(model.get_submodule(n.rpartition(".")[0])) for n in kept} | {id(model)}
    for name in kept:  # every module on the way down to a kept one is (a view of) this rank's
        parts = name.split(".")
        for depth in range(len(parts)):
            ancestors.add(id(model.get_submodule(".".join(parts[:depth]))))
    absent = frozenset(id(m) for m in model.modules() if id(m) not in present and id(m) not in ancestors)
    return LocalStages(cut, indices, tuple(views), kept, absent)
