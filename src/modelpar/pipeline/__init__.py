"""Pipeline parallelism: the model cut into stages over the ``"pipeline_parallel"`` axis, trained with one call.

``ModelParallelStrategy(pipeline_parallel_size=2, ...)`` cuts the model (its repeated blocks balanced by cost, or
``pipeline_split``), keeps on each rank only its stages' modules under the whole model's names, applies the plan
(TP, activation checkpointing, compile, FSDP) to each stage, and trains with
``loss = strategy.pipeline_step(model, inputs, targets, loss_fn)``: the schedule's forward and backward over the
micro-batches, the loss the exact token mean of the global batch, returned on every rank. See docs/pipeline.md.

May import ``plans``, ``_mesh`` and ``_errors``; the strategy imports it, never the reverse.
"""

from typing import Literal

from modelpar._errors import PipelineSplitError
from modelpar.pipeline._schedules import OFFERED_SCHEDULES, PIPELINE_SCHEDULES, ScheduleSpec
from modelpar.pipeline._split import StageCut, balance, cut_model
from modelpar.pipeline._stage import StageLayers

#: The schedules offered (torch's names); each is tested on gloo against one process.
PipelineSchedule = Literal["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"]

__all__ = [
    "OFFERED_SCHEDULES",
    "PIPELINE_SCHEDULES",
    "PipelineSchedule",
    "PipelineSplitError",
    "ScheduleSpec",
    "StageCut",
    "StageLayers",
    "balance",
    "cut_model",
]
