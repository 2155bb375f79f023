"""What float8 training to apply: a recipe, which linear layers, and whether to emulate the kernels.

A :class:`Float8Training` is data, like the plan that holds it (``ParallelPlan(float8=...)``): frozen, validated
when made, identical on every rank. A recipe name alone (``"rowwise"``) is shorthand for ``Float8Training("rowwise")``.
The names are torchao's (``torchao.float8.Float8LinearRecipeName``), listed here so that a plan can be checked
without importing torchao.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from modelpar.plans._units import ModuleSelector, normalize_selector

__all__ = ["RECIPES", "Float8Recipe", "Float8Training", "float8_spec"]

Float8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]

#: Each recipe, and what it does (torchao's ``Float8LinearRecipeName`` values).
RECIPES: dict[str, str] = {
    "tensorwise": (
        "one scale per tensor (cuBLAS kernel); the fastest, and FSDP all-gathers the weights in float8 when it shards"
        " them over several ranks"
    ),
    "rowwise": "one scale per row (CUTLASS kernel), scales rounded to powers of 2; more accurate, a little slower",
    "rowwise_with_gw_hp": "rowwise, with the weight gradient computed in high precision; the most accurate",
}


@dataclass(frozen=True)
class Float8Training:
    """Float8 training of a model's ``nn.Linear`` layers, with torchao's ``convert_to_float8_training``.

    Each converted layer casts its input, weight and output gradient to float8 for its three matrix multiplies,
    while its weight (the master copy the optimizer updates and checkpoints hold) stays in high precision.

    Attributes:
        recipe: how tensors are scaled into float8's range (:data:`RECIPES`).
        modules: which ``nn.Linear`` layers to convert: patterns (``("layers.*.attention.*",)``), classes or a
            predicate, as ``fsdp_units`` takes them. ``None``: every ``nn.Linear`` whose input and output sizes
            (per tensor-parallel rank) are multiples of 16, as the float8 kernels need, except the LM head (the
            plan's ``"output"`` layer, a Hugging Face model's output embeddings, or a last layer that projects onto
            an embedding's vocabulary), whose precision matters most for the loss. A selected layer the kernels
            cannot take is refused.
        all_gather: FSDP2 all-gathers the converted weights in float8 (half the bytes of bf16), with their scales
            computed in one all-reduce before the forward that needs them. ``None``: on for ``"tensorwise"``, the
            only recipe that supports it, where FSDP2 shards each weight over more than one rank, and off where it
            shards over one (a single GPU, tensor parallelism alone): there nothing is gathered, and the float8
            casts, which run in FSDP2's eager hooks, only cost time (on an H200, 2026-11-28: 1.140x bf16's
            tokens/s with them, 1.218x without). torchtitan turns it on by the same rule. ``True`` forces it on
            (refused with another recipe), ``False`` off.
        emulate: run float8's casts and scales but multiply in high precision, on any device (CPU included): the
            numerics of float8 training without its kernels, for tests and for checking a recipe without an
            H100. ``False`` (default) needs a GPU with float8 kernels (compute capability 8.9 or newer).
    """

    recipe: Float8Recipe = "tensorwise"
    modules: ModuleSelector | None = None
    all_gather: bool | None = None
    emulate: bool = False

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(
                f"Float8Training(recipe={self.recipe!r}) is not a float8 recipe. Use one of {list(RECIPES)}."
            )
        if self.modules is not None:
            object.__setattr__(self, "modules", normalize_selector(self.modules, "Float8Training", "modules"))
        if self.all_gather is not None and not isinstance(self.all_gather, bool):
            raise TypeError(f"Float8Training(all_gather={self.all_gather!r}) must be a bool or None.")
        if self.all_gather and self.recipe != "tensorwise":
            raise ValueError(
                f"Float8Training(recipe={self.recipe!r}, all_gather=True): only the 'tensorwise' recipe can all-gather"
                " its weights in float8 (one scale per tensor survives sharding; one per row does not). Use"
                " recipe='tensorwise', or leave `all_gather` unset."
            )
        if not isinstance(self.emulate, bool):
            raise TypeError(f"Float8Training(emulate={self.emulate!r}) must be a bool.")

    @property
    def gathers_in_float8(self) -> bool:
        """Whether FSDP2 all-gathers the converted weights in float8 where it shards them over more than one rank
        (:meth:`gathers_in_float8_over` for a given number)."""
        return self.gathers_in_float8_over(None)

    def gathers_in_float8_over(self, fsdp_shard_size: int | None) -> bool:
        """Whether FSDP2 all-gathers the converted weights in float8 when it shards each over ``fsdp_shard_size``
        ranks (``None``: not known, taken as more than one). ``all_gather`` decides when set; left unset, the
        tensorwise recipe does, except over a single rank, where there is nothing to gather."""
        if self.all_gather is not None:
            return self.all_gather
        return self.recipe == "tensorwise" and (fsdp_shard_size is None or fsdp_shard_size > 1)


def float8_spec(value: object, owner: str) -> Float8Training | None:
    """``value`` as a :class:`Float8Training` (a recipe name is one), ``None`` for none, or a ``TypeError`` /
    ``ValueError`` that names ``owner``."""
    if value is None or isinstance(value, Float8Training):
        return value
    if isinstance(value, str):
        if value not in RECIPES:
            raise ValueError(
                f"{owner}(float8={value!r}) is not a float8 recipe. Use one of {list(RECIPES)}, a"
                " `modelpar.float8.Float8Training`, or None."
            )
        return Float8Training(value)  # type: ignore[arg-type]
    raise TypeError(
        f"{owner}(float8=...) must be a recipe name ({list(RECIPES)}), a `modelpar.float8.Float8Training`, or None,"
        f" but got {type(value).__name__}."
    )
