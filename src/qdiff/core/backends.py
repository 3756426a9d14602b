"""The llama.cpp backends qdiff knows, in one table.

Everything that depends on the backend reads this table: the config schema's `backend` enum,
which ggml devices a run may use, where a GPU run must put its weights, what the quantized
kernels do to activations (the diagnosis), what the provenance records, which build flags
`./setup` passes to CMake, and which conda environment file a run uses (`envs/<name>.yaml`).
Adding a backend is one entry here plus its `envs/` file; tests iterate the table.

Pure Python with no third-party imports: `./setup` runs it before anything is installed
(``python3 -m qdiff.core.backends cmake-args cuda,vulkan``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

_FLOAT_WEIGHTS = {"f32", "f16", "bf16"}
# CPU: a matmul's input is converted to its weight type's vec_dot_type (ggml-cpu/ggml-cpu.c
# type_traits_cpu; docs/background.md). The diagnosis names it; qdiff.exact.roundings
# emulates it.
CPU_VEC_DOT_TYPE = {
    "f32": "f32",
    "f16": "f16",
    "bf16": "bf16",
    **dict.fromkeys(("q1_0", "q2_0", "q4_0", "q5_0", "q8_0", "iq4_nl", "mxfp4", "nvfp4"), "q8_0"),
    **dict.fromkeys(("q4_1", "q5_1"), "q8_1"),
    **dict.fromkeys(
        ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq2_xxs", "iq2_xs", "iq3_xxs", "iq3_s")
        + ("iq2_s", "iq1_s", "iq1_m", "iq4_xs", "tq1_0", "tq2_0"),
        "q8_k",
    ),
}


def _quantized(weight_types: list[str]) -> list[str]:
    return sorted(t for t in weight_types if t.lower() not in _FLOAT_WEIGHTS)


def _cpu_activations(weight_types: list[str]) -> str:
    groups: dict[str, list[str]] = {}
    for t in _quantized(weight_types):
        low = t.lower()
        fmt = CPU_VEC_DOT_TYPE.get(low, "q8_k").upper()
        groups.setdefault(fmt, []).append(t)
    return "; ".join(f"{','.join(ts)}→{fmt}" for fmt, ts in sorted(groups.items()))


def nvidia_smi() -> dict[str, str] | None:
    """GPU name, driver and CUDA version from nvidia-smi, when it exists."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        query = (
            subprocess.run(
                [exe, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
            .stdout.strip()
            .splitlines()
        )
        header = subprocess.run([exe], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", header)
    name, driver, memory = (query[0].split(", ") + ["", "", ""])[:3] if query else ("", "", "")
    return {"name": name, "driver": driver, "memory": memory, "cuda": cuda[1] if cuda else ""}


@dataclass(frozen=True)
class Backend:
    name: str
    registries: frozenset[str]  # ggml_backend_reg_name of its devices
    on_gpu: bool  # weights and every layer must be offloaded to one of its devices
    cmake_args: str  # what ./setup passes to CMake for this backend
    # what a quantized-weight matmul does to the activations, given the file's weight types
    activations: Callable[[list[str]], str]
    # extra provenance of the machine's devices (driver, toolkit), or None
    device_info: Callable[[], dict[str, str] | None] | None = None

    @property
    def device_kinds(self) -> frozenset[str]:
        """ggml device types a run of this backend may use."""
        return frozenset({"gpu", "igpu"} if self.on_gpu else {"cpu"})

    def activation_formats(self, weight_types: list[str]) -> str:
        quantized = _quantized(weight_types)
        if not quantized:
            return f"{self.name}: no quantized weights"
        return f"{self.name}: {self.activations(quantized)}"


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend(
            name="cpu",
            registries=frozenset({"CPU"}),
            on_gpu=False,
            cmake_args="",
            activations=_cpu_activations,
        ),
        Backend(
            name="cuda",
            registries=frozenset({"CUDA"}),
            on_gpu=True,
            # --exclude-libs: without it every model load segfaulted in
            # llama_model::print_info on the H200 host (libstdc++ symbols bound into
            # libggml-cuda.so; ../shared/DEVICE.md)
            cmake_args="-DGGML_CUDA=on -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL",
            activations=lambda q: f"{','.join(q)}→q8_1 (MMVQ/MMQ)",
            device_info=nvidia_smi,
        ),
        Backend(
            name="metal",
            registries=frozenset({"Metal", "MTL"}),
            on_gpu=True,
            cmake_args="-DGGML_METAL=on",
            activations=lambda q: (
                f"{','.join(q)} dequantized in the kernel, activations not quantized (rounded "
                "to f16 in matmuls of more than 8 tokens)"
            ),
        ),
        Backend(
            name="vulkan",
            registries=frozenset({"Vulkan"}),
            on_gpu=True,
            cmake_args="-DGGML_VULKAN=on",
            # ggml-vulkan.cpp: ggml_vk_mul_mat_vec_q_f16 up to 8 tokens (mul_mat_vec_max_cols),
            # quantizing where ggml_vk_should_use_mmvq says (vendor, k, type) and the device
            # has integer dot products; beyond, ggml_vk_mul_mat_q_f16, whose coopmat2 branch
            # has no q8_1 (MMQ) pipelines and so rounds the activations to f16
            activations=lambda q: (
                f"{','.join(q)}: one token: f32 activations unless ggml_vk_should_use_mmvq "
                "picks q8_1 (by vendor, row length and type); 2-8 tokens: →q8_1 with integer "
                "dot products (not Q6_K, except on Intel); more (a prompt): rounded to f16 on "
                "coopmat2 GPUs and on coopmat1 GPUs without an MMQ pipeline, else →q8_1 (MMQ) "
                "with integer dot products"
            ),
        ),
    )
}


def cmake_args(names: str) -> str:
    """CMake arguments for a comma-separated list of backends (``cpu`` needs none)."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in BACKENDS]
    if unknown or not wanted:
        raise ValueError(
            f"unknown backend {', '.join(unknown) or repr(names)}: "
            f"use one or more of {', '.join(BACKENDS)}, separated by commas"
        )
    flags: list[str] = []
    for name in wanted:
        flags += [f for f in BACKENDS[name].cmake_args.split() if f not in flags]
    return " ".join(flags)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "cmake-args":
        try:
            print(cmake_args(argv[1]))
        except ValueError as exc:
            print(f"setup: {exc}", file=sys.stderr)
            return 2
        return 0
    print("usage: python -m qdiff.core.backends cmake-args BACKEND[,BACKEND...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
