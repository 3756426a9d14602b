"""The backend table is the one place: the schema, setup, envs/ and the docs agree with it."""

from __future__ import annotations

import re
import subprocess

import pytest

from conftest import REPO
from qdiff.core.backends import BACKENDS, cmake_args
from qdiff.core.config import _schema
from qdiff.core.settings import DeviceSettings


def test_the_schema_offers_exactly_the_backends_of_the_table() -> None:
    device = _schema()["properties"]["devices"]["additionalProperties"]["properties"]
    assert device["backend"]["enum"] == list(BACKENDS)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_each_backend_has_its_conda_environment_with_its_build_flags(name: str) -> None:
    env = (REPO / "envs" / f"{name}.yaml").read_text()
    for flag in BACKENDS[name].cmake_args.split():
        assert flag in env, f"envs/{name}.yaml does not mention {flag}"
    assert "llama-cpp-python ==0.3.36" in env


@pytest.mark.parametrize("name", list(BACKENDS))
def test_each_backend_says_what_it_does_to_activations_and_where_it_runs(name: str) -> None:
    backend = BACKENDS[name]
    assert backend.activation_formats(["q4_K", "q8_0"]).startswith(f"{name}: ")
    assert backend.registries and backend.device_kinds
    assert DeviceSettings(backend=name).on_gpu is backend.on_gpu


def test_setup_takes_its_flags_from_the_table() -> None:
    setup = (REPO / "setup").read_text()
    assert "python3 -m qdiff.core.backends cmake-args" in setup
    assert not re.search(r"-DGGML_(CUDA|METAL|VULKAN)", setup)  # no second list of flags
    bad = subprocess.run(
        ["bash", "-c", 'PYTHONPATH=src python3 -m qdiff.core.backends cmake-args "$B"'],
        env={"B": "cuda,tpu", "PATH": "/usr/bin:/bin"},
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "unknown backend tpu" in bad.stderr


def test_several_backends_build_together() -> None:
    both = cmake_args("cuda,vulkan").split()
    assert "-DGGML_CUDA=on" in both and "-DGGML_VULKAN=on" in both
    assert cmake_args("cpu") == ""


def test_the_readme_documents_every_gpu_backend() -> None:
    readme = (REPO / "README.md").read_text()
    for name, backend in BACKENDS.items():
        if backend.on_gpu:
            assert f"QDIFF_BACKEND={name}" in readme or f"`{name}`" in readme


def test_strict_devices_probes_the_machine_as_each_device_sees_it(tmp_path) -> None:
    from qdiff.core.config import ConfigError, load_experiment
    from qdiff.engine.probe import check_strict_devices

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    config = {
        "models": {"m": {"path": str(tmp_path / "m.gguf")}},
        "prompts": [{"id": "p", "text": "Hi"}],
        "devices": {
            "cpu": {"backend": "cpu"},
            # lavapipe: llama.cpp lists a CPU-type Vulkan device only when it is named
            "vulkan": {
                "backend": "vulkan",
                "env": {"GGML_VK_VISIBLE_DEVICES": "0", "MY_API_KEY": "s3cret"},
            },
            "vulkan-unnamed": {"backend": "vulkan"},
        },
    }
    seen: list[dict[str, str]] = []

    def probe(env):
        seen.append(dict(env))
        vulkan = [{"name": "Vulkan0", "registry": "Vulkan", "kind": "gpu"}]
        cpu = [{"name": "CPU", "registry": "CPU", "kind": "cpu"}]
        return cpu + (vulkan if env.get("GGML_VK_VISIBLE_DEVICES") == "0" else [])

    with pytest.raises(ConfigError) as failed:
        check_strict_devices(load_experiment(config, tmp_path), probe)
    assert seen == [{}, {"GGML_VK_VISIBLE_DEVICES": "0"}]  # once per env; no hidden value
    (problem,) = failed.value.problems
    assert problem.startswith("config.devices.vulkan-unnamed: strict_devices is on")
