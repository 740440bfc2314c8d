#!/bin/bash
# Long prompts (issue 22) on the GPU, CUDA backend, binary B:
#   1. selftest (every kernel against the CPU reference, incl. the attention on a later query
#      block and a block of indexer scores; whole runs CPU vs CUDA, and attention by chunks of 7);
#   2. a 5-layer V4-Flash-dimension ModelOpt checkpoint (synthesized as in seam_check.sh) at each
#      of TOKENS, unchunked and with --chunk CHUNK: wall time, the runner's time, the GPU memory
#      peak (nvidia-smi sampled every 200 ms) and the exit code; a run that fails says so;
#   3. at 16,384 tokens (when in TOKENS) the reports of --chunk 512, --chunk 2048 and unchunked
#      compared field by field (run_diff.py);
#   4. past 16,384 tokens only chunked runs, their chunk chosen from --mem-gib MEMGIB (a device
#      budget, default 40), next to --chunk CHUNK;
#   5. (TINY=1) the built-in model over 300 tokens in chunks of 7 and 64 on the CUDA backend
#      against the CPU backend's unchunked report (run_diff.py).
# Each run is capped at TO seconds; keep TOKENS short enough that the whole script fits a device
# command's 10 minutes (e.g. TOKENS="4096 16384", then TOKENS="65536", then TOKENS=131072).
# Usage (GPU machine, repository root):
#   OUT=/tmp/out B=target/release/nvfp4-probe TOKENS="4096 16384" bash probes/device/long_check.sh
set -u
OUT=${OUT:-/tmp/long}; B=${B:-target/release/nvfp4-probe}
F=${FLASH_DIR:-/tmp/flash}; TOKENS=${TOKENS:-"4096 16384"}; CHUNK=${CHUNK:-2048}; TO=${TO:-240}
SELFTEST=${SELFTEST:-1}; MEMGIB=${MEMGIB:-40}; TINY=${TINY:-0}
mkdir -p "$OUT"
fail=0

# peak of nvidia-smi's memory.used (MiB) while "$@" runs
peak_run() {
  local tag=$1; shift
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > $OUT/smi_$tag.txt 2>/dev/null &
  local smi=$!
  /usr/bin/time -f "%e" -o $OUT/t_$tag.txt timeout $TO "$@" > $OUT/$tag.txt 2>&1
  local rc=$?
  kill $smi 2>/dev/null; wait $smi 2>/dev/null
  local peak=$(sort -n $OUT/smi_$tag.txt | tail -1)
  echo "$tag: rc=$rc process $(cat $OUT/t_$tag.txt 2>/dev/null | tail -1) s; runner $(grep -oE 'ops, [0-9.]+ s' $OUT/$tag.txt | tail -1); GPU peak ${peak:-?} MiB"
  [ $rc -ne 0 ] && { fail=1; tail -3 $OUT/$tag.txt | cut -c1-300; }
  return 0
}

if [ "$SELFTEST" = 1 ]; then
  echo "== 1. selftest"
  timeout 300 $B selftest --backend cuda --json $OUT/selftest.json > $OUT/selftest.txt 2>&1; rc=$?
  grep -E "^(kernels|whole|selftest)|FAIL" $OUT/selftest.txt | cut -c1-400; echo "selftest rc=$rc"
  [ $rc -ne 0 ] && fail=1
fi

echo "== 2. V4-Flash, 5 layers"
[ -f "$F/config.json" ] || $B synth --preset flash-layer --format modelopt-nvfp4 --layers 5 --out $F > $OUT/synth.txt 2>&1
cat $F/*.safetensors > /dev/null
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > $OUT/gpu.txt 2>&1
for t in $TOKENS; do
  common=(run --model $F --layers 0..4 --seq-len $t --backend cuda --quiet)
  if [ $t -le 16384 ]; then
    peak_run flash_${t}_whole $B "${common[@]}" --json $OUT/flash_${t}_whole.json
  fi
  peak_run flash_${t}_chunk$CHUNK $B "${common[@]}" --chunk $CHUNK --json $OUT/flash_${t}_chunk$CHUNK.json
  if [ $t -gt 16384 ]; then
    peak_run flash_${t}_mem$MEMGIB $B "${common[@]}" --mem-gib $MEMGIB --json $OUT/flash_${t}_mem$MEMGIB.json
  fi
  if [ $t = 16384 ]; then
    peak_run flash_${t}_chunk512 $B "${common[@]}" --chunk 512 --json $OUT/flash_${t}_chunk512.json
    for c in $CHUNK 512; do
      python3 probes/device/run_diff.py $OUT/flash_${t}_whole.json $OUT/flash_${t}_chunk$c.json > $OUT/diff_${t}_$c.txt 2>&1 || fail=1
      echo "16k unchunked vs --chunk $c: $(head -3 $OUT/diff_${t}_$c.txt | tr '\n' ' ')"
    done
  fi
done
if [ "$TINY" = 1 ]; then
  echo "== 5. tiny model, 300 tokens: CUDA in chunks vs CPU whole"
  $B run --seq-len 300 --backend cpu --quiet --json $OUT/tiny_cpu.json > $OUT/tiny_cpu.txt 2>&1
  for c in 7 64; do
    $B run --seq-len 300 --backend cuda --quiet --chunk $c --json $OUT/tiny_cuda_$c.json > $OUT/tiny_cuda_$c.txt 2>&1
    python3 probes/device/run_diff.py $OUT/tiny_cpu.json $OUT/tiny_cuda_$c.json > $OUT/tiny_diff_$c.txt 2>&1 || fail=1
    echo "tiny CPU whole vs CUDA --chunk $c: $(head -3 $OUT/tiny_diff_$c.txt | tr '\n' ' ')"
  done
fi
echo "long check: $([ $fail = 0 ] && echo passed || echo FAILURES, see $OUT)"
exit $fail
