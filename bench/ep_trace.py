#!/usr/bin/env python3
"""Summarizes MOERAIL_EP_TRACE files (docs/dispatch.md, "Developer trace"): per rank and role, the medians and
maxima of each warp's phases in microseconds, for one traced op of the given kind (the last by default).

    python3 bench/ep_trace.py PREFIX [--op dispatch] [--nth N]      (reads PREFIX.rank*.jsonl)
"""
import argparse
import glob
import json
import statistics

SLOTS = ["entry", "entered", "first", "role_end", "end", "items", "wait", "fence", "meta", "data"]


def summarize(rec):
    b, w, k = rec["blocks"], rec["warps"], rec["slots"]
    st = rec["stamps"]
    warps = [dict(zip(SLOTS, st[i * k:(i + 1) * k])) for i in range(b * w)]
    t0 = min(x["entry"] for x in warps if x["entry"])
    roles = {"producer": [], "consumer": []}
    for i, x in enumerate(warps):
        if not x["entry"]:
            continue
        roles["producer" if i % w < w // 2 else "consumer"].append(x)
    plan = st[b * w * k:b * w * k + 8]
    out = [f"rank {rec['rank']} op {rec['op']} blocks {b}: kernel span "
           f"{(max(x['end'] for x in warps if x['end']) - t0) / 1e3:.1f} us"]
    if plan[0]:
        out.append(f"  plan: exchange {(plan[1] - plan[0]) / 1e3:.1f} us, total {(plan[2] - plan[0]) / 1e3:.1f} us, "
                   f"data kernel entry {(t0 - plan[2]) / 1e3:.1f} us after")
    for role, xs in roles.items():
        if not xs:
            continue
        def col(f):
            v = [f(x) for x in xs]
            return f"{statistics.median(v):8.1f} {max(v):8.1f}"
        out.append(f"  {role:9s} (median max, us) entered {col(lambda x: (x['entered'] - x['entry']) / 1e3)} "
                   f"first {col(lambda x: ((x['first'] or x['entered']) - t0) / 1e3)} "
                   f"role_end {col(lambda x: (x['role_end'] - t0) / 1e3)} end {col(lambda x: (x['end'] - t0) / 1e3)}")
        out.append(f"  {'':9s} items {col(lambda x: x['items'])} wait {col(lambda x: x['wait'] / 1e3)} "
                   f"fence {col(lambda x: x['fence'] / 1e3)} meta {col(lambda x: x['meta'] / 1e3)} "
                   f"data {col(lambda x: x['data'] / 1e3)}")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefix")
    ap.add_argument("--op", default="dispatch")
    ap.add_argument("--nth", type=int, default=-1, help="which record of the op (0 = first; default the last)")
    a = ap.parse_args()
    for path in sorted(glob.glob(a.prefix + ".rank*.jsonl")):
        with open(path) as f:
            recs = [r for r in map(json.loads, f) if r["op"] == a.op]
        if recs:
            print(summarize(recs[a.nth]))


if __name__ == "__main__":
    main()
