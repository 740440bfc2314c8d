#!/bin/bash
# Before/after check of a refactor that must leave every number unchanged (issue 21): the previous
# binary A and the new binary B on the same machine, CUDA backend, field by field (run_diff.py):
#   1. the built-in tiny model, layers 0..4, under every served profile;
#   2. a 5-layer V4-Flash-dimension ModelOpt checkpoint at 128 tokens (plus A/B warm timings, REPS each);
#   3. B's selftest (every kernel against the CPU reference; whole runs CPU vs CUDA).
# Usage (GPU machine, repository root):  OUT=/tmp/out A=target/prev/nvfp4-probe B=target/release/nvfp4-probe bash probes/device/seam_check.sh
set -u
OUT=${OUT:-/tmp/seam}; A=${A:-target/prev/nvfp4-probe}; B=${B:-target/release/nvfp4-probe}
F=${FLASH_DIR:-/tmp/flash}; REPS=${REPS:-3}
mkdir -p "$OUT"
fail=0
echo "== 1. tiny model, every profile"
for p in blackwell-w4a4 hopper-w4a16 emulation; do
  for v in A B; do
    eval bin=\$$v
    timeout 120 $bin run --layers 0..4 --backend cuda --served $p --quiet --json $OUT/tiny_${p}_$v.json > $OUT/tiny_${p}_$v.txt 2>&1
    echo "tiny $p $v rc=$?"
  done
  python3 probes/device/run_diff.py $OUT/tiny_${p}_A.json $OUT/tiny_${p}_B.json > $OUT/tiny_${p}_diff.txt 2>&1 || fail=1
  echo "tiny $p: $(head -3 $OUT/tiny_${p}_diff.txt | tr '\n' ' ')"
done
echo "== 2. V4-Flash, 5 layers, 128 tokens"
[ -f "$F/config.json" ] || $B synth --preset flash-layer --format modelopt-nvfp4 --layers 5 --out $F > $OUT/synth.txt 2>&1
cat $F/*.safetensors > /dev/null
for i in $(seq $REPS); do
  for v in A B; do
    eval bin=\$$v
    /usr/bin/time -f "%e" -o $OUT/t.txt timeout 120 $bin run --model $F --layers 0..4 --seq-len 128 --backend cuda --quiet --json $OUT/flash_$v.json > $OUT/flash_$v.txt 2>&1
    echo "flash $v process $(cat $OUT/t.txt) s; runner $(grep -oE 'ops, [0-9.]+ s' $OUT/flash_$v.txt)"
  done
done
python3 probes/device/run_diff.py $OUT/flash_A.json $OUT/flash_B.json > $OUT/flash_diff.txt 2>&1 || fail=1
echo "flash: $(head -3 $OUT/flash_diff.txt | tr '\n' ' ')"
echo "== 3. selftest of B"
timeout 300 $B selftest --backend cuda --json $OUT/selftest.json > $OUT/selftest.txt 2>&1; rc=$?
grep -E "^(kernels|whole|selftest)|FAIL" $OUT/selftest.txt | cut -c1-300; echo "selftest rc=$rc"
[ $rc -ne 0 ] && fail=1
echo "seam check: $([ $fail = 0 ] && echo identical and selftest passed || echo DIFFERENCES or failures, see $OUT)"
exit $fail
