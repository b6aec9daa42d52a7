#!/usr/bin/env python3
"""The PyTorch way of expert-parallel dispatch and combine (what Megatron's all-to-all token dispatcher does), timed
on the cases of `moerail bench dispatch|combine --gpus N`; one JSON line per (bench, case) on rank 0's stdout.

    torchrun --nproc-per-node 2 bench/torch_ep_baseline.py [--tokens 4096] [--experts 64]

dispatch = permute (stable argsort of the expert ids + index_select of the expanded rows, rank-major)
           + all_to_all_single of the expanded rows (split sizes exchanged beforehand, not timed)
           + the receiver's sort of the rank-major chunks into expert-major order (index_select)
combine  = the inverse index_select + all_to_all_single back + unpermute (index_add_ of prob-weighted rows in fp32,
           cast to bf16).
GB/s uses the bytes moerail's rows use: the unique (token, remote rank) pairs of rank 0 times the row bytes.
"""
import argparse
import json
import os

import torch
import torch.distributed as dist


def timed(fn, iters=30, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    times.sort()
    return times[len(times) // 2]


def routing(T, E, K, gen):
    scores = torch.rand(T, E, generator=gen, device="cuda")
    idx = scores.topk(K, dim=1).indices
    probs = torch.rand(T, K, generator=gen, device="cuda") * 0.9 + 0.1
    return idx, probs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=64, help="experts E, a multiple of the world size")
    a = ap.parse_args()
    dist.init_process_group("nccl")
    R, me = dist.get_world_size(), dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", me)))
    H, E, K = 7168, a.experts, 8
    if E % R:
        raise SystemExit(f"--experts {E} must be a multiple of the world size {R}")
    L = E // R
    Tm = a.tokens
    p = f"ep{E}-t"
    cases = [(f"{p}{Tm}", [Tm] * R), (f"{p}512", [min(512, Tm)] * R)]
    if R == 2:
        cases += [(f"{p}{Tm}-0", [Tm, 0]), (f"{p}{Tm}-1000", [Tm, min(1000, Tm)])]
    elif R > 2:  # as moerail's bench: T_max, 0, 1000, T_max / 2, repeating
        cases += [(f"{p}{Tm}-uneven", [(Tm, 0, min(1000, Tm), Tm // 2)[r % 4] for r in range(R)])]
    for name, tokens in cases:
        gen = torch.Generator(device="cuda")
        gen.manual_seed(1234 + me)
        T = tokens[me]
        idx, probs = routing(T, E, K, gen)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        flat = idx.reshape(-1)
        order = torch.sort(flat, stable=True).indices          # expert-major = rank-major
        src_token = order // K
        send_counts = torch.bincount(flat // L, minlength=R)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        in_splits, out_splits = send_counts.tolist(), recv_counts.tolist()
        # the receiver's per-expert counts from each source, to sort rank-major chunks into expert-major order
        per_expert = torch.bincount(flat, minlength=E).reshape(R, L)
        recv_pe = torch.empty_like(per_expert)
        dist.all_to_all_single(recv_pe, per_expert)
        chunk_src = torch.arange(R, device="cuda").repeat_interleave(L)
        sizes = recv_pe.reshape(-1)
        chunk_id = torch.repeat_interleave(torch.arange(R * L, device="cuda"), sizes)
        # expert-major order on the receiver: by local expert, then source rank
        key = (chunk_id % L) * R + chunk_id // L
        sort_recv = torch.sort(key, stable=True).indices
        n_recv = int(sizes.sum())
        recv = torch.empty(n_recv, H, device="cuda", dtype=torch.bfloat16)
        w = probs.reshape(-1)[order].float()
        remote = torch.zeros(T, R, dtype=torch.bool, device="cuda")
        if T:
            remote[torch.arange(T, device="cuda").repeat_interleave(K), flat // L] = True
        remote[:, me] = False
        pairs = torch.tensor([int(remote.sum())], device="cuda")
        all_pairs = [torch.zeros_like(pairs) for _ in range(R)]
        dist.all_gather(all_pairs, pairs)
        row_bytes = H * 2

        def dispatch():
            expanded = x.index_select(0, src_token)
            dist.all_to_all_single(recv, expanded, out_splits, in_splits)
            return recv.index_select(0, sort_recv)

        y = dispatch()
        back = torch.empty(T * K, H, device="cuda", dtype=torch.bfloat16)

        def combine():
            rank_major = torch.empty_like(y)
            rank_major[sort_recv] = y
            dist.all_to_all_single(back, rank_major, in_splits, out_splits)
            out = torch.zeros(T, H, device="cuda", dtype=torch.float32)
            out.index_add_(0, src_token, back.float() * w[:, None])
            return out.to(torch.bfloat16)

        for bench, fn in (("dispatch", dispatch), ("combine", combine)):
            us = timed(fn)
            t = torch.tensor([us], device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank ends
            if me == 0:
                gbs = int(all_pairs[0]) * row_bytes / (float(t) * 1e3)
                print(json.dumps({"bench": bench, "case": name, "direction": "fwd", "time_us": round(float(t), 2),
                                  "value": round(gbs, 2),
                                  "baseline_name": "torch all_to_all_single + permute (Megatron all-to-all)"}),
                      flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
