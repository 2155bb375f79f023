"""The one place that knows Lightning ships under two names, so every strategy works with both.

Lightning publishes the same code twice: as the standalone packages ``lightning_fabric`` / ``pytorch_lightning``
and inside the unified package as ``lightning.fabric`` / ``lightning.pytorch``. The classes are distinct, so a
``lightning.fabric.Fabric`` refuses a strategy that is only a ``lightning_fabric`` ``Strategy``; and installing
``lightning`` installs ``pytorch-lightning`` (which carries ``lightning_fabric``) beside it, so both namespaces
are usually present in one environment and a user may import either.

The mechanism, and why:

* Each adapter has **one** class, with one body of logic, that derives from Lightning's ``ModelParallelStrategy``
  of the *primary* namespace (the standalone package when installed; it always is for Fabric, a hard
  dependency). :func:`register_in_every_namespace` then registers that class as a virtual subclass
  (``ABCMeta.register``; Lightning's strategies are ABCs) of the same-named class of every *other* installed
  namespace, so every ``isinstance`` check in either framework treats it as a ``ModelParallelStrategy``.
  Deriving from both namespaces' classes at once was the alternative; it chains one namespace's ``super()``
  calls into the other's classes and breaks as soon as the two packages differ in version (an abstract
  method added in one), which ``pip`` allows since ``lightning`` does not pin ``pytorch-lightning``.
  Twin classes per namespace would copy bodies and make users pick the import matching their Lightning import,
  which is the friction this module removes.
* Run-time type checks go through :func:`classes` (the class from every installed namespace, for
  ``isinstance``) and :func:`load` with ``like=`` (the class from the namespace that the framework object at
  hand comes from, e.g. the launcher matching the connected Trainer), never through one hard-coded import.
* An adapter handed to the other framework cannot be intercepted before Lightning's own "invalid strategy"
  ``ValueError``, but that message prints the strategy's ``repr``; :func:`strategy_repr` puts the right import
  there.
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache
from typing import Any, Literal

__all__ = ["Framework", "classes", "installed", "load", "namespace_of", "register_in_every_namespace", "strategy_repr"]

Framework = Literal["fabric", "pytorch"]

#: Package names of each framework, primary (standalone) first.
_NAMESPACES: dict[Framework, tuple[str, str]] = {
    "fabric": ("lightning_fabric", "lightning.fabric"),
    "pytorch": ("pytorch_lightning", "lightning.pytorch"),
}


@cache
def installed(framework: Framework) -> tuple[str, ...]:
    """The importable namespaces of ``framework``, primary first (``()`` if none is installed)."""
    found = []
    for name in _NAMESPACES[framework]:
        root = name.split(".")[0]
        if importlib.util.find_spec(root) is not None and importlib.util.find_spec(name) is not None:
            found.append(name)
    return tuple(found)


def _resolve(namespace: str, path: str) -> Any:
    module_path, _, attr = f"{namespace}.{path}".rpartition(".")
    return getattr(importlib.import_module(module_path), attr)


def namespace_of(obj: object, framework: Framework) -> str:
    """The namespace ``obj``'s class comes from (``lightning.fabric`` ...), else the primary one.

    Lightning's cluster environments, accelerators and plugins live in the framework's own package, so the
    object tells which namespace connected the strategy; a user-defined subclass is looked up in its MRO.
    """
    names = installed(framework)
    if not names:
        raise ImportError(f"No Lightning {framework} package is installed ({' or '.join(_NAMESPACES[framework])}).")
    for klass in type(obj).__mro__:
        module = klass.__module__
        # The unified package's names start with "lightning." and the fabric one is shared by both frameworks.
        if module.startswith("lightning.") and any(n.startswith("lightning.") for n in names):
            return next(n for n in names if n.startswith("lightning."))
        if module.startswith(("lightning_fabric.", "pytorch_lightning.")):
            return names[0]
    return names[0]


def load(framework: Framework, path: str, *, like: object | None = None) -> Any:
    """``path`` (``"strategies.launchers._SubprocessScriptLauncher"``) from the namespace ``like`` comes from."""
    namespace = namespace_of(like, framework) if like is not None else installed(framework)[0]
    return _resolve(namespace, path)


@cache
def classes(framework: Framework, path: str) -> tuple[type, ...]:
    """The class at ``path`` in every installed namespace of ``framework``: the second argument of ``isinstance``."""
    return tuple(_resolve(namespace, path) for namespace in installed(framework))


def register_in_every_namespace(cls: type, framework: Framework, path: str) -> None:
    """Make ``cls`` an ``isinstance`` of the class at ``path`` in the installed namespaces it does not derive from."""
    for base in classes(framework, path):
        if not issubclass(cls, base):
            base.register(cls)  # type: ignore[attr-defined]  # Lightning's strategies are ABCs


def strategy_repr(strategy: object, framework: Framework) -> str:
    """``repr`` that names the framework the strategy is for and the import for the other one.

    Lightning prints it in its own error when a strategy is handed to the wrong framework.
    """
    if framework == "fabric":
        here, other = "modelpar.ModelParallelStrategy (Fabric, torchrun)", "from modelpar.trainer import"
        where = "the Trainer"
    else:
        here, other = "modelpar.trainer.ModelParallelStrategy (Trainer)", "from modelpar import"
        where = "Fabric or torchrun"
    return f"<{here}; for {where} use `{other} ModelParallelStrategy` instead; at 0x{id(strategy):x}>"
