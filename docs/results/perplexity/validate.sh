#!/usr/bin/env bash
# qdiff's text statistics held against llama.cpp's own `llama-perplexity --kl-divergence`,
# built from the llama.cpp source that llama-cpp-python 0.3.36 vendors (the library qdiff
# runs), on the same files, text, windows and CPU settings. Writes comparison.md and the two
# tools' logs beside this script (comparison-NAME.md and the logs -NAME with a NAME).
#
#   docs/results/perplexity/validate.sh [NAME]   (from the repository root, after ./setup)
#
# NAME picks config-NAME.yaml instead of config.yaml: `gemma`, a model that adds a BOS.
# The build (about 7 minutes on 2 cores) goes to build/llama-perplexity; qdiff runs its own
# workflow in build/perplexity-qdiff[-NAME] with that config, so results/ is left alone.
set -euo pipefail
cd "$(dirname "$0")/../../.."
HERE=docs/results/perplexity
BUILD=build/llama-perplexity
SUFFIX=${1:+-$1}
CONFIG=$HERE/config$SUFFIX.yaml
WORK=build/perplexity-qdiff$SUFFIX
PY=.venv/bin/python
CHUNKS=$($PY -c "import yaml; print(yaml.safe_load(open('$CONFIG'))['text']['windows'])")
TEXT=$($PY -c "import yaml; print(yaml.safe_load(open('$CONFIG'))['text']['file'])")
# the config's one model that runs: its file (Q) against its f32 copy (base)
MODEL=$($PY -c "from pathlib import Path; import yaml; from qdiff.core.config import validate
print(validate(yaml.safe_load(open('$CONFIG')), Path.cwd())[0].run_models[0])")

if [ ! -x "$BUILD/bin/llama-perplexity" ]; then
    mkdir -p build/src
    $PY -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d build/src
    tar -xzf build/src/llama_cpp_python-0.3.36.tar.gz -C build/src
    cmake -S build/src/llama_cpp_python-0.3.36/vendor/llama.cpp -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF >/dev/null
    cmake --build "$BUILD" --target llama-perplexity -j "$(nproc)" >/dev/null
fi

# qdiff first: it makes the two files (the write-up's Q8_0 requantized from the package's
# Q4_1, and its f32 copy) and scores the text with both, the f32 copy as the teacher
mkdir -p "$WORK/resources"
ln -sfn "$PWD/resources/texts" "$WORK/resources/texts"
.venv/bin/snakemake --snakefile Snakefile --directory "$WORK" --configfile "$CONFIG" --cores 2 -q

FILE=$WORK/resources/models/$MODEL
# llama-perplexity as qdiff's `cpu` device runs: 2 threads, plain attention, no repacked
# weights, one sequence of 512 tokens per batch
ARGS=(-f "$TEXT" -c 512 -b 512 -ub 512 -t 2 -fa off --no-repack --chunks "$CHUNKS")
"$BUILD/bin/llama-perplexity" -m "$FILE.dequant-f32.gguf" "${ARGS[@]}" \
    --kl-divergence-base "$BUILD/base$SUFFIX.kld" >"$HERE/llama-perplexity-base$SUFFIX.log" 2>&1
"$BUILD/bin/llama-perplexity" -m "$FILE.gguf" "${ARGS[@]}" --kl-divergence-base \
    "$BUILD/base$SUFFIX.kld" --kl-divergence >"$HERE/llama-perplexity-kld$SUFFIX.log" 2>&1

$PY "$HERE/compare.py" "$HERE/llama-perplexity-kld$SUFFIX.log" "$BUILD/base$SUFFIX.kld" "$WORK" \
    "$MODEL" >"$HERE/comparison$SUFFIX.md"
cat "$HERE/comparison$SUFFIX.md"
