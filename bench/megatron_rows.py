#!/usr/bin/env python3
"""Rows of bench `megatron-layer` (bench/results format) from one device run, for bench/record.py:

    bench/megatron_rows.py MEGATRON.jsonl LAYER.json COMMIT > rows.json

MEGATRON.jsonl: the lines bench/megatron_layer.py printed (one per GPU count and variant); LAYER.json: what
`moerail bench layer --json` wrote for the same GPU count in the same run (moerail's own layer step, the overhead's
reference); COMMIT: the commit both were built from. Each line becomes one row: time_us = the Megatron layer step
with moerail, value = the speedup over the alltoall path (its baseline)."""
import datetime
import json
import pathlib
import sys


def case_of(m):
    case = f"ep{m['experts']}-t{m['tokens']}"
    if m.get("capacity_factor"):
        case += f"-cap{m['capacity_factor']:g}"
    if not m.get("exact_rows", True):
        case += "-static"
    return case


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    lines = [json.loads(l) for l in pathlib.Path(sys.argv[1]).read_text().splitlines() if l.strip()]
    layer = json.loads(pathlib.Path(sys.argv[2]).read_text())[0]
    commit = sys.argv[3]
    rows = []
    for m in lines:
        if m["gpus"] != layer["gpus"]:
            continue
        own = layer["time_us"]
        rows.append({
            "bench": "megatron-layer", "case": case_of(m), "direction": "step", "gpu": m["device"], "gpus": m["gpus"],
            "commit": commit, "date": datetime.date.today().isoformat(), "time_us": m["moerail_us"],
            "metric": "speedup", "value": m["speedup"], "ceiling": None, "floor_us": None,
            "baseline": {"name": "Megatron-core 0.19.2 MoELayer, alltoall dispatcher + SequentialMLP (no "
                                 "TransformerEngine)", "time_us": m["alltoall_us"], "value": None},
            "verified": (f"before timing: the moerail layer's output and input gradient against the alltoall layer's "
                         f"(same weights and routing): rel. err {m['out_rel_err']:.4f} / {m['dx_rel_err']:.4f}"
                         + ("" if m["verified"] else " (ABOVE 2e-2: not verified)")),
            "config": {"experts": m["experts"], "tokens": m["tokens"], "hidden": 7168, "ffn_hidden": 2048, "topk": 8,
                       "align": m.get("align"), "capacity_factor": m.get("capacity_factor"),
                       "exact_rows": m.get("exact_rows", True),
                       "router": "sigmoid, 8 groups keep 4, expert bias, scaling 2.5, bf16 gate",
                       "peak_mib": round(m["peak_mib"], 1), "baseline_peak_mib": round(m["baseline_peak_mib"], 1),
                       "peak_ratio": round(m["peak_mib"] / m["baseline_peak_mib"], 3),
                       "window_mib": round(m["window_mib"], 1),
                       "peak_note": "torch.cuda.max_memory_allocated over one step of each path built alone; "
                                    "peak_mib includes the NCCL window",
                       "moerail_layer_us": own, "moerail_layer_commit": layer["commit"],
                       "moerail_layer_align": layer["config"].get("align"),
                       "overhead_vs_moerail_layer": round(m["moerail_us"] / own, 3),
                       "steps": "median of 10, alternated with the baseline, after 3 warm-ups; gradients set to "
                                "None each step"}})
        if "fp8_us" in m:  # --fp8: moerail's experts in FP8, the same alternation, case <case>-fp8-blockwise
            r = json.loads(json.dumps(rows[-1]))
            r["case"] += "-fp8-blockwise"
            r["time_us"], r["value"] = m["fp8_us"], m["fp8_speedup_vs_alltoall"]
            r["verified"] = (f"before timing: the FP8 layer's output and input gradient against the alltoall layer's "
                             f"(bf16): rel. err {m['fp8_out_rel_err']:.4f} / {m['fp8_dx_rel_err']:.4f}, the recipe's "
                             "distance from bf16 (bound 0.1)" + ("" if m["fp8_verified"] else " (ABOVE: not verified)"))
            r["config"].update({"recipe": "fp8-blockwise (Megatron fp8='e4m3', fp8_recipe='blockwise')",
                                "moerail_bf16_us": m["moerail_us"], "fp8_vs_moerail_bf16": round(m["fp8_vs_moerail_bf16"], 3),
                                "peak_mib": round(m["fp8_peak_mib"], 1),
                                "peak_ratio": round(m["fp8_peak_mib"] / m["baseline_peak_mib"], 3),
                                "overhead_vs_moerail_layer": None})
            rows.append(r)
    json.dump(rows, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
