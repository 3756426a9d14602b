"""llama-cpp-python's ctypes bindings, without the high-level API that qdiff does not use.

``import llama_cpp`` runs the package's ``__init__``, which imports its bindings
(``llama_cpp.llama_cpp``) and then its high-level ``Llama`` (``llama_cpp.llama``, with Jinja2,
diskcache and the chat formats). qdiff drives llama.cpp through the bindings alone, and the
high-level half is most of the import: about 45 of 60 ms on the 2-core AMD EPYC, paid again by
every worker process, one per run. So ``llama_cpp`` is set up here without running its
``__init__``: it has the bindings' names, as the package's own ``from .llama_cpp import *``
gives them, and anything else (``llama_cpp.Llama``, ``__version__``) loads the high-level
module when it is first asked for. A process that imported the package before keeps it as is.

Every qdiff module that needs llama.cpp imports ``llama_cpp`` from here, never directly.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

PACKAGE, BINDINGS, HIGH_LEVEL = "llama_cpp", "llama_cpp.llama_cpp", "llama_cpp.llama"


def _public(module: ModuleType) -> dict[str, Any]:
    """What ``from module import *`` gives (neither module defines ``__all__``)."""
    return {k: v for k, v in vars(module).items() if not k.startswith("_")}


def _bindings_only() -> ModuleType:
    if PACKAGE in sys.modules:
        return sys.modules[PACKAGE]
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None:
        raise ModuleNotFoundError(
            "llama-cpp-python is not installed in this environment: run ./setup", name=PACKAGE
        )
    package = importlib.util.module_from_spec(spec)  # its __init__ is not run
    sys.modules[PACKAGE] = package
    try:
        package.__dict__.update(_public(importlib.import_module(BINDINGS)))
    except BaseException:
        del sys.modules[PACKAGE]
        raise

    def high_level(name: str) -> Any:
        """The rest of the package's namespace, loaded on first use (PEP 562)."""
        if name == "__version__":
            from importlib.metadata import version

            return version("llama_cpp_python")
        if name.startswith("__"):  # a probe (hasattr(module, "__all__")): not a reason to load
            raise AttributeError(f"module {PACKAGE!r} has no attribute {name!r}")
        package.__dict__.update(_public(importlib.import_module(HIGH_LEVEL)))
        if name in package.__dict__:
            return package.__dict__[name]
        raise AttributeError(f"module {PACKAGE!r} has no attribute {name!r}")

    package.__dict__["__getattr__"] = high_level
    return package


if TYPE_CHECKING:
    import llama_cpp
else:
    llama_cpp = _bindings_only()

__all__ = ["llama_cpp"]
