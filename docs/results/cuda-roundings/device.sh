#!/usr/bin/env bash
# Produces this folder's captures on the lent NVIDIA H200 in one `device` call (about 5 min):
#   run(command="bash docs/results/cuda-roundings/device.sh", carry=[".carry/llama-cpp-python-0.3.36.tgz", ".carry/whl"])
# (as on 2026-12-03), and h200-ub1/ (capture.py's one-token ubatches) with
#   run(command="bash docs/results/cuda-roundings/device.sh ub1", carry=[".carry/llama-cpp-python-0.3.36.tgz", ".carry/whl-capture"])
# whose wheels are those of .carry/whl the capture needs (gguf; diskcache, which
# llama-cpp-python imports; since d6c3ae5 xxhash, which qdiff's digests import): the tree of
# 2026-12-04 leaves no room for all of .carry/whl in a call's 64 MiB. On 2026-12-04 that call carried gguf alone and failed at `import
# llama_cpp` after the build; a second call on the still warm machine (its /tmp/site and
# the build kept) installed .carry/whl/diskcache-*.whl into /tmp/site and ran
# `capture.py /tmp/cap cuda ub1` and the packing below by hand (README.md). As written
# here, with both wheels, the ub1 call has not run in one piece.
# h200-kv32/ (capture.py's kv32, an f32 KV cache) was captured on 2026-12-04 on a machine
# where docs/results/seed-long/device.sh had built the wheel (`build cuda perplexity`) and
# installed .carry/whl, by one call: PYTHONPATH=$PWD/src:/tmp/site python3
# docs/results/cuda-roundings/capture.py /tmp/capkv32 cuda kv32, packed as below (README.md);
# h200-fa/ likewise on a fresh machine after `part sdist0`, `part sdist1`, `build cuda`, one
# call installing .carry/whl-capture into /tmp/site, then capture.py /tmp/capfa cuda fa.
# .carry/ is made here by docs/results/seed-long/carry.sh (the trimmed sdist; the wheels the
# H200 lacks). It builds llama-cpp-python with CUDA only (4-5 min on 16 cores), then runs
# capture.py beside this file and packs its output into $OUT.
set -euo pipefail
SITE=/tmp/site
mkdir -p "$SITE" /tmp/src
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .carry/whl*/*.whl
tar xzf .carry/llama-cpp-python-0.3.36.tgz -C /tmp/src
export CMAKE_ARGS="-DLLAVA_BUILD=OFF -DCMAKE_CUDA_ARCHITECTURES=90 \
$(PYTHONPATH=src python3 -m qdiff.core.backends cmake-args cuda)"
export CMAKE_BUILD_PARALLEL_LEVEL=16
echo "CMAKE_ARGS=$CMAKE_ARGS"
start=$SECONDS
python3 -m pip wheel -q --no-build-isolation --no-deps -w /tmp/wheels /tmp/src/trim >/tmp/build.log 2>&1 ||
    { tail -30 /tmp/build.log; exit 1; }
python3 -m pip install -q --no-deps --target "$SITE" /tmp/wheels/*.whl
echo "built in $((SECONDS - start)) s"
export PYTHONPATH="$PWD/src:$SITE" PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,driver_version --format=csv
    grep -m1 "model name" /proc/cpuinfo
    python3 -c "import llama_cpp; print(llama_cpp.__version__, llama_cpp.llama_print_system_info().decode())"
} | tee /tmp/machine.txt
mkdir -p /tmp/cap
python3 docs/results/cuda-roundings/capture.py /tmp/cap cuda ${1:-} 2>/tmp/capture.log || {
    echo "capture.py failed:"
    grep -v "^llama\|^load\|^print_info\|^graph_\|^sched_" /tmp/capture.log | tail -40
}
cp /tmp/machine.txt /tmp/cap/
tail -200 /tmp/capture.log >/tmp/cap/capture-log-tail.txt
tar czf "$OUT/captures.tgz" -C /tmp/cap --exclude=models .
ls -la "$OUT"
