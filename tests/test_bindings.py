"""qdiff.engine.bindings: llama-cpp-python's bindings without its high-level API, which loads
only when asked for. Each check runs in a fresh interpreter, as a worker does."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import version


def run_fresh(code: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_a_worker_process_never_imports_the_high_level_api() -> None:
    assert run_fresh(
        """
        import sys
        import qdiff.engine.worker
        print("llama_cpp.llama" in sys.modules, "jinja2" in sys.modules)
        print("llama_cpp.llama_cpp" in sys.modules)
        """
    ) == ["False", "False", "True"]


def test_the_bindings_are_the_package_and_the_rest_loads_on_first_use() -> None:
    out = run_fresh(
        """
        import sys
        from qdiff.engine.bindings import llama_cpp
        import llama_cpp as imported
        print(imported is llama_cpp, "llama_cpp.llama" in sys.modules)
        # the package's names are the bindings' (its own `from .llama_cpp import *`)
        print(llama_cpp.llama_backend_init is llama_cpp.llama_cpp.llama_backend_init)
        print(b"CPU" in llama_cpp.llama_print_system_info())
        print(llama_cpp.__version__)
        print(hasattr(llama_cpp, "__all__"), "llama_cpp.llama" in sys.modules)  # a mere probe
        from llama_cpp import Llama
        print(Llama.__module__, "llama_cpp.llama" in sys.modules)
        try:
            llama_cpp.no_such_name
        except AttributeError as exc:
            print(type(exc).__name__)
        """
    )
    assert out == [
        "True",
        "False",
        "True",
        "True",
        version("llama_cpp_python"),
        "False",
        "False",
        "llama_cpp.llama",
        "True",
        "AttributeError",
    ]


def test_a_package_imported_before_is_kept() -> None:
    assert run_fresh(
        """
        import llama_cpp
        from qdiff.engine import bindings
        print(bindings.llama_cpp is llama_cpp, hasattr(llama_cpp, "Llama"))
        """
    ) == ["True", "True"]
