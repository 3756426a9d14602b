"""The settings of one named device: everything in llama.cpp that changes numerics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

BACKENDS = ("cpu", "cuda", "metal", "vulkan")


@dataclass(frozen=True)
class DeviceSettings:
    backend: str
    threads: int = 2
    n_batch: int = 512
    n_ubatch: int = 512
    flash_attn: bool = False
    # extra buffer types: weight repacking (CPU_REPACK) and AMX kernels. Off by default:
    # the AMX path segfaults on Q8_0/Q4_K models on this project's Xeon (BACKGROUND.md).
    extra_bufts: bool = False
    op_offload: bool = False  # GPU backends only: send large host-side ops to the GPU
    main_gpu: int = 0
    kv_cache_type: str = "f16"
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, entry: dict[str, Any]) -> DeviceSettings:
        values = dict(entry)
        values["env"] = dict(sorted(values.get("env", {}).items()))
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def on_gpu(self) -> bool:
        return self.backend != "cpu"
