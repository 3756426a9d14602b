"""What a run records about itself: versions, machine, devices, buffers, settings."""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import qdiff
from qdiff.core import secrets
from qdiff.core.backends import BACKENDS
from qdiff.core.hashcache import HashCache
from qdiff.engine.llamalog import Placement, cpu_features


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    return {
        "qdiff": qdiff.__version__,
        "llama_cpp_python": package_version("llama_cpp_python"),
        "python": platform.python_version(),
        "numpy": package_version("numpy"),
        "os": platform.platform(),
        "cpu_model": cpu_model(),
    }


def run_provenance(
    spec: dict[str, Any],
    description: str,
    system_info: str,
    placement: Placement,
    used_devices: list[Any],
    all_devices: list[Any],
) -> dict[str, Any]:
    """Where and how a loaded model ran: versions, machine, devices, buffers, kernels."""
    settings = spec["settings"]
    backend = BACKENDS[settings["backend"]]
    record = {
        **machine(),
        "system_info": system_info,
        "backend_devices": [d.as_record() for d in all_devices],
        "used_devices": [d.as_record() for d in used_devices],
        "model_file": {
            **spec["model_info"],
            "description": description,
            "file_type": placement.file_type,
            "weight_types": placement.weight_types,
        },
        "placement": {
            "model_buffers": placement.model_buffers,
            "kv_buffers": placement.kv_buffers,
            "compute_buffers": placement.compute_buffers,
            "offloaded_layers": placement.offloaded_layers,
        },
        "llama_context": placement.context,
        # which shaders a Vulkan device takes (qdiff.exact.vulkan): its printed properties
        "vulkan_devices": placement.vulkan_devices,
        "cpu_kernels": {
            "features": cpu_features(system_info),
            "extra_bufts": settings["extra_bufts"],
            "weight_buffers": sorted(placement.model_buffers),
        },
        # the device's env as configured: values qdiff does not know as settings are
        # placeholders (qdiff.core.secrets), never the values; and whether each hidden value
        # reached this process
        "env": settings.get("env", {}),
        "hidden_env_received": secrets.received(settings.get("env", {})),
    }
    if backend.device_info is not None:
        record["device_info"] = backend.device_info()
    return record


def llama_build_id(cache: HashCache | None = None) -> str:
    """Identify the installed llama-cpp-python build without loading its native code: its
    version and the content of its shared libraries (a rebuilt library reruns every run; a
    reinstall of the same bytes does not)."""
    import hashlib

    spec = find_spec("llama_cpp")
    if spec is None or not spec.origin:
        return "llama-cpp-python not installed"
    libdir = Path(spec.origin).parent / "lib"
    cache = cache or HashCache()
    parts = [package_version("llama_cpp_python")]
    for lib in sorted(libdir.glob("*")) if libdir.is_dir() else []:
        if lib.is_file() and not lib.is_symlink():
            parts.append(f"{lib.name}:{cache.sha256(lib)}")
    cache.save()
    return parts[0] + "+" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]
