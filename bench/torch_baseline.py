#!/usr/bin/env python3
"""The PyTorch way of doing what `moerail bench router|permute|combine` measures, on the same shapes.

permute: stable argsort of the expert ids + index_select (+ pad rows by index_copy into a zeroed padded buffer);
combine: index_select of the routed rows, weights in fp32, index_add_ into an fp32 [T, H] accumulator, cast;
router:  sigmoid/softmax + group-limited torch.topk (+ bias), as Megatron's unfused path.
GB/s counts the same bytes as the moerail benches (each input read once, each output written once).
Prints one JSON object per line: {bench, case, direction, time_us, value}.
"""
import json
import math

import torch

PRESETS = {
    # name: tokens, hidden, experts, topk, align, score, groups, group_topk, bias
    "deepseek-v3": (8192, 7168, 256, 8, 128, "sigmoid", 8, 4, True),
    "qwen3-30b-a3b": (16384, 2048, 128, 8, 16, "softmax", 0, 0, False),
}
SETS = 3


def timed(fn, iters=50, warmup=10):
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    times.sort()
    return times[len(times) // 2]


def routing(T, E, K, gen):
    idx = torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :K].to(torch.int32)
    probs = torch.rand(T, K, device="cuda", generator=gen) * 0.95 + 0.05
    return idx, probs


def padded_layout(idx, E, A):
    """Row of every (t, k) in the expert-major padded layout (stable: token, then k), and total rows."""
    flat = idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + A - 1) // A * A
    seg = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    sorted_e = flat[order]
    rank = torch.arange(flat.numel(), device=flat.device) - start[sorted_e]
    rows = torch.empty_like(flat)
    rows[order] = seg[sorted_e] + rank
    return rows, int(padded.sum())  # .item(): the host sync torch needs


def emit(bench, case, direction, us, nbytes):
    print(json.dumps({"bench": bench, "case": case, "direction": direction, "time_us": round(us, 2),
                      "value": round(nbytes / (us * 1e3), 1)}), flush=True)


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    for case, (T, H, E, K, A, score, G, GK, use_bias) in PRESETS.items():
        row = H * 2
        sets = []
        for _ in range(SETS):
            idx, probs = routing(T, E, K, gen)
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
            rows, total = padded_layout(idx, E, A)
            sets.append((idx, probs, x, rows, total))
        N = T * K
        P = sets[0][4] - N

        # permute fwd: the padded expert-major buffer, pad rows zero.
        def permute_fwd(i):
            idx, probs, x, rows, total = sets[i % SETS]
            out = torch.zeros(total, H, device="cuda", dtype=x.dtype)
            src = torch.arange(T, device="cuda").repeat_interleave(K)
            out.index_copy_(0, rows, x.index_select(0, src))
            pout = torch.zeros(total, device="cuda")
            pout.index_copy_(0, rows, probs.reshape(-1))
            return out, pout
        us = timed(permute_fwd)
        emit("permute", case, "fwd", us, T * row + (N + P) * row + 8 * T * K + 4 * (N + P))
        recv = [permute_fwd(i)[0] for i in range(SETS)]

        # permute bwd: dx[t] = sum_k d_recv[row(t,k)] in fp32.
        def permute_bwd(i):
            idx, probs, x, rows, total = sets[i % SETS]
            g = recv[i % SETS].index_select(0, rows).float().view(T, K, H).sum(1)
            return g.to(torch.bfloat16)
        us = timed(permute_bwd)
        emit("permute", case, "bwd", us, N * row + T * row + 8 * T * K + 4 * N)

        # combine fwd: index_add_ in fp32 of the weighted rows.
        def combine_fwd(i):
            idx, probs, x, rows, total = sets[i % SETS]
            y = recv[i % SETS].index_select(0, rows).float() * probs.reshape(-1, 1)
            acc = torch.zeros(T, H, device="cuda", dtype=torch.float32)
            acc.index_add_(0, torch.arange(T, device="cuda").repeat_interleave(K), y)
            return acc.to(torch.bfloat16)
        us = timed(combine_fwd)
        emit("combine", case, "fwd", us, N * row + T * row + 8 * T * K)

        # combine bwd: d_y rows = p * d_out, d_p = <y, d_out>.
        def combine_bwd(i):
            idx, probs, x, rows, total = sets[i % SETS]
            d_out = x
            g = d_out.float().repeat_interleave(K, 0)
            d_y = torch.zeros(total, H, device="cuda", dtype=torch.bfloat16)
            d_y.index_copy_(0, rows, (g * probs.reshape(-1, 1)).to(torch.bfloat16))
            d_p = (recv[i % SETS].index_select(0, rows).float() * g).sum(1)
            return d_y, d_p
        us = timed(combine_bwd)
        emit("combine", case, "bwd", us, T * row + N * row + (N + P) * row + 12 * T * K)

        # router fwd: scores, optional group limit, topk, weights.
        logits = [torch.randn(T, E, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(SETS)]
        bias = torch.randn(E, device="cuda", generator=gen) * 0.05

        def router_fwd(i):
            x = logits[i % SETS].float()
            if score == "sigmoid":
                s = torch.sigmoid(x)
                sel = s + bias if use_bias else s
            else:
                s = x
                sel = x
            if G > 1:
                gs = sel.view(T, G, E // G).topk(K // GK, dim=-1).values.sum(-1)
                keep = gs.topk(GK, dim=-1).indices
                mask = torch.zeros(T, G, device="cuda", dtype=torch.bool).scatter_(1, keep, True)
                sel = sel.masked_fill(~mask.repeat_interleave(E // G, 1), float("-inf"))
            idx = sel.topk(K, dim=-1).indices
            w = s.gather(1, idx)
            w = torch.softmax(w, -1) if score == "softmax" else w / (w.sum(-1, keepdim=True) + 1e-20)
            return idx.int(), w
        us = timed(router_fwd)
        emit("router", case, "fwd", us, T * E * 2 + 8 * T * K)

        def router_bwd(i):
            x = logits[i % SETS].float().requires_grad_(True)
            s = torch.sigmoid(x) if score == "sigmoid" else x
            idx = s.topk(K, dim=-1).indices
            w = s.gather(1, idx)
            w = torch.softmax(w, -1) if score == "softmax" else w / (w.sum(-1, keepdim=True) + 1e-20)
            w.backward(torch.ones_like(w))
            return x.grad
        us = timed(router_bwd)  # includes the recomputed forward, as autograd needs it
        emit("router", case, "bwd", us, T * E * 2 + 8 * T * K + 4 * T * E)


if __name__ == "__main__":
    main()
