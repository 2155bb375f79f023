"""torchao, the optional dependency float8 training runs on: imported only when a model is converted.

modelpar writes no float8 kernels: torchao's public float8 training API (``torchao.float8``) converts the layers,
casts, scales and multiplies. It is the ``float8`` extra. This module is the one place that imports it and says
what to install when it is missing or too old, so that a plan naming a recipe fails the same way on every rank,
before any collective.
"""

from __future__ import annotations

from importlib import metadata
from types import ModuleType

__all__ = ["MIN_TORCHAO", "check_torchao_version", "installed_torchao", "require_torchao"]

#: The oldest torchao tested with modelpar's float8 training (its public ``torchao.float8`` API: recipes by name,
#: ``WeightWithDynamicFloat8CastTensor`` for the float8 all-gather, the float8 tensor-parallel styles).
MIN_TORCHAO = (0, 18)
_INSTALL = "pip install 'modelpar[float8]'"


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if not part.isdigit():  # "0rc1", "dev0": stop at the first pre-release segment
            break
    return tuple(parts)


def check_torchao_version(version: str | None) -> None:
    """Raise ``ModuleNotFoundError`` for no torchao, ``ImportError`` for one older than :data:`MIN_TORCHAO`."""
    wanted = ".".join(map(str, MIN_TORCHAO))
    if version is None:
        raise ModuleNotFoundError(
            f"Float8 training needs torchao >= {wanted}, which is not installed. Install it with `{_INSTALL}`.",
            name="torchao",
        )
    if _release(version) < MIN_TORCHAO:
        raise ImportError(
            f"Float8 training needs torchao >= {wanted}, but torchao {version} is installed. Upgrade it with"
            f" `{_INSTALL}` (or `pip install -U torchao`).",
            name="torchao",
        )


def installed_torchao() -> str | None:
    """torchao's installed version, or ``None``."""
    try:
        return metadata.version("torchao")
    except metadata.PackageNotFoundError:
        return None


def require_torchao() -> ModuleType:
    """``torchao.float8``, after checking that a recent enough torchao is installed."""
    check_torchao_version(installed_torchao())
    import torchao.float8  # the optional dependency, imported where it is needed

    return torchao.float8
