#!/bin/bash
# GPU machine check, one command. Stages (STAGES, space-separated; default "selftest"):
#   selftest  kernels vs the CPU reference, rcp.approx table, kernel bandwidth, whole tiny runs CPU vs CUDA
#   flash     synthesize a V4-Flash-dimension checkpoint (FLASH_LAYERS layers, FLASH_FORMAT), then
#             warm runs (x3), a cold run (page cache dropped with posix_fadvise), CPU vs CUDA on layer 0
#   bisect    bisect with a loader fault in layer 3 on the Flash checkpoint, timed against one run
#   experts   the grouped routed-experts path: whole tiny runs CPU vs CUDA in both NVFP4 formats
#             (all served profiles); with the flash stage, a Flash run with NVFP4_PROBE_EXPERTS=loop
#             compared field by field with the grouped one (probes/device/run_diff.py)
# Usage (on the GPU machine, repository root, release binary present):
#   OUT=/tmp/out STAGES="selftest flash bisect" bash probes/device/gpu_check.sh
set -u
B=${B:-target/release/nvfp4-probe}
OUT=${OUT:-/tmp/nvfp4-probe-out}
STAGES=${STAGES:-selftest}
F=${FLASH_DIR:-/tmp/flash}
FMT=${FLASH_FORMAT:-modelopt-nvfp4}
NL=${FLASH_LAYERS:-5}
L="0..$((NL-1))"
mkdir -p "$OUT"
has() { [[ " $STAGES " == *" $1 "* ]]; }
evict() { python3 -c "
import os,sys,glob
for p in glob.glob(sys.argv[1]+'/*.safetensors'):
    fd=os.open(p,os.O_RDONLY); os.fsync(fd) if False else None; os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED); os.close(fd)
" "$1"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
nproc >> "$OUT/gpu.txt"; free -g >> "$OUT/gpu.txt"; df -h /tmp >> "$OUT/gpu.txt"
if has selftest; then
  ( time timeout 300 $B selftest --backend cuda $([ "${BENCH_GIB:-2}" != 0 ] && echo --bench ${BENCH_GIB:-2}) ${RCP_TABLE:+--rcp-table /tmp/rcp_table.bin} --json "$OUT/selftest.json" ) > "$OUT/selftest.txt" 2>&1
  rc=$?; echo "selftest rc=$rc" >> "$OUT/selftest.txt"; grep -E "^(kernels|whole|selftest|rcp)|FAIL|GiB" "$OUT/selftest.txt" | cut -c1-300
  [ -f /tmp/rcp_table.bin ] && gzip -9c /tmp/rcp_table.bin > "$OUT/rcp_table.bin.gz"
  [ $rc -ge 2 ] && { echo "selftest could not run: skipping the rest"; exit 1; }
fi
if has experts; then
  # MXFP4 experts: grouped (default) and per expert (NVFP4_PROBE_EXPERTS=loop-mx)
  for v in modelopt-nvfp4: ct-nvfp4: mxfp4: mxfp4:loop-mx; do
    fmt=${v%%:*}; ex=${v#*:}; tag=$fmt${ex:+-$ex}
    [ -f /tmp/tiny_$fmt/config.json ] || $B synth --preset tiny --format $fmt --out /tmp/tiny_$fmt > /dev/null 2>&1 || echo "synth $fmt failed"
    ( env ${ex:+NVFP4_PROBE_EXPERTS=$ex} timeout 300 $B selftest --backend cuda --model /tmp/tiny_$fmt --json "$OUT/experts_tiny_$tag.json" ) > "$OUT/experts_tiny_$tag.txt" 2>&1
    echo "tiny $tag rc=$?" >> "$OUT/experts_tiny_$tag.txt"; grep -E "^whole|^selftest|rc=|FAIL" "$OUT/experts_tiny_$tag.txt" | cut -c1-300
  done
fi
if has flash; then
  if [ ! -f "$F/config.json" ]; then
    ( time $B synth --preset flash-layer --format $FMT --layers $NL --out $F ) > "$OUT/synth.txt" 2>&1
  fi
  du -sb "$F" >> "$OUT/synth.txt"; tail -4 "$OUT/synth.txt"
  cat $F/*.safetensors > /dev/null   # warm the page cache
  for i in 1 2 3; do
    ( NVFP4_PROBE_PROFILE=1 /usr/bin/time -v timeout ${RUN_TIMEOUT:-120} $B run --model $F --layers $L --seq-len 128 --backend cuda --quiet --json $OUT/flash_warm$i.json ) > "$OUT/flash_warm$i.txt" 2>&1
    grep -E "ops,|profile|gpu counters|^loader|Elapsed|Maximum resident|rror" "$OUT/flash_warm$i.txt" | cut -c1-400
  done
  # device time per kernel, cuBLAS call and copy (CUDA events around each; the run itself is slower)
  ( NVFP4_PROBE_KERNEL_TIME=1 NVFP4_PROBE_PROFILE=1 timeout ${RUN_TIMEOUT:-120} $B run --model $F --layers $L --seq-len 128 --backend cuda --quiet ) > "$OUT/flash_ktime.txt" 2>&1
  grep -E "ops,|device time" "$OUT/flash_ktime.txt" | cut -c1-1500
  if [ -n "${PREV_B:-}" ]; then
    # the previous binary on the same job: every op's numbers must agree (run_diff)
    ( timeout ${RUN_TIMEOUT:-120} $PREV_B run --model $F --layers $L --seq-len 128 --backend cuda --quiet --json $OUT/flash_prev.json ) > "$OUT/flash_prev.txt" 2>&1
    grep -E "ops," "$OUT/flash_prev.txt"
    python3 probes/device/run_diff.py $OUT/flash_prev.json $OUT/flash_warm1.json > "$OUT/flash_prev_vs_new.txt" 2>&1
    echo "run_diff prev rc=$?" >> "$OUT/flash_prev_vs_new.txt"; cut -c1-300 "$OUT/flash_prev_vs_new.txt"
  fi
  if has experts; then
    ( NVFP4_PROBE_EXPERTS=loop NVFP4_PROBE_PROFILE=1 /usr/bin/time -v timeout ${RUN_TIMEOUT:-120} $B run --model $F --layers $L --seq-len 128 --backend cuda --quiet --json $OUT/flash_loop.json ) > "$OUT/flash_loop.txt" 2>&1
    grep -E "ops,|routed|Elapsed" "$OUT/flash_loop.txt" | cut -c1-300
    python3 probes/device/run_diff.py $OUT/flash_loop.json $OUT/flash_warm1.json > "$OUT/flash_loop_vs_grouped.txt" 2>&1
    echo "run_diff rc=$?" >> "$OUT/flash_loop_vs_grouped.txt"; cat "$OUT/flash_loop_vs_grouped.txt" | cut -c1-300
  fi
  sync; evict $F
  ( NVFP4_PROBE_PROFILE=1 /usr/bin/time -v timeout ${RUN_TIMEOUT:-120} $B run --model $F --layers $L --seq-len 128 --backend cuda --quiet --json $OUT/flash_cold.json ) > "$OUT/flash_cold.txt" 2>&1
  grep -E "ops,|profile|gpu counters|^loader|Elapsed|Maximum resident|rror" "$OUT/flash_cold.txt" | cut -c1-400
  sync; evict $F
  ( time dd if=$F/$(ls $F | grep safetensors | head -1) of=/dev/null bs=16M ) > "$OUT/disk_read.txt" 2>&1; tail -4 "$OUT/disk_read.txt"
  # the disk's read bandwidth over the whole checkpoint (the cold floor's denominator)
  sync; evict $F
  ( echo "whole checkpoint, cold, sequential:"; du -sb $F; time cat $F/*.safetensors > /dev/null ) >> "$OUT/disk_read.txt" 2>&1; tail -5 "$OUT/disk_read.txt"
  if [ -z "${SKIP_CPU_CMP:-}" ]; then
    ( timeout ${CPU_CMP_TIMEOUT:-200} $B selftest --backend cuda --model $F --layers ${CPU_CMP_LAYERS:-0..1} --seq-len ${CPU_CMP_T:-8} --served blackwell-w4a4 --json $OUT/flash_cpu_vs_cuda.json ) > "$OUT/flash_cpu_vs_cuda.txt" 2>&1
    echo "cpu-vs-cuda rc=$?" >> "$OUT/flash_cpu_vs_cuda.txt"
    grep -E "^whole|^selftest|rc=" "$OUT/flash_cpu_vs_cuda.txt"
  fi
fi
if has bisect; then
  # the CPU and CUDA backends name the same verdicts on planted faults of the tiny model
  if [ -z "${SKIP_BCMP:-}" ]; then
    ( time OUT=/tmp/bcmp timeout ${BCMP_TIMEOUT:-200} bash probes/device/bisect_cmp.sh $B ) > "$OUT/bisect_cmp.txt" 2>&1
    echo "bisect_cmp rc=$?" >> "$OUT/bisect_cmp.txt"; tail -25 "$OUT/bisect_cmp.txt" | cut -c1-300
  fi
  # one planted loader fault in layer 3 of the Flash checkpoint, against one run (warm cache)
  cat $F/*.safetensors > /dev/null
  ( /usr/bin/time -v timeout 120 $B run --model $F --layers $L --seq-len 128 --backend cuda --quiet ) > "$OUT/flash_run_ref.txt" 2>&1
  grep -E "ops,|Elapsed" "$OUT/flash_run_ref.txt"
  for how in auto linear; do
    ( NVFP4_PROBE_PROFILE=1 /usr/bin/time -v timeout ${BISECT_TIMEOUT:-150} $B bisect --model $F --layers $L --seq-len 128 --backend cuda --search $how --loader-fault ${BISECT_FAULT:-inverted-input-scale@L3.ffn.experts} --json $OUT/flash_bisect_$how.json ) > "$OUT/flash_bisect_$how.txt" 2>&1
    echo "bisect $how rc=$?" >> "$OUT/flash_bisect_$how.txt"
    grep -E "Elapsed|rc=|verdict|L3|rror" "$OUT/flash_bisect_$how.txt" | head -8 | cut -c1-300
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps(d.get('search',{}).get('phases',d.get('search')))[:600])" $OUT/flash_bisect_$how.json 2>&1 | head -3
  done
fi

cd "$OUT" && tar czf results.tgz --remove-files $(ls | grep -v -E '^(results.tgz|selftest.txt|selftest.json|rcp_table.bin.gz|.*\.txt)$') 2>/dev/null
ls -la "$OUT"
