#!/usr/bin/env python3
"""Compare two `nvfp4-probe run --json` reports op by op (same checkpoint, layers and tokens).

Counts, amaxes and every other integer or string must be equal; other floats (means, cosines,
norms: f64 sums whose atomic order varies from run to run on the GPU) within 1e-9 relative.
Timing fields are ignored. Prints the count of ops and differing fields, the largest |delta| of
the cosines, and the first differences. Exit 0 when all equal, 1 otherwise.
Usage: run_diff.py A.json B.json
"""
import json, sys

IGNORE = {"seconds", "wall_seconds", "timing", "elapsed"}


def flat(v, path, out):
    if isinstance(v, dict):
        for k, x in v.items():
            if k not in IGNORE:
                flat(x, f"{path}.{k}" if path else k, out)
    elif isinstance(v, list):
        for i, x in enumerate(v):
            flat(x, f"{path}[{i}]", out)
    else:
        out[path] = v


a, b = (json.load(open(p)) for p in sys.argv[1:3])
oa, ob = a["ops"], b["ops"]
diffs, worst_cos = [], 0.0
for x, y in zip(oa, ob):
    fx, fy = {}, {}
    flat(x, "", fx)
    flat(y, "", fy)
    for k in sorted(set(fx) | set(fy)):
        u, v = fx.get(k), fy.get(k)
        if u == v or (u != u and v != v):  # NaN == NaN
            continue
        exact = k.endswith(".amax") or not (isinstance(u, float) and isinstance(v, float))
        if not exact and abs(u - v) <= 1e-9 * max(abs(u), abs(v)) + 1e-12:
            continue
        if True:
            diffs.append((x.get("id"), k, u, v))
            if k.endswith(".cos") and isinstance(u, float) and isinstance(v, float):
                worst_cos = max(worst_cos, abs(u - v))
print(f"ops {len(oa)} vs {len(ob)}; differing fields {len(diffs)}; worst |delta cos| {worst_cos:.3e}")
for d in diffs[:15]:
    print("  ", *d)
sys.exit(0 if not diffs and len(oa) == len(ob) else 1)
