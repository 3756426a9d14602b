"""The ggml backend devices of this llama-cpp-python build, read through ctypes."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qdiff.core.backends import BACKENDS
from qdiff.engine.bindings import llama_cpp

_DEVICE_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


@dataclass(frozen=True)
class BackendDevice:
    name: str  # "CPU", "CUDA0", "Vulkan0"
    description: str  # "NVIDIA H200", the CPU's model name, ...
    kind: str  # cpu | gpu | igpu | accel | meta
    registry: str  # "CPU", "CUDA", "Metal", "Vulkan", "BLAS", ...
    handle: int = field(default=0, repr=False, compare=False)  # ggml_backend_dev_t

    def as_record(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "kind": self.kind,
            "registry": self.registry,
        }


def shared_library(stem: str) -> ctypes.CDLL:
    """One of the ggml libraries bundled with llama-cpp-python (e.g. "ggml", "ggml-base")."""
    libdir = Path(llama_cpp.__file__).parent / "lib"
    for name in (f"lib{stem}.so", f"lib{stem}.dylib", f"{stem}.dll"):
        if (libdir / name).exists():
            return ctypes.CDLL(str(libdir / name))
    raise RuntimeError(f"lib{stem} not found in {libdir}")


def _libggml() -> ctypes.CDLL:
    lib = shared_library("ggml")
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    for fn in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(lib, fn).restype = ctypes.c_char_p
        getattr(lib, fn).argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    lib.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_reg_name.restype = ctypes.c_char_p
    lib.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    return lib


def backend_devices() -> list[BackendDevice]:
    """The ggml backend devices this build of llama-cpp-python can use on this machine."""
    lib = _libggml()
    devices = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        reg = lib.ggml_backend_dev_backend_reg(dev)
        devices.append(
            BackendDevice(
                name=lib.ggml_backend_dev_name(dev).decode(),
                description=lib.ggml_backend_dev_description(dev).decode(),
                kind=_DEVICE_KINDS.get(lib.ggml_backend_dev_type(dev), "unknown"),
                registry=lib.ggml_backend_reg_name(reg).decode(),
                handle=dev,
            )
        )
    return devices


def devices_for_backend(backend: str, devices: list[BackendDevice]) -> list[BackendDevice]:
    """The devices that can run ``backend``; an empty list means the backend is absent."""
    info = BACKENDS[backend]
    return [d for d in devices if d.registry in info.registries and d.kind in info.device_kinds]


def available_backends(devices: list[BackendDevice]) -> list[str]:
    return [name for name in BACKENDS if devices_for_backend(name, devices)]


def system_info() -> str:
    return llama_cpp.llama_print_system_info().decode().strip()
