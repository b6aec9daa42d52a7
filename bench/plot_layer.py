#!/usr/bin/env python3
"""Plot the layer rows of a results file: tokens/s per GPU against tokens per rank, moerail beside its baseline.

    python3 bench/plot_layer.py [--results bench/results/h200-x2.json] [--out bench/results/layer-h200-x2.png]

Rows: bench "layer", direction "step" (written by `moerail bench layer --gpus N` through bench/record.py, with the
plain PyTorch layer of bench/torch_layer_baseline.py as baseline).
"""
import argparse
import json
import pathlib
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="bench/results/h200-x2.json")
    ap.add_argument("--out", default=None, help="PNG path (default: bench/results/layer-<results name>.png)")
    a = ap.parse_args()
    rows = [r for r in json.loads(pathlib.Path(a.results).read_text())
            if r["bench"] == "layer" and r["direction"] == "step"]
    if not rows:
        sys.exit(f"plot_layer.py: no layer step rows in {a.results}")
    rows.sort(key=lambda r: r["config"]["tokens_per_rank"])
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [r["config"]["tokens_per_rank"] for r in rows]
    ours = [t / r["time_us"] * 1e6 for t, r in zip(tokens, rows)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(tokens, ours, "o-", label="moerail MoeLayer (captured graph)")
    with_base = [(t, r) for t, r in zip(tokens, rows) if r.get("baseline")]
    if with_base:
        ax.plot([t for t, _ in with_base], [t / r["baseline"]["time_us"] * 1e6 for t, r in with_base], "s--",
                label=with_base[0][1]["baseline"]["name"])
    ax.set_xscale("log", base=2)
    ax.set_xticks(tokens, [str(t) for t in tokens])
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("tokens/s per GPU (forward + backward)")
    c = rows[0]["config"]
    ax.set_title(f"MoE layer step, {rows[0]['gpus']}x {rows[0]['gpu']}: H {c['hidden']}, F {c['ffn_hidden']}, "
                 f"E {c['experts']}, K {c['topk']}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    out = a.out or str(pathlib.Path(a.results).with_name("layer-" + pathlib.Path(a.results).stem + ".png"))
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    main()
