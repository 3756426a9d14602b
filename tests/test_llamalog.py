"""Reading placement and settings from llama.cpp's log (lines as llama.cpp 0.3.36 prints them)."""

from qdiff.llamalog import cpu_features, error_lines, parse_placement, placement_problem

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
    assert "no GPU offload support" in placement_problem("cuda", parse_placement(CPU_LOG), ["CUDA0"])
    assert "no model buffers" in placement_problem("cpu", parse_placement(""), ["CPU"])


def test_host_buffers_of_gpu_builds_count_as_cpu() -> None:
    log = "load_tensors:    CUDA_Host model buffer size =   100.00 MiB\nload_tensors: AMX model buffer size = 1.00 MiB\n"
    assert placement_problem("cpu", parse_placement(log), ["CPU"]) is None


def test_error_lines_and_features() -> None:
    log = (
        "ok\ngguf_init_from_file_impl: failed to read magic\nllama_model_load: error loading model\n"
        "#2  0x00007f in ggml_abort () from libggml-base.so\nfine\n"
    )
    assert error_lines(log) == [
        "gguf_init_from_file_impl: failed to read magic",
        "llama_model_load: error loading model",
    ]
    assert cpu_features("CPU : SSE3 = 1 | AVX2 = 1 | AMX_INT8 = 1 | LLAMAFILE = 0 |") == [
        "SSE3", "AVX2", "AMX_INT8"
    ]
