"""Read what llama.cpp did from its log: where the weights went, which settings it used.

llama.cpp reports buffer placement only in its log, so provenance comes from here. Pure
text parsing: unit-tested on captured logs.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from qdiff.core.backends import BACKENDS

_BUFFER = re.compile(
    r"^(?P<stage>load_tensors|llama_kv_cache|llama_context|sched_reserve):\s+(?P<buf>\S+)\s+"
    r"(?P<what>model|KV|output|compute) buffer size =\s+(?P<mib>[\d.]+) MiB",
    re.M,
)
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_WEIGHT_TYPE = re.compile(r"^llama_model_loader: - type\s+(\S+):\s+(\d+) tensors", re.M)
_FILE_TYPE = re.compile(r"^print_info: file type\s+= (.+)$", re.M)
_CONTEXT = re.compile(r"^llama_context: (\w+)\s+= (\S.*)$", re.M)
# ggml_vulkan's line for each device it found (ggml_vk_print_gpu_info): its name, then
# "key: value" properties (fp16, int dot, matrix cores, ...), which decide its shaders
_VULKAN_DEVICE = re.compile(r"^ggml_vulkan: (\d+) = (.+?) \| (.+)$", re.M)
# What ggml and the C++ runtime print when they abort (to stderr, not through the log
# callback): GGML_ASSERT / GGML_ABORT, and an uncaught C++ exception.
_ABORT = re.compile(r"GGML_ASSERT\(|GGML_ABORT|terminate called|what\(\):")

# buffers in host memory: the CPU's own, weight repacking, AMX, pinned host memory of a GPU
HOST_BUFFER = re.compile(r"^(CPU.*|AMX|.*_Host)$")


@dataclass
class Placement:
    model_buffers: dict[str, float] = field(default_factory=dict)  # buffer type -> MiB
    kv_buffers: dict[str, float] = field(default_factory=dict)
    compute_buffers: dict[str, float] = field(default_factory=dict)
    offloaded_layers: tuple[int, int] | None = None  # (offloaded, total); None: no GPU support
    weight_types: dict[str, int] = field(default_factory=dict)  # ggml type -> tensor count
    file_type: str | None = None
    context: dict[str, str] = field(default_factory=dict)  # llama_context's printed settings
    # ggml_vulkan's devices as it printed them: {"device": "Vulkan0", "name": ..., "fp16":
    # "1", "int dot": "0", "matrix cores": "none", ...}
    vulkan_devices: list[dict[str, str]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_placement(log: str) -> Placement:
    placement = Placement()
    targets = {
        "model": placement.model_buffers,
        "KV": placement.kv_buffers,
        "compute": placement.compute_buffers,
    }
    for m in _BUFFER.finditer(log):
        if m["what"] in targets:
            bucket = targets[m["what"]]
            bucket[m["buf"]] = round(bucket.get(m["buf"], 0.0) + float(m["mib"]), 2)
    if found := _OFFLOADED.findall(log):
        placement.offloaded_layers = (int(found[-1][0]), int(found[-1][1]))
    placement.weight_types = {t: int(n) for t, n in _WEIGHT_TYPE.findall(log)}
    if file_type := _FILE_TYPE.search(log):
        placement.file_type = file_type[1].strip()
    placement.context = {k: v.strip() for k, v in _CONTEXT.findall(log)}
    placement.vulkan_devices = [
        {"device": f"Vulkan{index}", "name": name.strip()}
        | dict(part.split(": ", 1) for part in rest.split(" | ") if ": " in part)
        for index, name, rest in _VULKAN_DEVICE.findall(log)
    ]
    return placement


def placement_problem(
    backend: str, placement: Placement, backend_device_names: list[str]
) -> str | None:
    """Why the weights are not where ``backend`` puts them, or None.

    A GPU run must hold every layer and its weights on that backend's device; a CPU run
    must hold all weights in host memory. Anything else would report one backend's
    numbers under another's name.
    """
    buffers = placement.model_buffers
    if not buffers:
        return "llama.cpp reported no model buffers; cannot tell where the weights are"
    if not BACKENDS[backend].on_gpu:
        off_host = sorted(b for b in buffers if not HOST_BUFFER.match(b))
        if off_host:
            return f"a {backend} device placed weights in {', '.join(off_host)}"
        return None
    if placement.offloaded_layers is None:
        return "this llama.cpp build reports no GPU offload support"
    done, total = placement.offloaded_layers
    if done != total:
        return f"only {done}/{total} layers were offloaded to the GPU"
    on_device = [b for b in buffers if b in backend_device_names]
    if not on_device:
        return (
            f"no weights were placed on a {backend} device "
            f"(buffers: {', '.join(sorted(buffers))}; devices: {', '.join(backend_device_names)})"
        )
    return None


def abort_lines(log: str, limit: int = 3) -> list[str]:
    """The lines in which ggml or the C++ runtime said why they aborted, last ``limit``."""
    return [line.strip() for line in log.splitlines() if _ABORT.search(line)][-limit:]


def failure_reason(error_messages: list[str], log: str) -> list[str]:
    """Why llama.cpp failed, in its own words: the messages it logged at ERROR level, then
    any abort line. Never an ordinary log line that merely contains a word like "failed"."""
    return [*error_messages[-3:], *abort_lines(log)]


def tail(text: str, lines: int = 30) -> list[str]:
    return text.splitlines()[-lines:]


def cpu_features(system_info: str) -> list[str]:
    """The CPU features llama.cpp was built for and found: "AVX2", "AMX_INT8", ..."""
    return re.findall(r"(\w+) = 1", system_info)
