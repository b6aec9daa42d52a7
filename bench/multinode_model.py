#!/usr/bin/env python3
"""The traffic and time model of docs/multinode.md: rows and bytes one dispatch (or combine) moves per rank over the
network and over NVLink, flat (one row per (token, remote rank)) against hierarchical (one row per (token, remote
node), forwarded inside the node over NVLink), for expert parallelism over nodes of 8 GPUs.

    python3 bench/multinode_model.py [--tokens 4096] [--hidden 7168] [--experts 256] [--topk 8] [--gbps 400]

Routing: uniform (each token's K distinct experts uniformly among E; exact expectations from binomial
coefficients) and node-limited (DeepSeek-V3: the token's experts on at most 4 nodes; the nodes drawn uniformly, then
K distinct experts among theirs; expectations by sampling). Rows as the reference's node_traffic counts them
(src/reference/dispatch.cpp); bytes per row: bf16 H * 2, FP8 H + 4 H / 128 (e4m3 codes and 1x128 f32 scales).
Times: the busiest direction's bytes at the given network rate per GPU (a floor: no protocol overhead), and at the
rates DeepEP publishes for the same shape (H800, 400 Gb/s CX7; docs/multinode.md cites them). Prints a Markdown
table; then a second one for moerail's host-API path through nodes, whose transfers have fixed sizes (graph-safe):
the rows it sends per token and remote node against those routed, under its bound (Dispatcher::node_rows(): min(T,
G * peer_rows), peer_rows = ceil(c T p_rank) under a capacity factor c) and under a bound per node (ceil(c T p_node),
not built).
"""
from math import ceil
import argparse
import random
from math import comb

GPUS_PER_NODE = 8
NODE_LIMIT = 4
# DeepEP V1 normal kernels, H800 + CX7 400 Gb/s, 4096 tokens, H 7168, top-4 groups, top-8, FP8 dispatch, BF16
# combine: the RDMA "bottleneck bandwidth" it publishes (GB/s), dispatch / combine.
DEEPEP_GBPS = {16: (43, 43), 32: (58, 57), 64: (51, 50)}


def uniform(E, K, R, G):
    """Expected rows per token, uniform routing: (flat network, hierarchical network, hierarchical NVLink)."""
    L, N = E // R, R // G
    p_rank = 1 - comb(E - L, K) / comb(E, K)      # a given rank holds one of the token's experts
    p_node = 1 - comb(E - G * L, K) / comb(E, K)  # a given node does
    flat = (R - G) * p_rank
    hier = (N - 1) * p_node
    # NVLink: the source's node as flat ((G - 1) ranks), and in each remote node every hit rank but the forwarder
    nvlink = (G - 1) * p_rank + (R - G) * p_rank - (N - 1) * p_rank
    return flat, hier, nvlink


def node_limited(E, K, R, G, samples, rng):
    """The same under routing to at most NODE_LIMIT nodes per token (nodes drawn uniformly; by sampling)."""
    L, N = E // R, R // G
    flat = hier = nvlink = 0
    for _ in range(samples):
        src = rng.randrange(R)
        allowed = rng.sample(range(N), min(NODE_LIMIT, N))
        experts = rng.sample([n * G * L + i for n in allowed for i in range(G * L)], K)
        ranks = {e // L for e in experts}
        for n in {r // G for r in ranks}:
            hit = {r for r in ranks if r // G == n}
            if n == src // G:
                nvlink += len(hit - {src})
            else:
                flat += len(hit)
                hier += 1
                nvlink += len(hit - {n * G + src % G})  # forwarded past the rail-aligned forwarder
    return flat / samples, hier / samples, nvlink / samples


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--gbps", type=float, default=400.0, help="network rate per GPU, Gb/s per direction")
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--capacity-factor", type=float, default=1.25, help="c of Capacity::of_factor (second table)")
    a = ap.parse_args()
    rng = random.Random(1)
    T, H, E, K = a.tokens, a.hidden, a.experts, a.topk
    bf16, fp8 = 2 * H, H + 4 * H // 128
    net = a.gbps / 8 * 1e9  # bytes/s
    print(f"T {T} tokens per rank, H {H}, E {E}, top-{K}, {GPUS_PER_NODE} GPUs per node, network {a.gbps:g} Gb/s "
          "per GPU\n")
    print("| EP | nodes | routing | flat network rows per token | hierarchical | ratio | NVLink rows per token "
          "(hier.) | network MB per rank, FP8 dispatch / bf16 combine | floor us (dispatch / combine) | at DeepEP's "
          "rate us |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    routed = {}
    for R in (8, 16, 32, 64):
        G = min(GPUS_PER_NODE, R)
        for routing in ("uniform", "node-limited"):
            flat, hier, nvl = (uniform(E, K, R, G) if routing == "uniform"
                               else node_limited(E, K, R, G, a.samples, rng))
            mb_d, mb_c = T * hier * fp8 / 1e6, T * hier * bf16 / 1e6
            floor_d, floor_c = T * hier * fp8 / net * 1e6, T * hier * bf16 / net * 1e6
            deepep = DEEPEP_GBPS.get(R)
            at_deepep = ""
            if deepep and routing == "node-limited":
                at_deepep = f"{T * hier * fp8 / (deepep[0] * 1e9) * 1e6:.0f} / {T * hier * bf16 / (deepep[1] * 1e9) * 1e6:.0f}"
            ratio = f"{flat / hier:.2f}x" if hier > 0 else "-"
            print(f"| {R} | {R // G} | {routing} | {flat:.2f} | {hier:.2f} | {ratio} | {nvl:.2f} | "
                  f"{mb_d:.0f} / {mb_c:.0f} | {floor_d:.0f} / {floor_c:.0f} | {at_deepep} |")
            routed[(R, routing)] = hier

    c = a.capacity_factor
    print(f"\nFixed-size transfers (host API, capacity factor {c:g}): network rows sent per token against routed\n")
    print("| EP | nodes | routing | routed | sent, node_rows = min(T, G peer_rows) | ratio | sent, ceil(c T p_node) | "
          "ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for R in (16, 32, 64):
        G, L = GPUS_PER_NODE, E // R
        N = R // G
        p_rank = 1 - comb(E - L, K) / comb(E, K)
        p_node = 1 - comb(E - G * L, K) / comb(E, K)
        now = (N - 1) * min(T, G * ceil(c * T * p_rank)) / T
        per_node = (N - 1) * min(T, ceil(c * T * p_node)) / T
        for routing in ("uniform", "node-limited"):
            hier = routed[(R, routing)]
            print(f"| {R} | {N} | {routing} | {hier:.2f} | {now:.2f} | {now / hier:.2f}x | {per_node:.2f} | "
                  f"{per_node / hier:.2f}x |")

if __name__ == "__main__":
    main()
