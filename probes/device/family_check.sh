#!/bin/bash
# The model families on both backends (issue 23): for each family a tiny `synth --family` model in a
# real release format, `run` on the CPU and on CUDA, reports compared field by field (run_diff.py).
# Usage (GPU machine, repository root): OUT=/tmp/fam B=target/release/nvfp4-probe bash probes/device/family_check.sh
set -u
OUT=${OUT:-/tmp/fam}; B=${B:-target/release/nvfp4-probe}
mkdir -p "$OUT"
fail=0
for fm in qwen3-moe:ct-nvfp4 qwen3-moe:modelopt-nvfp4 deepseek-v3:modelopt-nvfp4 deepseek-v3:fp8-block gpt-oss:mxfp4 gpt-oss:modelopt-nvfp4 gpt-oss:bf16; do
  fam=${fm%%:*}; fmt=${fm##*:}; d=$OUT/ckpt-$fam-$fmt
  $B synth --family $fam --format $fmt --out $d > $OUT/synth-$fam-$fmt.txt 2>&1 || { echo "$fam $fmt: synth failed"; fail=1; continue; }
  last=$(python3 -c "import json;print(json.load(open('$d/config.json'))['num_hidden_layers']-1)")
  for be in cpu cuda; do
    /usr/bin/time -f "%e" -o $OUT/t.txt timeout 300 $B run --model $d --layers 0..$last --seq-len 64 --backend $be --quiet --json $OUT/$fam-$fmt-$be.json > $OUT/$fam-$fmt-$be.txt 2>&1
    echo "$fam $fmt $be rc=$? $(cat $OUT/t.txt) s"
  done
  python3 probes/device/run_diff.py $OUT/$fam-$fmt-cpu.json $OUT/$fam-$fmt-cuda.json > $OUT/$fam-$fmt-diff.txt 2>&1 || fail=1
  echo "$fam $fmt cpu vs cuda: $(head -3 $OUT/$fam-$fmt-diff.txt | tr '\n' ' ')"
done
# ModelOpt's own export of gpt-oss (tests/data), clean and with its underscore scale keys not loaded
M=tests/data/hf-families/gpt_oss/modelopt-nvfp4
for be in cpu cuda; do
  timeout 300 $B run --model $M --backend $be --quiet --json $OUT/oss-modelopt-$be.json > $OUT/oss-modelopt-$be.txt 2>&1
  echo "gpt-oss modelopt (ModelOpt's export) $be rc=$?"
  timeout 300 $B bisect --model $M --backend $be --layers 0..1 --loader-fault missing-block-scales@L1.ffn.experts > $OUT/oss-modelopt-bisect-$be.txt 2>&1
  echo "bisect missing-block-scales@L1.ffn.experts $be rc=$?: $(grep -m1 'stored-nvfp4-scales' $OUT/oss-modelopt-bisect-$be.txt | cut -c1-120)"
done
python3 probes/device/run_diff.py $OUT/oss-modelopt-cpu.json $OUT/oss-modelopt-cuda.json > $OUT/oss-modelopt-diff.txt 2>&1 || fail=1
echo "gpt-oss modelopt (ModelOpt's export) cpu vs cuda: $(head -3 $OUT/oss-modelopt-diff.txt | tr '\n' ' ')"
echo "family check: $([ $fail = 0 ] && echo all equal || echo DIFFERENCES, see $OUT)"
exit $fail
