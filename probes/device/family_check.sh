#!/bin/bash
# The model families on both backends (issue 23): for each family a tiny `synth --family` model in a
# real release format, `run` on the CPU and on CUDA, reports compared field by field (run_diff.py);
# then CUDA again in token chunks of CHUNK (default 7) against the CPU's whole run, and (V3=1) the
# DeepSeek-V3 release-dimension layers at 2,048 tokens whole and in chunks of 512 on CUDA.
# Usage (GPU machine, repository root): OUT=/tmp/fam B=target/release/nvfp4-probe bash probes/device/family_check.sh
set -u
OUT=${OUT:-/tmp/fam}; B=${B:-target/release/nvfp4-probe}; CHUNK=${CHUNK:-7}; V3=${V3:-0}
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
  timeout 300 $B run --model $d --layers 0..$last --seq-len 64 --backend cuda --quiet --chunk $CHUNK --json $OUT/$fam-$fmt-chunk.json > $OUT/$fam-$fmt-chunk.txt 2>&1
  python3 probes/device/run_diff.py $OUT/$fam-$fmt-cpu.json $OUT/$fam-$fmt-chunk.json > $OUT/$fam-$fmt-chunkdiff.txt 2>&1 || fail=1
  echo "$fam $fmt cpu whole vs cuda --chunk $CHUNK: $(head -3 $OUT/$fam-$fmt-chunkdiff.txt | tr '\n' ' ')"
done
if [ "$V3" = 1 ]; then
  D=$OUT/v3-release
  [ -f $D/config.json ] || $B synth --family deepseek-v3 --preset release --format modelopt-nvfp4 --out $D > $OUT/synth-v3.txt 2>&1
  cat $D/*.safetensors > /dev/null
  for c in whole 512; do
    opt=""; [ $c != whole ] && opt="--chunk $c"
    /usr/bin/time -f "%e" -o $OUT/t.txt timeout 300 $B run --model $D --layers 0..1 --seq-len 2048 --backend cuda --quiet $opt --json $OUT/v3-$c.json > $OUT/v3-$c.txt 2>&1
    echo "v3 release 2048 tokens $c rc=$? $(cat $OUT/t.txt) s: $(grep -E 'ops, ' $OUT/v3-$c.txt | tail -1)"
  done
  python3 probes/device/run_diff.py $OUT/v3-whole.json $OUT/v3-512.json > $OUT/v3-diff.txt 2>&1 || fail=1
  echo "v3 release whole vs --chunk 512: $(head -3 $OUT/v3-diff.txt | tr '\n' ' ')"
fi
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
# llm-compressor's gpt-oss in compressed-tensors NVFP4 (tests/data: its LinearExperts layout, gate and up
# apart, the GLU kernel's stride-1 form): CPU vs CUDA, and a loader fault's attribution on CUDA
C=tests/data/hf-families/gpt_oss/ct-nvfp4
for be in cpu cuda; do
  timeout 300 $B run --model $C --backend $be --quiet --json $OUT/oss-ct-$be.json > $OUT/oss-ct-$be.txt 2>&1
  echo "gpt-oss ct-nvfp4 (linear experts) $be rc=$?"
done
python3 probes/device/run_diff.py $OUT/oss-ct-cpu.json $OUT/oss-ct-cuda.json > $OUT/oss-ct-diff.txt 2>&1 || fail=1
echo "gpt-oss ct-nvfp4 cpu vs cuda: $(head -3 $OUT/oss-ct-diff.txt | tr '\n' ' ')"
timeout 300 $B bisect --model $C --backend cuda --loader-fault nibble-swap@L1.ffn.experts > $OUT/oss-ct-bisect.txt 2>&1
echo "bisect nibble-swap@L1.ffn.experts cuda: $(grep -m1 '^1\.' $OUT/oss-ct-bisect.txt | cut -c1-120)"
# gpt-oss's fused-expert loader faults read on the host (w13 rows re-ordered, MXFP4 _scales unread):
# CPU and CUDA reports field by field, and bisect's verdict on CUDA (each profile for the MXFP4 recipe)
for case in mxfp4:gate-up-deinterleaved mxfp4:missing-block-scales modelopt-nvfp4:gate-up-interleaved-twice modelopt-nvfp4:gate-up-deinterleaved; do
  fmt=${case%%:*}; k=${case##*:}; d=$OUT/ckpt-gpt-oss-$fmt
  for sv in blackwell-w4a4 hopper-w4a16; do
    for be in cpu cuda; do
      timeout 300 $B run --model $d --layers 0..3 --seq-len 64 --backend $be --served $sv --quiet --loader-fault $k@L1.ffn.experts --json $OUT/f-$fmt-$k-$sv-$be.json > $OUT/f-$fmt-$k-$sv-$be.txt 2>&1
      echo "gpt-oss $fmt $k $sv $be rc=$?"
    done
    python3 probes/device/run_diff.py $OUT/f-$fmt-$k-$sv-cpu.json $OUT/f-$fmt-$k-$sv-cuda.json > $OUT/f-$fmt-$k-$sv-diff.txt 2>&1 || fail=1
    echo "gpt-oss $fmt $k $sv cpu vs cuda: $(head -3 $OUT/f-$fmt-$k-$sv-diff.txt | tr '\n' ' ')"
    rm -f $OUT/f-$fmt-$k-$sv-*.json
  done
  timeout 300 $B bisect --model $d --backend cuda --layers 0..1 --loader-fault $k@L1.ffn.experts > $OUT/f-bisect.txt 2>&1
  echo "bisect $fmt $k cuda rc=$?: $(grep -m1 -E 'gate-up|stored-' $OUT/f-bisect.txt | cut -c1-140)"
done
# the engine's SwiGLU without its clamp (a tight swiglu_limit so that it bites on the tiny models)
# and DeepSeek-V3's FP8 faults: CPU vs CUDA reports, bisect's verdict on CUDA
for case in gpt-oss:mxfp4:1.5:L1.ffn.experts v4:ct-nvfp4:1.0:L2.ffn.shared; do
  IFS=: read fam fmt lim op <<< "$case"; d=$OUT/ckpt-clamp-$fam-$fmt
  if [ $fam = v4 ]; then $B synth --format $fmt --out $d > /dev/null 2>&1; else $B synth --family $fam --format $fmt --out $d > /dev/null 2>&1; fi
  python3 -c "import json;p='$d/config.json';c=json.load(open(p));c['swiglu_limit']=$lim;json.dump(c,open(p,'w'))"
  for be in cpu cuda; do
    timeout 300 $B run --model $d --layers 0..2 --seq-len 64 --backend $be --quiet --loader-fault swiglu-unclamped@$op --json $OUT/c-$be.json > $OUT/c-$fam-$be.txt 2>&1
    echo "$fam $fmt swiglu-unclamped@$op $be rc=$?"
  done
  python3 probes/device/run_diff.py $OUT/c-cpu.json $OUT/c-cuda.json > $OUT/c-$fam-diff.txt 2>&1 || fail=1
  echo "$fam $fmt swiglu-unclamped cpu vs cuda: $(head -3 $OUT/c-$fam-diff.txt | tr '\n' ' ')"
  timeout 300 $B bisect --model $d --backend cuda --layers 0..2 --loader-fault swiglu-unclamped@$op > $OUT/c-bisect.txt 2>&1
  echo "bisect $fam swiglu-unclamped cuda rc=$?: $(grep -m1 -E 'swiglu-clamp' $OUT/c-bisect.txt | cut -c1-140)"
done
d=$OUT/ckpt-deepseek-v3-fp8-block
for f in double-scale@L1.attn.kv_b non-pow2-ue8m0@L2.ffn.experts; do
  for be in cpu cuda; do
    timeout 300 $B run --model $d --layers 0..2 --seq-len 64 --backend $be --quiet --loader-fault $f --json $OUT/p-$be.json > /dev/null 2>&1
  done
  python3 probes/device/run_diff.py $OUT/p-cpu.json $OUT/p-cuda.json > $OUT/p-diff.txt 2>&1 || fail=1
  echo "deepseek-v3 fp8-block $f cpu vs cuda: $(head -3 $OUT/p-diff.txt | tr '\n' ' ')"
  timeout 300 $B bisect --model $d --backend cuda --layers 0..2 --loader-fault $f > $OUT/p-bisect.txt 2>&1
  echo "bisect $f cuda rc=$?: $(grep -m1 -E 'fp8-' $OUT/p-bisect.txt | cut -c1-140)"
done
echo "family check: $([ $fail = 0 ] && echo all equal || echo DIFFERENCES, see $OUT)"
exit $fail
