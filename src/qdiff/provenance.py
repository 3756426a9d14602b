"""What a run records about itself: versions, machine, devices, buffers, settings."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

import qdiff

RECORD_FORMAT = 1
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL|AUTH", re.I)


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


def redact_env(env: dict[str, str]) -> dict[str, str]:
    """Environment settings with the values of secret-looking names hidden."""
    return {k: ("<redacted>" if SECRET_NAME.search(k) else v) for k, v in env.items()}


def nvidia_smi() -> dict[str, str] | None:
    """GPU name, driver and CUDA version from nvidia-smi, when it exists."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        query = subprocess.run(
            [exe, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.strip().splitlines()
        header = subprocess.run([exe], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", header)
    name, driver, memory = (query[0].split(", ") + ["", "", ""])[:3] if query else ("", "", "")
    return {"name": name, "driver": driver, "memory": memory, "cuda": cuda[1] if cuda else ""}


def machine() -> dict[str, Any]:
    return {
        "qdiff": qdiff.__version__,
        "llama_cpp_python": package_version("llama_cpp_python"),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "os": platform.platform(),
        "cpu_model": cpu_model(),
    }


def run_provenance(
    spec: dict[str, Any], loaded: Any, placement: Any, used_devices: list[Any],
    all_devices: list[Any],
) -> dict[str, Any]:
    """Where and how a loaded model ran: versions, machine, devices, buffers, kernels."""
    from qdiff import engine  # native: only inside the worker
    from qdiff.llamalog import cpu_features

    sysinfo = engine.system_info()
    settings = spec["settings"]
    record_provenance = {
        **machine(),
        "system_info": sysinfo,
        "backend_devices": [asdict(d) for d in all_devices],
        "used_devices": [asdict(d) for d in used_devices],
        "model_file": {
            **spec["model_info"],
            "description": loaded.describe(),
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
        "cpu_kernels": {
            "features": cpu_features(sysinfo),
            "extra_bufts": settings["extra_bufts"],
            "weight_buffers": sorted(placement.model_buffers),
        },
        "env": redact_env(settings.get("env", {})),
    }
    if settings["backend"] == "cuda":
        record_provenance["nvidia_smi"] = nvidia_smi()
    return record_provenance


def record_head(spec: dict[str, Any], status: str) -> dict[str, Any]:
    """The fields every record of a combination starts with."""
    settings = spec["settings"]
    return {
        "qdiff_record": RECORD_FORMAT,
        "status": status,
        "model": spec["model"],
        "device": spec["device"],
        "dequant": spec["dequant"],
        "settings": {**settings, "env": redact_env(settings.get("env", {}))},
        "generation": spec["generation"],
    }


def success_record(
    spec: dict[str, Any],
    results: list[tuple[dict[str, Any], Any]],
    loaded: Any,
    provenance: dict[str, Any],
) -> dict[str, Any]:
    prompts = []
    decode_total, decode_steps, prompt_total = 0.0, 0, 0.0
    for prompt, gen in results:
        prompts.append(
            {
                "id": prompt["id"],
                "prompt_text": prompt["text"],
                "n_prompt_tokens": len(gen.prompt_tokens),
                "tokens": gen.tokens,
                "text": gen.text,
                "stopped_at_eog": gen.stopped_at_eog,
                "prompt_ms": round(1000 * gen.prompt_seconds, 3),
                "decode_ms_per_token": (
                    round(1000 * float(np.mean(gen.decode_seconds)), 3)
                    if gen.decode_seconds else None
                ),
            }
        )
        decode_total += sum(gen.decode_seconds)
        decode_steps += len(gen.decode_seconds)
        prompt_total += gen.prompt_seconds
    return {
        **record_head(spec, "ok"),
        "prompts": prompts,
        "timings": {
            "load_s": round(loaded.load_seconds, 4),
            "prompt_ms_mean": round(1000 * prompt_total / max(len(results), 1), 3),
            "decode_ms_per_token": (
                round(1000 * decode_total / decode_steps, 3) if decode_steps else None
            ),
        },
        "provenance": provenance,
    }


def failure_record(
    spec: dict[str, Any], status: str, error: dict[str, Any]
) -> dict[str, Any]:
    return {
        **record_head(spec, status),
        "prompts": [],
        "timings": {},
        "error": error,
        "provenance": {**machine(), "model_file": spec["model_info"]},
    }


def llama_build_id() -> str:
    """Identify the installed llama-cpp-python build without loading its native code:
    its version and the names, sizes and mtimes of its shared libraries."""
    import hashlib
    from importlib.util import find_spec

    spec = find_spec("llama_cpp")
    if spec is None or not spec.origin:
        return "llama-cpp-python not installed"
    libdir = Path(spec.origin).parent / "lib"
    parts = [package_version("llama_cpp_python")]
    for lib in sorted(libdir.glob("*")) if libdir.is_dir() else []:
        stat = lib.stat()
        parts.append(f"{lib.name}:{stat.st_size}:{int(stat.st_mtime)}")
    return parts[0] + "+" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]
