#!/usr/bin/env python3
"""The plain PyTorch MoE layer (torch ops + all_to_all_single, as Megatron-LM's all-to-all token dispatcher does it),
timed forward + backward on the shapes of `moerail bench layer --gpus N`; one JSON line per token count on rank 0.

    python3 -m torch.distributed.run --nproc-per-node N bench/torch_layer_baseline.py \
        [--tokens 512,1024,2048,4096,8192,16384] [--experts 64] [--warmup 3] [--iters 10]

Layer (DeepSeek-V3 shape, as moerail's `deepseek-v3` preset without shared expert and losses): logits = x Wr^T;
sigmoid scores, group-limited top-8 (8 groups, 4 kept, group score = sum of its top 2) on scores + expert bias,
probs = normalized scores x 2.5; permute (stable argsort by expert + index_select), split sizes to the host (a sync,
as in Megatron), all_to_all_single (autograd), sort into local-expert-major order, torch._grouped_mm FC1 -> SwiGLU x
prob -> FC2, the inverse sort, all_to_all_single back, index_add_ in fp32. A step = forward + backward of
<out, d_out>; CUDA events, median over --iters after --warmup, the slowest rank's time.
FLOPs per rank (as tools/layer_gpu.cu): 3 * (T*K*2*H*(2F + F) + 2*T*H*E).
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn
import torch.nn.functional as F


def route(logits, bias, K, groups, keep):
    scores = torch.sigmoid(logits.float())
    sel = scores + bias
    T, E = sel.shape
    top2 = sel.view(T, groups, E // groups).topk(2, dim=-1).values.sum(-1)
    kept = top2.topk(keep, dim=-1).indices
    mask = torch.zeros(T, groups, dtype=torch.bool, device=sel.device).scatter_(1, kept, True)
    sel = sel.masked_fill(~mask.repeat_interleave(E // groups, dim=1), float("-inf"))
    idx = sel.topk(K, dim=-1).indices
    probs = scores.gather(1, idx)
    return idx, probs / (probs.sum(-1, keepdim=True) + 1e-20) * 2.5


def layer(x, Wr, bias, W1, W2, R, L, K):
    T, H = x.shape
    idx, probs = route(x @ Wr.t(), bias, K, 8, 4)
    flat = idx.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # expert-major = rank-major
    token = order // K
    send = torch.bincount(flat // L, minlength=R)
    per_expert = torch.bincount(flat, minlength=R * L).view(R, L)
    recv_pe = torch.empty_like(per_expert)
    dist.all_to_all_single(recv_pe, per_expert)
    recv_counts = recv_pe.sum(1)
    in_splits, out_splits = send.tolist(), recv_counts.tolist()  # host sync, as Megatron's dispatcher
    rows = dnn.all_to_all_single(torch.empty(sum(out_splits), H, device=x.device, dtype=x.dtype),
                                 x.index_select(0, token), out_splits, in_splits)
    p = dnn.all_to_all_single(torch.empty(sum(out_splits), device=x.device),
                              probs.reshape(-1)[order].contiguous(), out_splits, in_splits)
    # received chunks are rank-major, each sorted by local expert: sort by (local expert, source rank)
    chunk = torch.repeat_interleave(torch.arange(R * L, device=x.device), recv_pe.reshape(-1))
    sort = torch.sort((chunk % L) * R + chunk // L, stable=True).indices
    offs = torch.cumsum(recv_pe.sum(0), 0).to(torch.int32)
    xs, ps = rows.index_select(0, sort), p.index_select(0, sort)
    h1 = torch._grouped_mm(xs, W1.transpose(-2, -1), offs=offs)
    a, b = h1.chunk(2, dim=-1)
    act = (F.silu(a.float()) * b.float() * ps[:, None]).to(x.dtype)
    y = torch._grouped_mm(act, W2.transpose(-2, -1), offs=offs)
    back = torch.empty_like(y).index_copy(0, sort, y)
    ret = dnn.all_to_all_single(torch.empty(T * K, H, device=x.device, dtype=x.dtype), back, in_splits, out_splits)
    out = torch.zeros(T, H, device=x.device, dtype=torch.float32).index_add(0, token, ret.float())
    return out.to(x.dtype)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    dist.init_process_group("nccl")
    R, me = dist.get_world_size(), dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", me)))
    H, Fh, E, K = a.hidden, a.ffn, a.experts, a.topk
    if E % R or E % 8:
        raise SystemExit(f"--experts {E} must be a multiple of the world size {R} and of 8")
    L = E // R
    torch.manual_seed(1234 + me)
    bf = torch.bfloat16
    Wr = (torch.randn(E, H, device="cuda") / H ** 0.5).to(bf).requires_grad_()
    bias = torch.zeros(E, device="cuda")
    W1 = (torch.randn(L, 2 * Fh, H, device="cuda", dtype=bf) / H ** 0.5).requires_grad_()
    W2 = (torch.randn(L, H, Fh, device="cuda", dtype=bf) / Fh ** 0.5).requires_grad_()
    for T in [int(t) for t in a.tokens.split(",")]:
        try:
            x = torch.randn(T, H, device="cuda", dtype=bf, requires_grad=True)
            d_out = torch.randn(T, H, device="cuda", dtype=bf)

            def step():
                for p in (x, Wr, W1, W2):
                    p.grad = None
                layer(x, Wr, bias, W1, W2, R, L, K).backward(d_out)

            for _ in range(a.warmup):
                step()
            torch.cuda.synchronize()
            dist.barrier()
            times = []
            for _ in range(a.iters):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                step()
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e) * 1000.0)
            times.sort()
            t = torch.tensor([times[len(times) // 2]], device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            us = float(t)
            flops = 3 * (T * K * 2 * H * 3 * Fh + 2 * T * H * E)
            if me == 0:
                print(json.dumps({"bench": "layer", "case": "deepseek-v3" if T == 4096 else f"deepseek-v3-t{T}",
                                  "direction": "step", "time_us": round(us, 1),
                                  "value": round(flops / (us * 1e-6) / 1e12, 2),
                                  "tokens_per_s": round(T * R / (us * 1e-6)),
                                  "baseline_name": "plain PyTorch layer (Megatron all-to-all dispatcher, "
                                                   "torch._grouped_mm)"}), flush=True)
        except torch.OutOfMemoryError:
            print(f"torch_layer_baseline.py: {T} tokens per rank ran out of memory", file=sys.stderr, flush=True)
        x = d_out = None
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
