#!/usr/bin/env python3
"""torch._grouped_mm on the shapes of `moerail bench mlp`: the PyTorch baseline, printed as a JSON array.

Same cases, routing (balanced and Zipf 1.2 over the experts in index order, counts rounded down to the preset's
alignment) and FLOP model as tools/bench_mlp.cu. Per case: FC1 (x W1^T) and FC2 (a W2^T) forward, and the backward
of both (dgrad: dy W2, d_h1 W1; wgrad: dy^T a, d_h1^T x with the token dimension ragged), CUDA events, median.

    python3 bench/torch_grouped_mm.py --cases deepseek-v3,qwen3-30b-a3b,mixtral-8x7b [--warmup 10 --iters 50]
                                      [--tokens T]
Row: {"case": "deepseek-v3-zipf", "fc1_us": .., "fc2_us": .., "fwd_us": .., "bwd_us": .., "fc1_tflops": .., ...,
      "dense_beside_fc1_tflops": .., "fc1_beside_dense_tflops": ..} (the last two: the dense bf16 8192^3 matmul and
      FC1 alternating in one loop, at the end of the case)
"""
import argparse
import json
import sys

# preset: (H, F, L, rows, align, K, E) — H, F, align, K, E as moerail's presets (src/core/config.cpp), L and rows
# as the issue.
CASES = {
    "deepseek-v3": (7168, 2048, 32, 32768, 128, 8, 256),
    "qwen3-30b-a3b": (2048, 768, 128, 131072, 16, 8, 128),
    "mixtral-8x7b": (4096, 14336, 8, 16384, 16, 2, 8),
}
ZIPF = 1.2


def counts_for(L, rows, align, zipf):
    w = [1.0 / (e + 1) ** ZIPF if zipf else 1.0 for e in range(L)]
    s = sum(w)
    return [int(rows * v / s) // align * align for v in w]


def median_us(torch, fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    times.sort()
    return times[len(times) // 2]


def alternating_medians_us(torch, fns, warmup, iters):
    """Medians of each fn when every iteration runs them back to back, events between them (one power state)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(iters):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(fns) + 1)]
        ev[0].record()
        for i, fn in enumerate(fns):
            fn()
            ev[i + 1].record()
        torch.cuda.synchronize()
        for i in range(len(fns)):
            times[i].append(ev[i].elapsed_time(ev[i + 1]) * 1000.0)
    return [sorted(t)[len(t) // 2] for t in times]


DENSE_N = 8192  # the dense ceiling of tools/bench_mlp.cu: bf16 8192^3, random operands


def bench(torch, name, zipf, warmup, iters, tokens, dense):
    H, F, L, rows, align, K, E = CASES[name]
    if tokens > 0:  # as tools/bench_mlp.cu: the balanced rows of a rank at EP = E / L
        rows = max(L * align, tokens * K * L // E)
    F1 = 2 * F  # SwiGLU
    counts = counts_for(L, rows, align, zipf)
    used = sum(counts)
    dev, bf = "cuda", torch.bfloat16
    offs = torch.tensor(counts, device=dev, dtype=torch.int32).cumsum(0).to(torch.int32)
    x = torch.randn(used, H, device=dev, dtype=bf)
    w1 = torch.randn(L, F1, H, device=dev, dtype=bf) / H ** 0.5
    w2 = torch.randn(L, H, F, device=dev, dtype=bf) / F ** 0.5
    a = torch.randn(used, F, device=dev, dtype=bf)
    dy = torch.randn(used, H, device=dev, dtype=bf)
    dh1 = torch.randn(used, F1, device=dev, dtype=bf)
    gmm = torch._grouped_mm

    fc1 = lambda: gmm(x, w1.transpose(-2, -1), offs=offs)
    fc2 = lambda: gmm(a, w2.transpose(-2, -1), offs=offs)

    def fwd():
        fc1()
        fc2()

    def bwd():
        gmm(dy, w2, offs=offs)                    # d_act = dy W2        [used, F]
        gmm(dh1, w1, offs=offs)                   # dx = d_h1 W1         [used, H]
        gmm(dy.t(), a, offs=offs)                 # dW2 = dy^T a         [L, H, F], ragged K
        gmm(dh1.t(), x, offs=offs)                # dW1 = d_h1^T x       [L, F1, H], ragged K

    row = {"case": name + ("-zipf" if zipf else ""), "rows": used, "experts": L, "hidden": H, "ffn": F}
    fc1_flop, fc2_flop = 2.0 * used * H * F1, 2.0 * used * F * H
    for key, fn, flop in (("fc1", fc1, fc1_flop), ("fc2", fc2, fc2_flop), ("fwd", fwd, fc1_flop + fc2_flop),
                          ("bwd", bwd, 2 * (fc1_flop + fc2_flop))):
        try:
            us = median_us(torch, fn, warmup, iters)
            row[key + "_us"] = us
            row[key + "_tflops"] = flop / (us * 1e6)
        except Exception as e:  # an unsupported layout on this torch version: leave the figure out
            row[key + "_error"] = str(e).splitlines()[0][:200]
    # The dense GEMM alternating with FC1 in one loop, last (as tools/bench_mlp.cu does for its own FC1): this
    # process's rates in the power state of its GEMMs, so that the two sides can also be compared as shares of
    # the dense rate each one ran beside.
    if dense is not None and "fc1_us" in row:
        da, db = dense
        dense_us, fc1_us = alternating_medians_us(torch, [lambda: torch.matmul(da, db), fc1], warmup, iters)
        row["dense_beside_fc1_tflops"] = 2.0 * DENSE_N ** 3 / (dense_us * 1e6)
        row["fc1_beside_dense_tflops"] = fc1_flop / (fc1_us * 1e6)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--tokens", type=int, default=-1, help="tokens per rank (default: the issue's rows per case)")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        print("torch_grouped_mm.py: needs a CUDA GPU and torch._grouped_mm", file=sys.stderr)
        return 1
    dense = (torch.randn(DENSE_N, DENSE_N, device="cuda", dtype=torch.bfloat16),
             torch.randn(DENSE_N, DENSE_N, device="cuda", dtype=torch.bfloat16))
    rows = []
    for name in args.cases.split(","):
        if name not in CASES:
            print(f"torch_grouped_mm.py: unknown case {name} (known: {', '.join(CASES)})", file=sys.stderr)
            return 2
        for zipf in (False, True):
            rows.append(bench(torch, name, zipf, args.warmup, args.iters, args.tokens, dense))
            torch.cuda.empty_cache()
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
