#!/usr/bin/env python3
"""Merge benchmark rows into bench/results/<gpu>-x<count>.json (the format of docs/design.md, "Testing and measuring").

    bench/record.py [--results DIR] [--torch FILE.jsonl] ROWS.json [ROWS.json ...]

ROWS.json: what `moerail bench ... --json` wrote. FILE.jsonl: what bench/torch_baseline.py printed in the same
device run; a row without a baseline gets the torch row of the same bench, case and direction (a row of a
precision recipe, case <case>-<recipe>[-<option>...], the torch row of <case>: the plain bf16 layer). Newer rows replace
older rows of the same bench, case and direction (of repeats in one call, the last file's); the file stays sorted.
"""
import argparse
import json
import pathlib
import re

BASELINE_NAMES = {
    "permute": "torch stable argsort + index_select",
    "combine": "torch index_select + index_add_ (fp32)",
    "router": "torch sigmoid/softmax + topk",
}


def short_gpu(name):
    lower = name.lower()
    for known in ("h200", "h100", "h800", "h20", "b200", "gb200", "a100"):
        if known in lower:
            return known
    return re.sub(r"[^a-z0-9]", "-", lower)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(pathlib.Path(__file__).parent / "results"))
    ap.add_argument("--torch", help="torch baseline rows (JSON lines) of the same run")
    ap.add_argument("rows", nargs="+")
    a = ap.parse_args()

    torch_rows = {}
    if a.torch:
        for line in pathlib.Path(a.torch).read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                torch_rows[(r["bench"], r["case"], r["direction"])] = r

    new = []
    for path in a.rows:
        for r in json.loads(pathlib.Path(path).read_text()):
            key = (r["bench"], r["case"], r["direction"])
            recipe = r.get("config", {}).get("recipe", "bf16")
            at = r["case"].find("-" + recipe)  # <case>-<recipe>[-<option>...]: the plain bf16 layer of <case>
            if recipe != "bf16" and at > 0:
                key = (r["bench"], r["case"][:at], r["direction"])
            if r.get("baseline") is None and key in torch_rows:
                t = torch_rows[key]
                name = t.get("baseline_name") or BASELINE_NAMES.get(r["bench"], "torch")
                r["baseline"] = {"name": name, "time_us": t["time_us"],
                                 "value": t["value"]}
            new.append(r)
    by_file = {}
    for r in new:
        by_file.setdefault(f"{short_gpu(r['gpu'])}-x{r['gpus']}.json", []).append(r)
    out_dir = pathlib.Path(a.results)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in by_file.items():
        target = out_dir / name
        old = json.loads(target.read_text()) if target.exists() else []
        latest = {(r["bench"], r["case"], r["direction"]): r for r in rows}  # of repeats, the last given
        merged = [r for r in old if (r["bench"], r["case"], r["direction"]) not in latest] + list(latest.values())
        merged.sort(key=lambda r: (r["bench"], r["case"], r["direction"]))
        target.write_text(json.dumps(merged, indent=2) + "\n")
        print(f"{target}: {len(latest)} rows recorded, {len(merged)} in all")


if __name__ == "__main__":
    main()
