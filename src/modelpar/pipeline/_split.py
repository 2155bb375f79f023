"""Where the model is cut into pipeline stages: which modules each stage holds, by name.

A decoder is a run of repeated blocks (``layers.0 .. layers.N-1``) with a few modules before it (the token
embedding) and after it (the final norm, the output layer). The blocks are found as the strategy finds FSDP units
(:func:`modelpar.plans._units.repeated_blocks`: the largest ``ModuleList`` of one class); the modules registered
before the block container, at every level from the root down to it, go with the first stage, those registered after
it with the last (for a Hugging Face ``LlamaForCausalLM``: ``model.embed_tokens`` first, ``model.norm`` and
``lm_head`` last). Modules without parameters (rotary tables, dropouts) are on every stage. A user's own cut,
``pipeline_split``, names the modules of each stage instead.

Blocks are balanced by cost, torchtitan's idea: each module costs its parameter count (a decoder's work is its
matmuls, proportional to their weights), and the stages are the contiguous runs whose largest cost is smallest, so
the first and last stages take fewer blocks to make room for the embedding and the output layer.

Everything here reads names, classes and shapes (the model is usually on the meta device), so every rank reaches the
same cut, or the same :class:`PipelineSplitError`, before any collective.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from modelpar._errors import PipelineSplitError
from modelpar.plans._units import repeated_blocks

__all__ = ["StageCut", "balance", "check_pipeline_split", "cut_model"]


@dataclass(frozen=True)
class StageCut:
    """The model's cut: the module names each stage holds, in stage order, and the modules every stage shares.

    ``container`` is the name of the blocks' container (``"layers"``) when the cut was found, else ``None`` (a
    ``pipeline_split`` given by hand).
    """

    stages: tuple[tuple[str, ...], ...]
    shared: tuple[str, ...]
    container: str | None

    def describe(self) -> str:
        parts = []
        for index, names in enumerate(self.stages):
            shown = ", ".join(names) if len(names) <= 6 else f"{', '.join(names[:3])} ... {names[-1]}"
            parts.append(f"stage {index}: {shown}")
        return "; ".join(parts)


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def balance(block_costs: Sequence[int], stages: int, *, first_extra: int = 0, last_extra: int = 0) -> list[int]:
    """How many blocks each stage gets: contiguous runs, at least one block each, minimizing the largest stage
    cost, where the first stage also pays ``first_extra`` and the last ``last_extra``. Ties go to the split whose
    earlier stages are heavier (a later stage also waits for the bubble), so the result is deterministic."""
    n = len(block_costs)
    if stages > n:
        raise ValueError(f"{stages} stages cannot share {n} blocks")
    prefix = [0]
    for block_cost in block_costs:
        prefix.append(prefix[-1] + block_cost)

    def cost(stage: int, start: int, end: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == stages - 1 else 0)
        return prefix[end] - prefix[start] + extra

    # best[s][i]: the smallest largest-cost of cutting blocks[:i] into s + 1 stages; with the cut that reaches it.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages)]
    back = [[0] * (n + 1) for _ in range(stages)]
    for i in range(1, n + 1):
        best[0][i] = cost(0, 0, i)
    for s in range(1, stages):
        for i in range(s + 1, n + 1):
            for j in range(i - 1, s - 1, -1):  # the last stage takes blocks[j:i]; later j first: heavier front
                value = max(best[s - 1][j], cost(s, j, i))
                if value < best[s][i]:
                    best[s][i], back[s][i] = value, j
    counts = []
    end = n
    for s in range(stages - 1, 0, -1):
        start = back[s][end]
        counts.append(end - start)
        end = start
    counts.append(end)
    return counts[::-1]


def _path_to(model: nn.Module, container: str) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs from the root down to ``container``, the root first (its name is "")."""
    path = [("", model)]
    prefix = ""
    for part in container.split("."):
        prefix = f"{prefix}.{part}" if prefix else part
        path.append((prefix, model.get_submodule(prefix)))
    return path


def cut_model(model: nn.Module, stages: int, pipeline_split: Sequence[Sequence[str]] | None = None) -> StageCut:
    """The cut of ``model`` into ``stages`` stages (``pipeline_split`` if given, else the one found)."""
    if pipeline_split is not None:
        return _cut_by_hand(model, stages, pipeline_split)
    name = type(model).__name__
    found = repeated_blocks(model)
    if found is None:
        raise PipelineSplitError(
            f"{name} has no repeated blocks (a `ModuleList` of layers of one class) to cut into {stages} pipeline"
            " stages. Name each stage's modules with `pipeline_split=[[...], [...]]`."
        )
    containers = {block.rpartition(".")[0] for block in found.names}
    if len(containers) != 1 or "" in containers:
        raise PipelineSplitError(
            f"{name}'s repeated blocks ({found.cls.__name__}) sit in {len(containers)} containers"
            f" ({sorted(containers)}), so the pipeline cannot be cut along one run of layers. Name each stage's"
            " modules with `pipeline_split=[[...], [...]]`."
        )
    (container,) = containers
    blocks = list(found.names)
    if stages > len(blocks):
        raise PipelineSplitError(
            f"{stages} pipeline stages (`pipeline_parallel_size` x stages per rank) but {name} has only"
            f" {len(blocks)} blocks in `{container}`: every stage needs at least one. Use at most {len(blocks)}"
            " stages."
        )
    first: list[str] = []
    last: list[str] = []
    shared: list[str] = []
    path = _path_to(model, container)
    for (parent_name, parent), (child_name, _) in itertools.pairwise(path):
        if any(True for _ in parent.parameters(recurse=False)):
            raise PipelineSplitError(
                f"`{parent_name or type(model).__name__}` holds parameters of its own"
                f" ({', '.join(n for n, _ in parent.named_parameters(recurse=False))}), which no stage can take"
                " alone. Move them into a submodule, or name each stage's modules with `pipeline_split`."
            )
        before = True
        for name_, child in parent.named_children():
            full = f"{parent_name}.{name_}" if parent_name else name_
            if full == child_name:
                before = False
                continue
            if not any(True for _ in child.parameters()):
                shared.append(full)
            else:
                (first if before else last).append(full)
    costs = [_params(model.get_submodule(b)) for b in blocks]
    counts = balance(
        costs,
        stages,
        first_extra=sum(_params(model.get_submodule(n)) for n in first) // 2,  # a lookup: half a matmul's work
        last_extra=sum(_params(model.get_submodule(n)) for n in last),
    )
    cut: list[tuple[str, ...]] = []
    start = 0
    for index, count in enumerate(counts):
        names = blocks[start : start + count]
        start += count
        extra_first = first if index == 0 else []
        extra_last = last if index == stages - 1 else []
        cut.append((*extra_first, *names, *extra_last))
    result = StageCut(tuple(cut), tuple(shared), container)
    _check_untied(model, result)
    return result


def check_pipeline_split(split: object) -> tuple[tuple[str, ...], ...]:
    """``pipeline_split`` as a tuple of name tuples; ``TypeError`` unless it is one list of module names per stage."""
    if (
        isinstance(split, (str, bytes))
        or not isinstance(split, Sequence)
        or not all(not isinstance(s, (str, bytes)) and all(isinstance(n, str) for n in s) for s in split)
    ):
        raise TypeError(
            "`pipeline_split` must be one list of module names per stage, e.g. [['tok_embeddings', 'layers.0'],"
            f" ['layers.1', 'norm', 'output']], but got {split!r}."
        )
    return tuple(tuple(s) for s in split)


def _cut_by_hand(model: nn.Module, stages: int, split: Sequence[Sequence[str]]) -> StageCut:
    """Validate a user's ``pipeline_split``: one list of module names per stage, every parameter covered once."""
    stage_names = list(check_pipeline_split(split))
    if len(stage_names) != stages:
        raise PipelineSplitError(
            f"`pipeline_split` names {len(stage_names)} stages, but the pipeline has {stages}"
            " (`pipeline_parallel_size` x stages per rank). Give one list of module names per stage."
        )
    modules = dict(model.named_modules())
    owner: dict[str, int] = {}
    for index, names in enumerate(stage_names):
        if not names:
            raise PipelineSplitError(f"`pipeline_split` stage {index} names no module; every stage needs one.")
        for module_name in names:
            if module_name not in modules or not module_name:
                raise PipelineSplitError(
                    f"`pipeline_split` stage {index} names `{module_name}`, which is not a submodule of"
                    f" {type(model).__name__}. Use names from `model.named_modules()`."
                )
            for sub, _ in modules[module_name].named_modules(prefix=module_name):
                if sub in owner and owner[sub] != index:
                    raise PipelineSplitError(
                        f"`pipeline_split` puts `{sub}` in stages {owner[sub]} and {index}; a module lives in one"
                        " stage."
                    )
                owner[sub] = index
    missing = sorted({n.rpartition(".")[0] for n, _ in model.named_parameters() if n.rpartition(".")[0] not in owner})
    if missing:
        shown = ", ".join(f"`{m or '(root)'}`" for m in missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise PipelineSplitError(
            f"`pipeline_split` leaves parameters of {shown} in no stage. Name every module that owns parameters"
            " in exactly one stage."
        )
    shared = tuple(n for n, m in model.named_children() if n not in owner and not any(True for _ in m.parameters()))
    result = StageCut(tuple(stage_names), shared, None)
    _check_untied(model, result)
    return result


def _check_untied(model: nn.Module, cut: StageCut) -> None:
    """Refuse a parameter shared by modules of two stages (tied embeddings): each stage owns its tensors."""
    stage_of: dict[int, int] = {}
    for index, names in enumerate(cut.stages):
        for module_name in names:
            for param_name, param in model.get_submodule(module_name).named_parameters(remove_duplicate=False):
                seen = stage_of.setdefault(id(param), index)
                if seen != index:
                    raise PipelineSplitError(
                        f"`{module_name}.{param_name}` is the same tensor as a parameter of stage {seen}, but it lies"
                        f" in stage {index}: tied weights (`tie_word_embeddings=True`, an output layer sharing the"
                        " embedding) cannot be split across pipeline stages. Untie them (`tie_word_embeddings=False`),"
                        " or keep both modules in one stage with `pipeline_split`."
                    )
