"""llama.cpp: the stages that run it, each in an isolated child process.

Only the modules that import ``bindings`` load native code, and only child processes import
them: the worker that runs a stage (``worker``), the quantize child (``quant``'s main) and the
backend probe (``probe``'s main). The processes that supervise them (``stage``, ``quant``'s
``derive``, ``probe``'s check) never do.

- ``bindings``: ``llama_cpp``, the bindings without the high-level API (faster to import);
- ``log``: llama.cpp's log with its levels (ERROR lines are a failure's reason), and the
  backend's start (``init_backend``);
- ``devices``: the ggml backend devices of this build;
- ``model``: one model and one context (``LoadedModel``): generation, teacher forcing;
- ``capture``: named intermediate tensors through the eval callback;
- ``worker``: the child that runs one stage of one combination; ``stage``: its supervisor;
- ``llamalog``: what llama.cpp's log text says (where the weights are, why it failed);
- ``provenance``: the machine, the build and where a run ran;
- ``quant``: requantized and dequantized copies (``llama_model_quantize``);
- ``probe``: which backends this build can use here (``strict_devices``).
"""
