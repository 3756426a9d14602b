"""Config validation: bad keys are named before any job runs; the matrix expands as documented."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from conftest import REPO, Workspace, tiny_config
from qdiff.core.config import ConfigError, check_config_files, load_experiment
from qdiff.core.stages import CAPTURE, FORCED, RUN, SERVING, STAGES, TEXT
from qdiff.core.text import DEFAULT_TEXT, DEFAULT_TEXT_SHA256

GOOD = tiny_config(Path("/models/tiny.gguf"))


def problems(config: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_experiment(config)
    return str(info.value)


def changed(**edits) -> dict:
    config = copy.deepcopy(GOOD)
    for dotted, value in edits.items():
        *path, last = dotted.split("__")
        target = config
        for key in path:
            target = target[key]
        target[last] = value
    return config


def test_shipped_config_is_valid_and_expands() -> None:
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    exp = load_experiment(config, base_dir=REPO)
    smol = "smollm2-135m-instruct"
    assert list(exp.models) == [
        "gemma-3-270m-q4_k_m",
        smol,
        f"{smol}.requant-q8_0",
        f"{smol}.requant-q4_k_m",
    ]
    assert exp.run_models == [
        "gemma-3-270m-q4_k_m",
        f"{smol}.requant-q8_0",
        f"{smol}.requant-q4_k_m",
    ]
    assert exp.models[f"{smol}.requant-q8_0"].parent == smol
    assert exp.dequant == ("none", "f32")
    assert len(exp.all_combinations()) == 3 * 2 * 2  # the source file itself does not run
    assert len(exp.pairs("gemma-3-270m-q4_k_m")) == 6
    assert len(exp.prompts) >= 8 and exp.generation["n_tokens"] == 64
    assert exp.teacher_forcing is not None and exp.teacher_forcing["n_tokens"] == 20


def test_the_writeup_config_is_valid_and_expands() -> None:
    config = yaml.safe_load((REPO / "config/seed.yaml").read_text())
    exp = load_experiment({**config, "strict_devices": False}, base_dir=REPO)
    assert len(exp.all_combinations()) == 2 * 9 * 2
    assert {d.backend for d in exp.devices.values()} == {"cpu", "cuda", "vulkan"}
    assert exp.prompts[0].text == "What is Rust?"


def test_the_long_generations_config_is_the_default_with_longer_texts() -> None:
    long = load_experiment(yaml.safe_load((REPO / "config/long.yaml").read_text()), base_dir=REPO)
    default = load_experiment(
        yaml.safe_load((REPO / "config/config.yaml").read_text()), base_dir=REPO
    )
    assert long.generation["n_tokens"] == 256 and long.run_models == default.run_models
    assert long.all_combinations() == default.all_combinations()


@pytest.mark.parametrize(
    "name",
    [
        "config/config.yaml",
        "config/long.yaml",
        "docs/results/perplexity/config.yaml",
        "docs/results/perplexity/config-gemma.yaml",
        "docs/results/seed-long/config.yaml",
        "docs/results/reference-model/config.yaml",
        "docs/results/bench-epyc/config-text.yaml",
        "docs/results/bench-h200/config-text.yaml",
    ],
)
def test_the_shipped_configs_score_the_text_setup_fetches(name: str) -> None:
    text = yaml.safe_load((REPO / name).read_text())["text"]
    assert (text["file"], text["sha256"]) == (str(DEFAULT_TEXT), DEFAULT_TEXT_SHA256)


def test_defaults_are_filled_in() -> None:
    exp = load_experiment(GOOD)
    cpu = exp.devices["cpu"]
    assert (cpu.n_batch, cpu.n_ubatch, cpu.extra_bufts, cpu.op_offload) == (512, 512, False, False)
    assert exp.strict_devices is False and exp.generation["chat_template"] is False
    gpu = load_experiment(changed(devices={"gpu": {"backend": "cuda"}})).devices["gpu"]
    assert gpu.op_offload is True


def test_run_spec_depends_only_on_its_own_slice() -> None:
    exp = load_experiment(GOOD)
    other = load_experiment(changed(devices__cpu__n_ubatch=1))
    combo = exp.all_combinations()[-1]  # a cpu-fa combination
    assert combo.device == "cpu-fa"
    for stage in STAGES.values():
        assert exp.spec(stage, combo) == other.spec(stage, combo)
    cpu_combo = exp.all_combinations()[0]
    assert exp.spec(RUN, cpu_combo) != other.spec(RUN, cpu_combo)
    # runtime knobs are not part of any job's params: changing them reruns nothing
    relaxed = load_experiment(
        {**GOOD, "run_timeout_s": 5, "strict_devices": True, "download": {"stall_window_s": 5}}
    )
    for stage in STAGES.values():
        assert relaxed.spec(stage, cpu_combo) == exp.spec(stage, cpu_combo)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (changed(devices__cpu__n_thread=4), "config.devices.cpu: unknown key 'n_thread'"),
        (changed(colour="red"), "config: unknown key 'colour'"),
        (
            changed(devices__cpu__backend="cudaa"),
            "config.devices.cpu.backend: 'cudaa' is not one of",
        ),
        (changed(dequant=["none", "int4"]), "config.dequant[1]: 'int4' is not one of"),
        (changed(models__tiny__requantize=["q9_9"]), "unknown quant type 'q9_9'"),
        (changed(models={"../x": {"path": "a.gguf"}}), "name '../x' is not usable as a file name"),
        (changed(models={"a/b": {"path": "a.gguf"}}), "name 'a/b' is not usable"),
        (changed(models={"": {"path": "a.gguf"}}), "name '' is not usable"),
        (changed(devices={"x__y": {"backend": "cpu"}}), "name 'x__y' is not usable"),
        (changed(models={"m": {"sha256": "0" * 64}}), "config.models.m: give exactly one source"),
        (changed(models={"m": {"path": "a", "url": "https://x/a"}}), "found url, path"),
        (
            changed(models={"m": {"url": "https://example.org/m.gguf"}}),
            "a `url` source needs sha256",
        ),
        (
            changed(models={"m": {"url": "http://example.org/m.gguf", "sha256": "0" * 64}}),
            "plain http:// is refused for example.org",
        ),
        (
            changed(models={"m": {"path": "a", "sha256": "xyz"}}),
            "config.models.m.sha256: 'xyz' does not match",
        ),
        (changed(models={}), "config.models: {} should be non-empty"),
        (changed(devices={}), "config.devices: {} should be non-empty"),
        (changed(dequant=[]), "config.dequant: [] should be non-empty"),
        (
            changed(prompts=[{"id": "a", "text": "x"}, {"id": "a", "text": "y"}]),
            "duplicate prompt id 'a'",
        ),
        (changed(prompts=[{"id": "a"}]), "config.prompts"),
        (changed(devices__cpu__op_offload=True), "a cpu device cannot offload ops"),
        (changed(generation__n_tokens=0), "config.generation.n_tokens: 0 is less than the minimum"),
        (
            changed(models={"m.requant-q8_0": {"path": "a"}}),
            "are reserved for the models and copies qdiff derives",
        ),
        # a configured model named like another model's dequantized copy: their files collide
        (
            changed(models={"tiny": {"path": "a"}, "tiny.dequant-f32": {"path": "b"}}),
            "config.models.tiny.dequant-f32: names containing '.dequant-' are reserved",
        ),
        (
            changed(models={"Tiny": {"path": "a"}, "tiny": {"path": "b"}}),
            "config.models.tiny: model 'tiny' would write resources/models/tiny.gguf, which model 'Tiny' writes too",
        ),
        (
            changed(
                models={"m": {"url": "https://user:pw@example.org/m.gguf", "sha256": "0" * 64}}
            ),
            "config.models.m.url: credentials in the URL (user:password@) are refused",
        ),
        (changed(prompts=[{"id": "a", "text": ""}]), "config.prompts[0].text: must not be empty"),
        (changed(prompts=[]), "config.prompts: [] should be non-empty"),
        (
            changed(prompts=7),
            "config.prompts: must be a list of {id, text} or the path of a YAML file",
        ),
        (changed(reference="cpu"), "config.reference: 'cpu' is not a configured combination"),
        (
            changed(reference_model="nope"),
            "config.reference_model: 'nope' is not a configured model",
        ),
        (changed(exact={"enabled": "yes"}), "config.exact.enabled: 'yes' is not of type 'boolean'"),
        (
            changed(capture={"pairs": [["cpu.none", "gpu.none"]]}),
            "config.capture.pairs[0]: 'gpu.none' is not a configured combination",
        ),
        (changed(capture={"pairs": [["cpu.none"]]}), "config.capture.pairs[0]"),
        (
            changed(capture={"prompts": ["nope"]}),
            "config.capture.prompts: 'nope' is not a prompt id",
        ),
        (
            changed(capture={"tensors": "attn_(["}),
            "config.capture.tensors: not a regular expression",
        ),
        (
            changed(teacher_forcing={"top_k": 1}),
            "config.teacher_forcing.top_k: 1 is less than the minimum",
        ),
        (changed(teacher_forcing={"topk": 5}), "config.teacher_forcing: unknown key 'topk'"),
        (
            changed(first_step_logits="top"),
            "config.first_step_logits: 'top' is not one of ['full', 'top_k']",
        ),
        (
            changed(first_step_logits="top_k", teacher_forcing={"enabled": False}),
            "config.first_step_logits: top_k keeps first steps in the teacher-forced pass",
        ),
        (
            changed(first_step_logits="top_k", reference="cpu.none", reference_model="tiny"),
            "config.first_step_logits: top_k cannot measure against reference_model",
        ),
        (
            changed(first_step_logits="top_k", report={"writeup_claims": True}),
            "config.first_step_logits: top_k cannot check report.writeup_claims",
        ),
        (
            changed(prompts=[{"id": "a", "text": "before\x00after"}]),
            "config.prompts[0].text (prompt 'a'): contains a NUL character",
        ),
        (
            changed(serving={"prompts": ["nope"]}),
            "config.serving.prompts: 'nope' is not a prompt id",
        ),
        (
            changed(serving={"cases": ["repeat", "batch"], "others": []}),
            "config.serving.others: empty, so the batch cases would not run",
        ),
        (
            changed(serving={"n_ubatch": []}),
            "config.serving.n_ubatch: empty, so the ubatch cases would not run",
        ),
        (
            changed(serving={"cases": []}),
            "config.serving.cases: empty; set enabled: false to run none",
        ),
        (
            changed(serving={"cases": ["batched"]}),
            "config.serving.cases[0]: 'batched' is not one of ['repeat', 'process', 'batch'",
        ),
        (
            changed(serving={"others": [0]}),
            "config.serving.others[0]: 0 is less than the minimum of 1",
        ),
        (
            changed(devices__cpu__env={"NOT A NAME": "1"}),
            "config.devices.cpu.env: 'NOT A NAME' does not match",
        ),
        (changed(text={"enabled": True}), "config.text.file: needed when text.enabled is true"),
        (
            changed(text={"enabled": True, "file": "no/such.txt", "sha256": "0" * 64}),
            "config.text.file: no/such.txt does not exist (./setup fetches the default",
        ),
        (changed(text={"n_ctx": 2}), "config.text.n_ctx: 2 is less than the minimum of 4"),
    ],
)
def test_bad_config_names_the_key(config: dict, expected: str) -> None:
    assert expected in problems(config)


def test_forced_and_capture_specs_depend_on_what_they_use() -> None:
    exp = load_experiment(GOOD)
    combo = exp.all_combinations()[1]
    assert exp.teacher("tiny") == exp.combinations("tiny")[1]  # the reference, cpu.f32
    forced = exp.spec(FORCED, combo)
    assert forced["stage"] == "forced" and forced["forcing"] == {
        "teacher": "cpu.f32",
        "top_k": 1024,
    }
    capture = exp.spec(CAPTURE, combo)
    assert [p["id"] for p in capture["prompts"]] == ["rust"]  # the first prompt by default
    assert "n_tokens" not in capture["generation"]
    longer = load_experiment(changed(generation__n_tokens=3))
    assert longer.spec(CAPTURE, combo) == capture and longer.spec(FORCED, combo) != forced


def test_the_text_spec_depends_on_what_it_uses(tmp_path: Path) -> None:
    """A text job reruns when its text, window or slice changes, never when the prompts or
    the generation do; every combination keeps the teacher's token ids."""
    (tmp_path / "t.txt").write_text("words")
    text = {"enabled": True, "file": "t.txt", "sha256": "0" * 64, "windows": 2}
    exp = load_experiment(changed(text=text), base_dir=tmp_path)
    combo = exp.all_combinations()[0]
    spec = exp.spec(TEXT, combo)
    assert spec["text"] == {
        "file": "t.txt",
        "sha256": "0" * 64,
        "n_ctx": 512,
        "windows": 2,
        "top_k": 1024,
        "teacher": "cpu.f32",
    }
    assert spec["generation"] == {"n_ctx": 512} and "prompts" not in spec
    other = load_experiment(changed(text=text, generation__n_tokens=3), base_dir=tmp_path)
    assert other.spec(TEXT, combo) == spec
    wider = load_experiment(changed(text={**text, "n_ctx": 64}), base_dir=tmp_path)
    assert wider.spec(TEXT, combo) != spec


def test_the_serving_spec_depends_on_what_it_uses() -> None:
    on = changed(serving={"enabled": True})
    exp = load_experiment(on)
    combo = exp.all_combinations()[1]
    spec = exp.spec(SERVING, combo)
    assert spec["serving"]["prompts"] == ["rust", "france"]  # the first two by default
    assert [c["id"] for c in spec["serving"]["cases"]][:3] == ["repeat", "process", "batch-3"]
    assert "repeats" not in spec
    assert load_experiment({**on, "repeats": 3}).spec(SERVING, combo) == spec
    assert load_experiment({**on, "teacher_forcing": {"top_k": 8}}).spec(SERVING, combo) == spec
    fewer = load_experiment(changed(serving={"n_tokens": 4}))
    assert fewer.spec(SERVING, combo) != spec and fewer.spec(RUN, combo) == exp.spec(RUN, combo)


def test_all_problems_are_reported_at_once() -> None:
    text = problems(changed(devices__cpu__n_thread=4, devices__cpu__backend="tpu"))
    assert "n_thread" in text and "tpu" in text


def test_prompt_file(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text("- {id: a, text: hello}\n- {id: b, text: world}\n")
    exp = load_experiment(changed(prompts="p.yaml"), base_dir=tmp_path)
    assert [p.id for p in exp.prompts] == ["a", "b"]
    assert "cannot read prompt file" in problems(changed(prompts="missing.yaml"))
    # the prompt file is held to the config's standard: its problems are named by file and key
    (tmp_path / "dup.yaml").write_text("- {id: a, text: hello, text: again}\n")
    with pytest.raises(ConfigError, match=r"dup.yaml: duplicate key 'text' on line 1"):
        load_experiment(changed(prompts="dup.yaml"), base_dir=tmp_path)
    (tmp_path / "empty.yaml").write_text("- {id: a, text: ''}\n")
    with pytest.raises(ConfigError, match=r"empty.yaml\[0\].text: must not be empty"):
        load_experiment(changed(prompts="empty.yaml"), base_dir=tmp_path)


def test_a_prompt_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    (tmp_path / "latin1.yaml").write_bytes("- {id: a, text: café}\n".encode("latin-1"))
    assert (
        f"config.prompts: prompt file {tmp_path / 'latin1.yaml'} is not UTF-8 text (byte 0xe9 "
        "on line 1, offset 19): save it as UTF-8"
    ) in problems(changed(prompts=str(tmp_path / "latin1.yaml")))


SIGNED = "sig-in-a-spaced-url-31337"
TOKEN = "hf_pastedTokenNotAName8ch3"


def test_a_config_error_never_shows_a_secret(workspace: Workspace) -> None:
    """A model URL with a space in its path (Python's HTTP client would refuse it later, with
    an error that quotes the whole URL) and a token pasted where its variable's name belongs:
    both named before any job, neither value shown on the console or kept in .snakemake/."""
    workspace.write_config(
        changed(
            models={
                "spaced": {"url": f"https://h.example/a b.gguf?sig={SIGNED}", "sha256": "0" * 64},
                "pasted": {
                    "url": "https://h.example/m.gguf",
                    "sha256": "0" * 64,
                    "token_env": TOKEN,
                },
            }
        )
    )
    proc = workspace.snakemake("--dry-run", check=False)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert (
        "config.models.spaced.url: https://h.example/a b.gguf?… contains a space or a control "
        "character: percent-encode it (a space is %20)"
    ) in said
    assert (
        "config.models.pasted.token_env: must be the name of the environment variable that "
        "holds the token (capital letters, digits and _, e.g. HF_TOKEN), not the token itself"
    ) in said
    kept = [p for p in (workspace.root / ".snakemake").rglob("*") if p.is_file()]
    assert SIGNED not in said and TOKEN not in said
    assert not any(s.encode() in p.read_bytes() for p in kept for s in (SIGNED, TOKEN))


YTE = """__use_yte__: true
models:
  ?if __import__("pathlib").Path("{ran}").write_text("ran"):
    m: {{path: a.gguf}}
"""


def test_a_templated_config_is_refused(workspace: Workspace) -> None:
    """YTE: Snakemake runs a config that sets __use_yte__ as Python code while it loads it.
    qdiff refuses such a config; the default config.yaml is refused before Snakemake loads
    it, so its code never runs. A --configfile is loaded, code and all, before any of
    qdiff's code runs: the README says so."""
    ran = workspace.root / "yte-ran"
    workspace.config_path.parent.mkdir(parents=True)
    workspace.config_path.write_text(YTE.format(ran=ran))
    proc = workspace.snakemake("--dry-run", check=False)
    assert proc.returncode != 0
    assert "config/config.yaml: sets __use_yte__" in proc.stdout + proc.stderr
    assert not ran.exists()
    other = workspace.root / "other.yaml"
    other.write_text(YTE.format(ran=ran))
    proc = workspace.snakemake("--dry-run", "--configfile", str(other), check=False)
    assert proc.returncode != 0 and "other.yaml: sets __use_yte__" in proc.stdout + proc.stderr
    assert ran.exists()  # Snakemake ran it: what the README warns of


def test_workflow_stops_before_any_job_on_a_bad_config(workspace: Workspace) -> None:
    workspace.write_config(changed(devices__cpu__n_thread=4))
    proc = workspace.snakemake("--dry-run", check=False)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "config.devices.cpu: unknown key 'n_thread'" in output
    assert not (workspace.root / "results").exists()


def test_configfile_replaces_the_default_experiment(workspace: Workspace) -> None:
    """--configfile names the whole experiment: nothing of config/config.yaml leaks in."""
    workspace.write_config(GOOD)  # the default, with devices cpu and cpu-fa
    other = workspace.root / "other.yaml"
    other.write_text(yaml.safe_dump({**GOOD, "devices": {"solo": {"backend": "cpu"}}}))
    jobs = workspace.planned_jobs_with("--configfile", str(other))
    assert {j.wildcards["device"] for j in jobs if j.rule == "run_combination"} == {"solo"}
    merged = workspace.planned_jobs_with("--config", "repeats=2")
    assert {j.wildcards["device"] for j in merged if j.rule == "run_combination"} == {
        "cpu",
        "cpu-fa",
    }


def test_duplicate_keys_are_named_not_silently_merged(workspace: Workspace) -> None:
    workspace.write_config(GOOD)
    text = workspace.config_path.read_text()
    workspace.config_path.write_text(text + "dequant: [none]\n")  # a second top-level dequant
    proc = workspace.snakemake("--dry-run", check=False)
    assert proc.returncode != 0
    assert "duplicate key 'dequant' on line" in proc.stdout + proc.stderr
    nested = "devices:\n  cpu: {backend: cpu}\n  cpu: {backend: cuda}\n"
    path = workspace.root / "dup.yaml"
    path.write_text(nested)
    with pytest.raises(ConfigError, match=r"duplicate key 'cpu' on line 3 \(first on line 2\)"):
        check_config_files([path])
