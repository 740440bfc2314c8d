#!/bin/bash
# --served-chunk (issue 22 item 2) on the GPU, binary B:
#   0. (KB set) regenerate the shipped CUBINs with the build_kernels example binary KB and NVRTC
#      found on the machine; the images land in $OUT/kernels_bin (commit them to kernels/bin);
#   1. selftest --backend cuda (the binary's CUBINs are stale after a kernel edit: it compiles
#      with NVRTC at start; the FP8 KV cache kernel is among the checks);
#   2. the built-in model over 300 tokens, CPU vs CUDA (run_diff.py), --served-chunk 64 healthy,
#      with both engine faults, and with --chunk 50 on top;
#   3. bisect on CUDA of compressor-state-lost@L3 and window-context-zeroed@L2 (verdicts);
#   4. (FLASH=1) the V4-Flash-dimension 5-layer checkpoint at TOKENS tokens: unchunked served vs
#      --served-chunk SC (runner time, divergent ops), and compressor-state-lost at SC.
# Usage (GPU machine, repository root):
#   OUT=/tmp/out B=target/release/nvfp4-probe KB=build_kernels bash probes/device/served_chunk_check.sh
set -u
OUT=${OUT:-/tmp/sc}; B=${B:-target/release/nvfp4-probe}; KB=${KB:-}
F=${FLASH_DIR:-/tmp/flash}; TOKENS=${TOKENS:-4096}; SC=${SC:-1000}; FLASH=${FLASH:-0}
mkdir -p "$OUT"
fail=0
if [ -n "$KB" ]; then
  echo "== 0. CUBINs"
  nv=$(find / -name 'libnvrtc.so.13*' -not -path '*/proc/*' 2>/dev/null | head -1)
  mkdir -p /work/main/kernels/bin
  LD_LIBRARY_PATH=$(dirname "$nv") $KB > $OUT/build_kernels.txt 2>&1; echo "build_kernels rc=$? (nvrtc: $nv)"
  mkdir -p $OUT/kernels_bin && cp /work/main/kernels/bin/* $OUT/kernels_bin/ 2>/dev/null
  ls -la $OUT/kernels_bin
fi
echo "== 1. selftest"
timeout 300 $B selftest --backend cuda > $OUT/selftest.txt 2>&1; rc=$?
grep -E "^(kernels|whole|selftest)|FAIL|KV cache" $OUT/selftest.txt | cut -c1-300; echo "selftest rc=$rc"
[ $rc -ne 0 ] && fail=1
echo "== 2. tiny model, 300 tokens, CPU vs CUDA under --served-chunk"
i=0
for extra in "--served-chunk 64" \
              "--served-chunk 100 --engine-fault compressor-state-lost --engine-fault window-context-zeroed@L2" \
              "--served-chunk 100 --engine-fault compressor-state-lost --chunk 50"; do
  i=$((i+1))
  for be in cpu cuda; do
    $B run --seq-len 300 --quiet --backend $be $extra --json $OUT/tiny_${i}_$be.json > $OUT/tiny_${i}_$be.txt 2>&1
    echo "tiny $i $be rc=$? ($extra): $(grep -E '^first divergent|^no op diverges' $OUT/tiny_${i}_$be.txt | head -1 | cut -c1-150)"
  done
  python3 probes/device/run_diff.py $OUT/tiny_${i}_cpu.json $OUT/tiny_${i}_cuda.json | head -4 || fail=1
done
echo "== 3. bisect on CUDA"
for f in compressor-state-lost@L3 window-context-zeroed@L2; do
  $B bisect --seq-len 300 --backend cuda --served-chunk 100 --engine-fault $f --json $OUT/bisect_$f.json > $OUT/bisect_$f.txt 2>&1
  echo "bisect $f rc=$?: $(python3 -c "import json;j=json.load(open('$OUT/bisect_$f.json'));d=j['divergences'][0];print(d['op'],(d.get('verdict') or {}).get('kind'))" 2>&1)"
done
if [ "$FLASH" = 1 ]; then
  echo "== 4. V4-Flash, 5 layers, $TOKENS tokens"
  [ -f "$F/config.json" ] || $B synth --preset flash-layer --format modelopt-nvfp4 --layers 5 --out $F > $OUT/synth.txt 2>&1
  cat $F/*.safetensors > /dev/null
  for extra in "" "--served-chunk $SC" "--served-chunk $SC --engine-fault compressor-state-lost"; do
    tag=$(echo "x$extra" | tr -c 'a-z0-9' '_')
    /usr/bin/time -f "%e" -o $OUT/t_$tag.txt timeout 240 $B run --model $F --layers 0..4 --seq-len $TOKENS --backend cuda --quiet $extra --json $OUT/flash_$tag.json > $OUT/flash_$tag.txt 2>&1
    echo "flash '$extra' rc=$? process $(tail -1 $OUT/t_$tag.txt) s; runner $(grep -oE 'ops, [0-9.]+ s' $OUT/flash_$tag.txt | tail -1); $(grep -E '^first divergent|^no op diverges' $OUT/flash_$tag.txt | head -1 | cut -c1-160)"
  done
fi
[ $fail = 0 ] && echo "served-chunk check: passed" || echo "served-chunk check: FAILED"
