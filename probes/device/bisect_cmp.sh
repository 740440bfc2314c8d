#!/usr/bin/env bash
# bisect --backend cpu vs --backend cuda on planted faults of the tiny model: the same verdict
# (op, parameter family and tensor, hypothesis kind, unit) on both, and the wall time of each.
#
#   bash probes/device/bisect_cmp.sh [BINARY]          # BINARY defaults to target/release/nvfp4-probe
#   OUT=/tmp/out bash probes/device/bisect_cmp.sh      # logs, JSON and the summary under $OUT
#
# Cases: loader faults on the built-in tiny model (no files: ModelOpt NVFP4 routed experts, FP8
# attention) and on tiny `synth` checkpoints (20 MB each, written under the work dir) in both NVFP4
# formats (ct-nvfp4, modelopt-nvfp4: attention q_a/kv NVFP4 too), plus checkpoint faults planted by
# synth. Kinds cover the scalar hypotheses (input/weight scale, alpha, calibrated amax), layout
# repairs (nibble swap, unswizzle, unshift rows), re-read stored block scales (NaN bytes) and the
# fused-pair own-shard case. Prints per case both verdicts and MISMATCH when they differ (also
# when one side finds an anomaly or a divergence the other does not); exit 1 on any mismatch,
# 2 when a command fails. About 1 minute on a 16-core H200 machine.
set -u
BIN=${1:-target/release/nvfp4-probe}
[ -x "$BIN" ] || { echo "no binary at $BIN (cargo build --release)"; exit 2; }
command -v python3 >/dev/null || { echo "python3 is needed to read the JSON reports"; exit 2; }
W=${OUT:-$(mktemp -d /tmp/bisect_cmp.XXXXXX)}
mkdir -p "$W/logs" "$W/ckpt"
SEQ=32
# the two backends compared (B2=cpu checks the script itself on a machine without a GPU)
B1=${B1:-cpu}
B2=${B2:-cuda}

synth() { # NAME FORMAT [--fault K@T ...]
    local name=$1 fmt=$2; shift 2
    [ -f "$W/ckpt/$name/config.json" ] && return 0
    "$BIN" synth --preset tiny --format "$fmt" --seed 3 "$@" --out "$W/ckpt/$name" \
        >"$W/logs/synth-$name.log" 2>&1 || { echo "synth $name failed (see $W/logs/synth-$name.log)"; exit 2; }
}

synth ct ct-nvfp4
synth mo modelopt-nvfp4
synth ct-zero ct-nvfp4 --fault zero-input-scale@L2.ffn.experts
synth mo-w13 modelopt-nvfp4 --fault w13-scale-mismatch@L1.ffn.experts
synth ct-nan ct-nvfp4 --fault nan-block-scale@L1.attn.q_a

# name | model (builtin = none) | layers | extra args
CASES=(
  "builtin-inv-input|builtin|0..3|--loader-fault inverted-input-scale@L1.ffn.experts"
  "builtin-missing-alpha|builtin|0..3|--loader-fault missing-alpha@L3.ffn.experts"
  "builtin-nibble-swap|builtin|0..2|--loader-fault nibble-swap@L2.ffn.experts"
  "builtin-swizzled|builtin|0..1|--loader-fault swizzled-scales@L1.ffn.experts"
  "builtin-nan-block|builtin|0..1|--loader-fault nan-block-scale@L1.ffn.experts"
  "ct-shifted-qa|ct|0..1|--loader-fault shifted-scale-rows@L1.attn.q_a"
  "ct-input-amax-qa|ct|0..3|--loader-fault input-amax-x64@L3.attn.q_a"
  "mo-inv-weight-qa|mo|0..1|--loader-fault inverted-weight-scale@L1.attn.q_a"
  "mo-double-scale|mo|0..3|--loader-fault double-scale@L3.ffn.experts"
  "ct-ckpt-zero-input|ct-zero|0..2|"
  "mo-ckpt-w13-mismatch|mo-w13|0..1|"
  "ct-nan-block-qa|ct|0..1|--loader-fault nan-block-scale@L1.attn.q_a"
  "ct-ckpt-nan-block-qa|ct-nan|0..1|"
)

summary() { # JSON -> one line: op | kind | family | tensor | unit   (or the anomaly / nothing)
    python3 - "$1" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"(no report: {e})"); sys.exit(0)
d = r.get("divergence")
an = r.get("anomalies") or []
parts = []
if d:
    v = d.get("verdict")
    if v:
        p = v["param"]
        parts.append(f"{v['op']} | {v['kind']} | {p['family']} | {(p.get('tensors') or ['-'])[0]} | {v['unit']}")
    else:
        parts.append(f"{d['op']} | no hypothesis explains it")
if an:
    parts.append("anomaly " + an[0]["op"])
print(" ; ".join(parts) if parts else "nothing diverges")
PY
}

detail() { # JSON -> before rel-L2, hypotheses tried, the ranked kinds (a finer check than the verdict)
    python3 - "$1" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1])).get("divergence") or {}
except Exception:
    d = {}
b = (d.get("before") or {}).get("rel_l2")
print(f"{b!r} {d.get('hypotheses_tried')} " + ",".join(x["hypothesis"]["kind"] for x in d.get("ranked", [])))
PY
}

fail=0
printf '%-24s %-7s %8s  %s\n' case backend wall verdict | tee "$W/summary.txt"
for c in "${CASES[@]}"; do
    IFS='|' read -r name model layers extra <<<"$c"
    margs=()
    [ "$model" != builtin ] && margs=(--model "$W/ckpt/$model")
    V=() T=() D=()
    for i in 0 1; do
        be=$B1; [ $i -eq 1 ] && be=$B2
        j="$W/logs/$name-$i-$be.json"
        rm -f "$j"
        t0=$(date +%s.%N)
        # shellcheck disable=SC2086
        "$BIN" bisect "${margs[@]}" --layers "$layers" --seq-len $SEQ --backend $be --json "$j" $extra \
            >"$W/logs/$name-$i-$be.log" 2>&1
        rc=$?
        t1=$(date +%s.%N)
        T[$i]=$(python3 -c "print(f'{$t1-$t0:.2f}s')")
        if [ $rc -gt 1 ]; then
            V[$i]="(exit $rc: see $W/logs/$name-$i-$be.log)"
            fail=2
        else
            V[$i]=$(summary "$j")
        fi
        D[$i]=$(detail "$j")
        printf '%-24s %-7s %8s  %s\n' "$name" "$be" "${T[$i]}" "${V[$i]}" | tee -a "$W/summary.txt"
    done
    if [ "${V[0]}" != "${V[1]}" ]; then
        echo "MISMATCH $name" | tee -a "$W/summary.txt"
        [ $fail -eq 0 ] && fail=1
    elif [ "${D[0]}" != "${D[1]}" ]; then
        # same verdict; the replay's metric or hypothesis list differs (expected bit-equal)
        echo "note $name: details differ: $B1 ${D[0]} / $B2 ${D[1]}" | tee -a "$W/summary.txt"
    fi
done
echo "logs and reports: $W" | tee -a "$W/summary.txt"
[ $fail -eq 0 ] && echo "all verdicts agree" | tee -a "$W/summary.txt"
exit $fail
