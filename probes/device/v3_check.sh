#!/bin/bash
# A DeepSeek-V3-dimension checkpoint (issue 23: hidden 7168, 256 experts × 2048, MLA of 128 heads)
# on the GPU, binary B: `synth --family deepseek-v3 --preset release` (2 layers: one dense, one
# MoE) in FORMAT, then RUNS warm runs of both layers at TOKENS tokens on CUDA (runner time, bytes
# read against the checkpoint's size), and one with NVFP4_PROBE_PROFILE=1 for its floors line.
# Usage: OUT=/tmp/v3 B=target/release/nvfp4-probe FORMAT=modelopt-nvfp4 bash probes/device/v3_check.sh
set -u
OUT=${OUT:-/tmp/v3out}; B=${B:-target/release/nvfp4-probe}; D=${V3_DIR:-/tmp/v3}
FORMAT=${FORMAT:-modelopt-nvfp4}; TOKENS=${TOKENS:-128}; RUNS=${RUNS:-3}
mkdir -p "$OUT"
if [ ! -f "$D/config.json" ]; then
  /usr/bin/time -f "%e s, %M KB" -o $OUT/t_synth.txt $B synth --family deepseek-v3 --preset release --format $FORMAT --out $D > $OUT/synth.txt 2>&1
  echo "synth rc=$?: $(tail -1 $OUT/synth.txt | cut -c1-200) ($(cat $OUT/t_synth.txt))"
fi
size=$(cat $D/*.safetensors | wc -c); echo "checkpoint: $size bytes in $(ls $D/*.safetensors | wc -l) shards"
cat $D/*.safetensors > /dev/null
$B lint --model $D > $OUT/lint.txt 2>&1; echo "lint rc=$?: $(tail -1 $OUT/lint.txt | cut -c1-200)"
for i in $(seq 1 $RUNS); do
  /usr/bin/time -f "%e" -o $OUT/t_$i.txt $B run --model $D --layers 0..1 --seq-len $TOKENS --backend cuda --quiet --json $OUT/run_$i.json > $OUT/run_$i.txt 2>&1
  echo "run $i rc=$? process $(cat $OUT/t_$i.txt) s: $(grep -E 'ops, ' $OUT/run_$i.txt | tail -1); $(grep -E '^first divergent|^no op diverges' $OUT/run_$i.txt | head -1 | cut -c1-120)"
done
NVFP4_PROBE_PROFILE=1 $B run --model $D --layers 0..1 --seq-len $TOKENS --backend cuda --quiet > $OUT/prof.txt 2>&1
echo "profiled rc=$?: $(grep -E 'ops, ' $OUT/prof.txt | tail -1)"
grep -E "^floors:|^profile \(s, ops" $OUT/prof.txt | cut -c1-700
