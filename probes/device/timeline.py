#!/usr/bin/env python3
"""Summarize a run's timeline (NVFP4_PROBE_TIMELINE=FILE): the ops that took longer than a threshold,
with how long the runner waited there for the loader's batches, when the loader copied that op's
weights, and the loader's waits for routing.

With a second timeline from a run under NVFP4_PROBE_KERNEL_TIME=1 (its "device" records: device
seconds per op step), also where the runner's time goes beyond the device's work: per op kind and
the ops with the largest gaps (op wall in the first run minus device time in the second).

Usage: python3 probes/device/timeline.py timeline.jsonl [min_ms] [kernel_time_timeline.jsonl [report.json]]
(the report, when given, names each op step)
"""
import json
import sys

ev = [json.loads(line) for line in open(sys.argv[1])]
min_s = (float(sys.argv[2]) if len(sys.argv) > 2 else 12.0) / 1e3
kt = [json.loads(line) for line in open(sys.argv[3])] if len(sys.argv) > 3 else []
ops = [e for e in ev if e["what"] == "op"]
if not ops:
    sys.exit("no op intervals in the timeline")
t0 = ops[0]["t0"]
loads = [e for e in ev if e["what"] == "load"]
staged = [e for e in ev if e["what"] == "staged wait"]
routing = [e for e in ev if e["what"] == "routing wait"]
print(f"runner {ops[-1]['t1'] - t0:.3f} s, {len(ops)} ops; loader batches {len(loads)}")
for o in ops:
    if o["t1"] - o["t0"] < min_s:
        continue
    inside = lambda xs: sum(x["t1"] - x["t0"] for x in xs if o["t0"] <= x["t0"] < o["t1"])
    mine = [x for x in loads if x["n"] == o["n"]]
    when = f"; its batches {len(mine)} at {mine[0]['t0'] - t0:.3f}-{mine[-1]['t1'] - t0:.3f}" if mine else ""
    print(f"step {o['n']:4d} {o['t0'] - t0:.3f}-{o['t1'] - t0:.3f} s ({(o['t1'] - o['t0']) * 1e3:.0f} ms), "
          f"waited for the loader {inside(staged) * 1e3:.0f} ms{when}")
if loads:
    busy = sum(x["t1"] - x["t0"] for x in loads)
    print(f"loader: first batch {loads[0]['t0'] - t0:.3f} s, last done {loads[-1]['t1'] - t0:.3f} s, copying {busy:.3f} s")
for r in routing:
    print(f"loader waited for the routing of step {r['n']}: {r['t0'] - t0:.3f}-{r['t1'] - t0:.3f} s")
dev = {e["n"]: e["t1"] for e in kt if e["what"] == "device"}
names = {o["step"]: o["id"] for o in json.load(open(sys.argv[4]))["ops"]} if len(sys.argv) > 4 else {}
if dev:
    gaps = sorted(((o["t1"] - o["t0"]) - dev.get(o["n"], 0.0), o["n"], o["t1"] - o["t0"]) for o in ops)
    tot_w = sum(o["t1"] - o["t0"] for o in ops)
    tot_d = sum(dev.get(o["n"], 0.0) for o in ops)
    print(f"ops' wall {tot_w:.3f} s, their device time {tot_d:.3f} s, gap {tot_w - tot_d:.3f} s")
    print("largest gaps (op wall - device time):")
    for g, n, w in reversed(gaps[-25:]):
        print(f"  step {n:4d}: wall {w * 1e3:6.1f} ms, device {dev.get(n, 0.0) * 1e3:6.1f} ms, gap {g * 1e3:6.1f} ms  {names.get(n, '')}")
        o = next(o for o in ops if o["n"] == n)
        sp = {}
        for e in ev:
            if e["what"] not in ("op", "load", "device") and o["t0"] <= e["t0"] < o["t1"]:
                sp.setdefault(e["what"], [0, 0.0])
                sp[e["what"]][0] += 1
                sp[e["what"]][1] += e["t1"] - e["t0"]
        top = sorted(sp.items(), key=lambda kv: -kv[1][1])[:8]
        print("      host spans (ms, count; nested spans overlap): " + ", ".join(f"{k} {v[1] * 1e3:.1f} ({v[0]})" for k, v in top))
# the loader's idle gaps between batches (over 5 ms) and what it did inside them
loads_sorted = sorted(loads, key=lambda e: e["t0"])
mine = ("loader reserve", "loader alloc", "loader free", "routing wait", "loader claim lock", "loader publish")
for a, b in zip(loads_sorted, loads_sorted[1:]):
    if b["t0"] - a["t1"] < 5e-3:
        continue
    inside = [e for e in ev if e["what"] in mine and a["t1"] - 1e-4 <= e["t0"] < b["t0"]]
    at = next((o["n"] for o in ops if o["t0"] <= b["t0"] < o["t1"]), None)
    desc = ", ".join(f"{e['what']} {(e['t1'] - e['t0']) * 1e3:.1f} ms" for e in inside if e["t1"] - e["t0"] > 5e-4)
    print(f"loader idle {(b['t0'] - a['t1']) * 1e3:.1f} ms before its batch for step {b['n']} "
          f"(runner at step {at}): {desc or 'nothing timed'}")
