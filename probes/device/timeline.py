#!/usr/bin/env python3
"""Summarize a run's timeline (NVFP4_PROBE_TIMELINE=FILE): the ops that took longer than a threshold,
with how long the runner waited there for the loader's batches, when the loader copied that op's
weights, and the loader's waits for routing.

Usage: python3 probes/device/timeline.py timeline.jsonl [min_ms]
"""
import json
import sys

ev = [json.loads(line) for line in open(sys.argv[1])]
min_s = (float(sys.argv[2]) if len(sys.argv) > 2 else 12.0) / 1e3
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
