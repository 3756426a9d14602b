"""Reading placement and settings from llama.cpp's log (lines as llama.cpp 0.3.36 prints them)."""

from qdiff.engine.llamalog import (
    abort_lines,
    cpu_features,
    failure_reason,
    parse_placement,
    placement_problem,
)

CPU_LOG = """\
llama_model_loader: - type  f32:  109 tensors
llama_model_loader: - type q4_K:   27 tensors
print_info: file type   = Q4_K - Medium
load_tensors:   CPU_Mapped model buffer size =   235.16 MiB
load_tensors:   CPU_REPACK model buffer size =    12.00 MiB
llama_context: n_ubatch      = 512
llama_context: flash_attn            = disabled
llama_kv_cache:        CPU KV buffer size =     1.50 MiB
llama_kv_cache:        CPU KV buffer size =     7.50 MiB
sched_reserve:        CPU compute buffer size =   515.75 MiB
"""

CUDA_LOG = """\
load_tensors: offloading output layer to GPU
load_tensors: offloaded 19/19 layers to GPU
load_tensors:        CUDA0 model buffer size =   235.16 MiB
load_tensors:   CPU_Mapped model buffer size =   160.00 MiB
"""


def test_cpu_log() -> None:
    p = parse_placement(CPU_LOG)
    assert p.model_buffers == {"CPU_Mapped": 235.16, "CPU_REPACK": 12.0}
    assert p.kv_buffers == {"CPU": 9.0}
    assert p.compute_buffers == {"CPU": 515.75}
    assert p.weight_types == {"f32": 109, "q4_K": 27}
    assert p.file_type == "Q4_K - Medium"
    assert p.context == {"n_ubatch": "512", "flash_attn": "disabled"}
    assert p.offloaded_layers is None
    assert placement_problem("cpu", p, ["CPU"]) is None


def test_cuda_log_all_layers_on_the_gpu() -> None:
    p = parse_placement(CUDA_LOG)
    assert p.offloaded_layers == (19, 19)
    assert placement_problem("cuda", p, ["CUDA0"]) is None


def test_partial_offload_and_wrong_device_are_refused() -> None:
    partial = parse_placement(CUDA_LOG.replace("19/19", "10/19"))
    assert "only 10/19 layers" in placement_problem("cuda", partial, ["CUDA0"])
    assert "no weights were placed on a vulkan device" in placement_problem(
        "vulkan", parse_placement(CUDA_LOG), ["Vulkan0"]
    )
    assert "a cpu device placed weights in CUDA0" in placement_problem(
        "cpu", parse_placement(CUDA_LOG), ["CPU"]
    )
    assert "no GPU offload support" in placement_problem(
        "cuda", parse_placement(CPU_LOG), ["CUDA0"]
    )
    assert "no model buffers" in placement_problem("cpu", parse_placement(""), ["CPU"])


def test_host_buffers_of_gpu_builds_count_as_cpu() -> None:
    log = "load_tensors:    CUDA_Host model buffer size =   100.00 MiB\nload_tensors: AMX model buffer size = 1.00 MiB\n"
    assert placement_problem("cpu", parse_placement(log), ["CPU"]) is None


def test_the_reason_is_llama_cpps_own_words_never_an_ordinary_line() -> None:
    """Ordinary log lines that contain words like "unknown" or "failed" are not reasons:
    only the messages llama.cpp logged at ERROR level and ggml's abort lines are."""
    log = (
        "llama_model_loader: - kv  21: tokenizer.ggml.unknown_token_id u32 = 3\n"
        "print_info: n_swa = 512 (failed checks: 0)\n"
        "/src/llama-vocab.cpp:2317: GGML_ASSERT(id_to_token.size() == token_to_id.size()) failed\n"
        "#2  0x00007f in ggml_abort () from libggml-base.so\n"
    )
    assert abort_lines(log) == [
        "/src/llama-vocab.cpp:2317: GGML_ASSERT(id_to_token.size() == token_to_id.size()) failed"
    ]
    errors = ["llama_init_from_model: quantized V cache requires flash_attn to be enabled"]
    assert failure_reason(errors, "llama_model_loader: unknown key ignored\n") == errors
    assert failure_reason([], "print_info: file type = Q4_K (failed to guess: no)\n") == []
    assert cpu_features("CPU : SSE3 = 1 | AVX2 = 1 | AMX_INT8 = 1 | LLAMAFILE = 0 |") == [
        "SSE3",
        "AVX2",
        "AMX_INT8",
    ]
