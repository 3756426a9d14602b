"""The settings of one named device: everything in llama.cpp that changes numerics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from qdiff.core.backends import BACKENDS, Backend

# KV cache precisions a device may ask for, with their ggml type ids (ggml.h)


@dataclass(frozen=True)
class DeviceSettings:
    backend: str
    threads: int = 2
    n_batch: int = 512
    n_ubatch: int = 512
    flash_attn: bool = False
    # extra buffer types: weight repacking (CPU_REPACK) and AMX kernels. Off by default:
    # the AMX path segfaults on Q8_0/Q4_K models on this project's Xeon (docs/background.md).
    extra_bufts: bool = False
    op_offload: bool = False  # GPU backends only: send large host-side ops to the GPU
    main_gpu: int = 0
    kv_cache_type: str = "f16"
    # values of names that are not known settings are placeholders (qdiff.core.secrets)
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, entry: dict[str, Any]) -> DeviceSettings:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in entry.items() if k in known}
        values["env"] = dict(sorted(values.get("env", {}).items()))
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def backend_info(self) -> Backend:
        return BACKENDS[self.backend]

    @property
    def on_gpu(self) -> bool:
        return self.backend_info.on_gpu


def relation(a: dict[str, Any], b: dict[str, Any]) -> str:
    """How two devices' settings (as recorded) relate: ``backend`` (different backends),
    ``gpu`` (same GPU backend, another GPU), ``settings`` (the same hardware, other
    settings) or ``same``. Only the first two are a change of device."""
    if a["backend"] != b["backend"]:
        return "backend"
    if BACKENDS[a["backend"]].on_gpu and a.get("main_gpu") != b.get("main_gpu"):
        return "gpu"
    return "same" if a == b else "settings"


RELATION_TEXT = {
    "backend": "cross-backend",
    "gpu": "another GPU of the same backend",
    "settings": "same device, other settings",
    "same": "same device and settings",
}
