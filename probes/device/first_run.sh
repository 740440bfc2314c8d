#!/bin/bash
# First run on a fresh GPU machine against warm runs (the README's main command on the built-in model, CUDA).
# Run it as the FIRST command on a newly started machine: run 1 then pays library loading from a cold disk and
# whatever the kernels' code costs (shipped CUBIN: nothing to compile; NVFP4_PROBE_NVRTC=1: NVRTC + driver JIT).
# Auto backend, so each run prints its 'backend:' line (where the kernels came from, and in how long).
# Usage (GPU machine, repository root, release binary present):  OUT=/tmp/out bash probes/device/first_run.sh
set -u
B=${B:-target/release/nvfp4-probe}
OUT=${OUT:-/tmp/nvfp4-probe-out}
mkdir -p "$OUT"
n=0
t() { local s e rc; n=$((n+1)); s=$(date +%s%N); NVFP4_PROBE_PROFILE=1 "$@" > "$OUT/run$n.txt" 2>&1; rc=$?; e=$(date +%s%N)
      printf 'run %d: %d ms rc=%d %s\n' $n $(( (e - s) / 1000000 )) $rc "$(grep -m1 '^backend' "$OUT/run$n.txt" | cut -c1-160)"; }
echo "== shipped CUBIN: first run on this machine, then warm runs"
for i in 1 2 3 4 5 6; do t $B run --layers 0..4 --quiet; done
echo "== NVRTC path (NVFP4_PROBE_NVRTC=1), empty PTX cache, driver JIT cache disabled: compile + JIT every time"
c=$(mktemp -d)
for i in 1 2; do t env XDG_CACHE_HOME=$c CUDA_CACHE_DISABLE=1 NVFP4_PROBE_NVRTC=1 $B run --layers 0..4 --quiet; rm -rf "$c"/*; done
echo "== NVRTC path with its PTX cache warm (driver JIT cache on)"
for i in 1 2 3; do t env XDG_CACHE_HOME=$c NVFP4_PROBE_NVRTC=1 $B run --layers 0..4 --quiet; done
