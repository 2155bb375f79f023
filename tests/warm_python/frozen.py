"""``gc.freeze()`` for a process that has imported its libraries, with an exit as quiet as an unfrozen one.

Freezing moves every object alive into a generation that no collection walks, the interpreter's last one at exit
included. That is the point (a full collection would walk, and in a forked child copy, the ~400,000 objects of the
imports), and at exit it is harmless for pure Python: the process ends and the memory goes with it. It is not
harmless for an extension built with nanobind, which counts at exit the instances, types and functions it made that
are still alive and prints each one as a "leak" (triton 3.9, which torch 2.15's CUDA builds install, prints about 30
lines: 4 instances, 64 types, 514 functions). A fresh interpreter frees them in its last collection and prints
nothing. So where nanobind's objects are among the frozen ones, :func:`freeze` unfreezes again at exit, after the
program's own ``atexit`` handlers: 1.3 s more for that exit (measured on 2 cores; the whole suite on torch 2.15.0's
CUDA build took 504-516 s against 386 s without it, on the same 2 cores), and nothing where no nanobind extension is
loaded (torch's CPU builds, CI's; its CUDA builds up to 2.14.1, whose triton 3.8 uses pybind11). The alternatives
cost more or lose what a program prints: not freezing makes a program's first full collection walk the imports
(2.2 s), and silencing the C library's ``stderr`` at exit would also drop what the interpreter prints as it ends.
"""

from __future__ import annotations

import atexit
import gc
import sys

__all__ = ["freeze", "nanobind_loaded"]


def freeze() -> None:
    """``gc.freeze()`` now, and ``gc.unfreeze()`` at exit where a nanobind extension is loaded (see the module)."""
    gc.freeze()
    if nanobind_loaded():
        # After the imports' handlers, so it runs before theirs and after the program's (last in, first out); the
        # collection that frees what it unfroze comes after every handler.
        atexit.register(gc.unfreeze)


def nanobind_loaded() -> bool:
    """Whether a module holds a function or class made by nanobind (their types live in its ``nanobind`` module).

    Only extension modules are looked into (about 200 of 4,000; a few milliseconds): a Python module can re-export
    such an object, but then the extension that made it is loaded too.
    """
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and file.endswith(".py"):
            continue
        if any(type(value).__module__ == "nanobind" for value in list(getattr(module, "__dict__", {}).values())):
            return True
    return False
