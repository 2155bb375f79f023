"""The result of :func:`~modelpar.estimate_memory`: bytes per rank by part, and the table ``str()`` prints."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modelpar._mesh.layout import MeshLayout
from modelpar._train.grad_sync import AccumulationMode
from modelpar.memory._activations import ActivationEstimate
from modelpar.memory._float8 import Float8Estimate
from modelpar.memory._schedule import PipelineEstimate

__all__ = ["MemoryEstimate", "dtype_name"]

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs for the model state (the worst rank: FSDP2 pads every rank to the same shard).

    ``parameters``, ``gradients`` and ``optimizer_states`` persist through training; ``gathered_unit`` (the
    largest FSDP unit's parameters all-gathered in the compute dtype) and ``unit_gradients`` (its unsharded
    gradients during its backward) are transient, one unit at a time. With ``cpu_offload`` the persistent,
    sharded state lives on the host (``host``); ``device`` is the rest. ``str()`` gives a table.

    Under pipeline parallelism (``pipeline``) every figure is the worst pipeline rank's (its stages only), and the
    peak is that rank's worst moment of the schedule: ``pipeline.worst_rank`` has its parts beyond the persistent
    state, ``pipeline.ranks`` every rank's.

    Under float8 training the figures count its bytes (weights gathered in float8, compiled layers' activations, the
    casts of a layer's backward), and ``float8`` says what it changed (:mod:`modelpar.memory._float8`).
    """

    parameters: int
    gradients: int
    optimizer_states: int
    gathered_unit: int
    unit_gradients: int
    buffers: int
    host: int
    largest_unit: str
    layout: MeshLayout
    precision: str
    optimizer: str
    gradient_accumulation: AccumulationMode
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    notes: tuple[str, ...] = ()
    root_gathered: int = 0
    activations: ActivationEstimate | None = None
    moment: tuple[tuple[str, int], ...] = ()
    moment_name: str = ""
    setting: str = ""
    accumulate_grad_batches: int = 1
    pipeline: PipelineEstimate | None = None
    float8: Float8Estimate | None = None

    @property
    def total(self) -> int:
        return (
            self.parameters
            + self.gradients
            + self.optimizer_states
            + self.gathered_unit
            + self.unit_gradients
            + self.buffers
        )

    @property
    def device(self) -> int:
        return self.total - self.host

    @property
    def stored_activations(self) -> int:
        """Activations kept from forward for backward (0 when estimated without ``seq_len``)."""
        return self.activations.stored if self.activations is not None else 0

    @property
    def device_gradients(self) -> int:
        """The sharded (or, accumulating unsharded, whole) gradients on the device: none of them under offload."""
        offloaded = self.host > 0 and self.gradient_accumulation == "sharded"
        return 0 if offloaded else self.gradients

    @property
    def peak_gradients(self) -> int:
        """What the gradients add at the peak, beyond the activations.

        With ``accumulate_grad_batches == 1`` the gradients do not exist when backward starts (``zero_grad()``,
        ``set_to_none=True`` by default, freed them), and backward writes them unit by unit as it frees the
        activations: the peak holds the larger of the two, so only what the gradients exceed the activations by
        counts. Under accumulation the earlier micro-batches' gradients are there beside every activation.
        """
        if self.pipeline is not None:  # the sharded gradients appear after the last backward, if not kept
            kept = self.accumulate_grad_batches > 1 and self.gradient_accumulation == "sharded"
            return self.device_gradients if kept else 0
        if self.accumulate_grad_batches > 1:
            return self.device_gradients
        return max(0, self.device_gradients - self.stored_activations)

    @property
    def peak(self) -> int:
        """Device bytes at the worst moment of a step: persistent state, root gathered, activations, the gradients
        beyond them (:attr:`peak_gradients`), the worst moment of backward. Under pipeline parallelism: the worst
        rank's persistent state and what is live at its worst moment (:class:`PipelineEstimate`)."""
        if self.pipeline is not None:
            return self._persistent_without_gradients + self.peak_gradients + self.pipeline.worst_rank.at_peak
        return (
            self._persistent_without_gradients
            + self.peak_gradients
            + self.root_gathered
            + self.stored_activations
            + sum(size for _, size in self.moment)
        )

    @property
    def _persistent_without_gradients(self) -> int:
        """Parameters, optimizer states and buffers on the device (what offloading leaves there)."""
        state = self.parameters + self.gradients + self.optimizer_states + self.buffers
        return state - self.host - self.device_gradients

    def __str__(self) -> str:
        layout, offload = self.layout, self.host > 0
        shard = layout.fsdp_shard_size
        replicas = f", {layout.data_parallel_replicate_size} replicas" if layout.hsdp else ""
        grads = "unsharded (accumulation)" if self.gradient_accumulation == "unsharded" else "sharded"
        p, c = dtype_name(self.param_dtype), dtype_name(self.compute_dtype)
        float8_weights = " + float8 weights" if self.float8 is not None and self.float8.largest_unit_in_float8 else ""
        rows = [
            ("parameters", f"{p}, {shard}-way FSDP x {layout.tensor_parallel_size}-way TP", self.parameters, offload),
            ("gradients", f"{p}, {grads}", self.gradients, offload and self.gradient_accumulation == "sharded"),
            ("optimizer states", f"{self.optimizer}", self.optimizer_states, offload),
            ("gathered unit", f"{self.largest_unit}, {c}{float8_weights}", self.gathered_unit, False),
            ("unit gradients", "during its backward", self.unit_gradients, False),
            ("buffers", "replicated", self.buffers, False),
        ]
        head = (
            f"Memory per rank: {layout.data_parallel_size} data-parallel (shard group {shard}{replicas}) x"
            + (f" {layout.context_parallel_size} context-parallel x" if layout.context_parallel_size > 1 else "")
            + f" {layout.tensor_parallel_size} tensor-parallel; precision {self.precision}"
        )
        if self.pipeline is not None:
            head += "\n" + _pipeline_head(self.pipeline)
        if layout.expert_parallel_size > 1:
            group = layout.expert_shard_size
            head += f"\nexperts: {layout.expert_parallel_size}-way expert parallel (whole experts), " + (
                f"FSDP over the {group} ranks holding the same ones" if group > 1 else "no FSDP (one rank holds each)"
            )
        if self.float8 is not None:
            head += "\n" + _float8_lines(self.float8)
        lines = [head, f"{'':<18}{'':<34}{'device':>12}" + (f"{'host':>12}" if offload else "")]
        for name, what, size, on_host in rows:
            cells = ("", _human(size)) if on_host else (_human(size), "")
            lines.append(f"{name:<18}{what:<34}{cells[0]:>12}" + (f"{cells[1]:>12}" if offload else ""))
        lines.append(
            f"{'total':<18}{'':<34}{_human(self.device):>12}" + (f"{_human(self.host):>12}" if offload else "")
        )
        lines += self._peak_lines()
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(line.rstrip() for line in lines)

    def _peak_lines(self) -> list[str]:
        if self.pipeline is not None:
            return self._pipeline_peak_lines(self.pipeline)
        persistent = self._persistent_without_gradients
        rows: list[tuple[str, str, int | None]] = [("persistent state", "parameters, optimizer, buffers", persistent)]
        if self.accumulate_grad_batches > 1:
            grads = f"kept over {self.accumulate_grad_batches} micro-batches"
        elif self.activations is not None:
            grads = "beyond the activations backward frees"
        else:
            grads = "after backward"
        rows.append(("gradients", grads, self.peak_gradients))
        rows.append(("root gathered", "forward through backward", self.root_gathered))
        if self.activations is not None:
            rows.append(("activations", self.setting, self.activations.stored))
            rows.append((f"  assumes: {_kept_by(self.activations)}", "", None))
            rows += [(f"  {name}", "", size) for name, size in self.activations.parts]
        else:
            rows.append(("activations", "not counted: pass seq_len (--seq-len)", 0))
        rows.append(("worst moment", self.moment_name, sum(size for _, size in self.moment)))
        rows += [(f"  {name}", "", size) for name, size in self.moment if size]
        rows.append(("peak", "", self.peak))
        lines = ["", "Peak per rank (device)"]
        lines += [name if size is None else f"{name:<34}{what:<42}{_human(size):>12}" for name, what, size in rows]
        return lines

    def _pipeline_peak_lines(self, pipeline: PipelineEstimate) -> list[str]:
        usage = pipeline.worst_rank
        grads = (
            f"kept over {self.accumulate_grad_batches} accumulated batches"
            if self.peak_gradients
            else "written at the end"
        )
        rows: list[tuple[str, str, int | None]] = [
            ("persistent state", "parameters, optimizer, buffers", self._persistent_without_gradients),
            ("sharded gradients", grads, self.peak_gradients),
        ]
        if self.activations is not None:
            rows.append(("activations", self.setting, self.activations.stored))
            rows.append((f"  assumes: {_kept_by(self.activations)}", "", None))
            rows += [(f"  {name}", "", size) for name, size in self.activations.parts]
        else:
            rows.append(("activations", "not counted: pass seq_len (--seq-len)", 0))
        if usage.moment_parts:
            rows.append(("backward moment", self.moment_name, sum(size for _, size in self.moment)))
            rows += [(f"  {name}", "", size) for name, size in usage.moment_parts]
        rows += [(name, _pipeline_what(name), size) for name, size in usage.other_parts]
        rows.append(("peak", "", self.peak))
        others = ", ".join(f"rank {rank} {_human(peak)}" for rank, peak in enumerate(pipeline.peaks))
        lines = ["", f"Peak per rank (device): pipeline rank {usage.rank}, {usage.moment}"]
        lines += [name if size is None else f"{name:<34}{what:<42}{_human(size):>12}" for name, what, size in rows]
        return [*lines, f"peaks per pipeline rank: {others}"]


def _float8_lines(float8: Float8Estimate) -> str:
    """What float8 changes, in the table's head: the layers, the all-gathers, activations and casts."""
    reasons: dict[str, list[str]] = {}
    for name, why in float8.kept:
        reasons.setdefault(why, []).append(name)
    kept = "; ".join(
        f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''} ({why})" for why, names in reasons.items()
    )
    emulated = ", emulated" if float8.emulate else ""
    lines = [
        f"float8: {float8.recipe}{emulated}, {float8.converted} linear layers"
        + (f"; kept in high precision: {kept}" if kept else ""),
        f"  all-gathering every unit once: {_human(float8.all_gather)} received per rank"
        + (
            f" ({_human(float8.all_gather_without_float8)} without float8 all-gather)"
            if float8.gathers_in_float8
            else " (weights in high precision: float8 all-gather is tensorwise only)"
        ),
    ]
    if float8.activations_saved:
        lines.append(f"  compiled float8 layers keep {_human(float8.activations_saved)} fewer activations")
    if float8.casts:
        lines.append(f"  float8 casts in one layer's backward: up to {_human(float8.casts)}")
    return "\n".join(lines)


def _pipeline_head(pipeline: PipelineEstimate) -> str:
    """The pipeline line of the table's head: sizes, schedule, micro-batches, and the worst rank's stages."""
    usage = pipeline.worst_rank
    per = f" x {pipeline.stages_per_rank} stages per rank" if pipeline.stages_per_rank > 1 else ""
    batch = f" of {pipeline.micro_batch_size}" if pipeline.micro_batch_size is not None else ""
    stages = "; ".join(
        f"stage {s} ({_modules(pipeline.stage_modules[s])}): at most {n} in flight"
        for s, n in zip(usage.stages, usage.in_flight, strict=True)
    )
    return (
        f"pipeline: {pipeline.size} ranks{per}, {pipeline.schedule}, {pipeline.microbatches} micro-batches{batch};"
        f" worst: pipeline rank {usage.rank} of {pipeline.size}, {stages}"
    )


#: What each kind of pipeline part is, by how its name ends (``modelpar.memory._schedule.rank_peak`` names them).
_PIPELINE_WHAT = {
    "receive buffers": "in and gradient, one each per micro-batch",
    "every unit": "not resharded after a micro-batch's backward",
    "root": "forward through backward",
    "unsharded gradients": "accumulated, no sync until the last",
    "reduce-scatter input": "after the last backward, one unit at a time",
    "merged outputs": "the schedule's output merge (torch.cat)",
    "sharded gradients": "written by the reduce-scatters",
}


def _pipeline_what(name: str) -> str:
    return next((what for end, what in _PIPELINE_WHAT.items() if name.endswith(end)), "")


def _modules(names: tuple[str, ...]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:2])} ... {names[-1]}"


def _kept_by(activations: ActivationEstimate) -> str:
    """Which code's saved tensors the activations assume: eager PyTorch's, or compiled blocks' (and how many)."""
    compiled, layers = activations.compiled_layers, activations.layers
    if not compiled:
        return "eager (what PyTorch's ops save)"
    which = "every decoder layer" if compiled == layers else f"{compiled} of {layers} decoder layers, the rest eager"
    return f"compiled blocks (inductor: what its partitioner saves; {which})"


def dtype_name(dtype: torch.dtype) -> str:
    """``fp32``, ``bf16`` ... as the table writes a dtype."""
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _human(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size} B"
