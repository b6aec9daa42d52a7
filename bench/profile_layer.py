"""Where one moerail.torch.MoELayer step spends its GPU time, kernel by kernel (torch.profiler, CUPTI): the kernels of
one forward + backward in the order they started, with their durations, and the same grouped by kernel name. One GPU (the
whole layer on one rank) or one process per GPU (rank 0 prints):

    python3 bench/profile_layer.py [--experts 32] [--tokens 4096] [--recipe bf16|fp8-blockwise]
                                   [--fp8-weight-grads fp8|bf16] [--graph] [--json FILE]

Layer: the DeepSeek-V3 shape of `moerail bench layer` (H 7168, F 2048, K 8, no shared expert, no losses), eager
steps (3 warm-ups, then one profiled). Kernel durations are CUPTI's; their sum is the GPU's busy time, not the step
time (gaps and overlap between streams are not in it). With --graph the step is captured in a CUDA graph and one
replay is profiled: then the step's span (first kernel's start to last kernel's end), the time no kernel ran in it,
and the largest gaps between kernels (with the kernels around them) are printed too; the ~140 us one after the
losses' memset node is the profiler's own (docs/layer.md)."""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

import moerail
import moerail.torch as mt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--recipe", default="fp8-blockwise", choices=("bf16", "fp8-blockwise"))
    ap.add_argument("--fp8-weight-grads", default="fp8", choices=("fp8", "bf16"))
    ap.add_argument("--graph", action="store_true", help="profile one replay of the step captured in a CUDA graph")
    ap.add_argument("--json", help="also write the kernels (in start order) to this file")
    a = ap.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if world > 1:
        dist.init_process_group("nccl")
    cfg = moerail.make_config("deepseek-v3", num_experts=a.experts, ep_size=world, max_tokens=a.tokens,
                              shared_expert_ffn=0, aux_loss_coeff=0.0, z_loss_coeff=0.0)
    kw = {} if a.recipe == "bf16" else {"recipe": a.recipe, "fp8_weight_grads": a.fp8_weight_grads}
    layer = mt.MoELayer(cfg, check=False, **kw)
    x = torch.randn(a.tokens, cfg.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    d = torch.randn(a.tokens, cfg.hidden, device="cuda", dtype=torch.bfloat16)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(d)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-ups off the default stream, as graph capture wants
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    run = step
    if a.graph:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layer(x).backward(d)
        run = graph.replay
        for _ in range(3):
            run()
    torch.cuda.synchronize()
    if world > 1:
        dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = [{"name": e.name, "us": e.device_time, "start_us": e.time_range.start, "end_us": e.time_range.end}
               for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0]
    kernels.sort(key=lambda k: k["start_us"])
    if rank != 0:
        return
    total = sum(k["us"] for k in kernels)
    print(f"profile_layer.py: E {a.experts}, {a.tokens} tokens per rank, {world} rank(s), recipe {a.recipe}"
          + ("" if a.recipe == "bf16" else f", weight gradients in {a.fp8_weight_grads}")
          + f": {len(kernels)} kernels, {total:.0f} us of kernel time")
    if kernels:
        span = max(k["end_us"] for k in kernels) - kernels[0]["start_us"]
        gaps, reach = [], kernels[0]["start_us"]  # idle stretches: no kernel running
        for i, k in enumerate(kernels):
            if k["start_us"] > reach:
                gaps.append((k["start_us"] - reach, i))
            reach = max(reach, k["end_us"])
        idle = sum(g for g, _ in gaps)
        print(f"span {span:.0f} us, no kernel running for {idle:.0f} us of it in {len(gaps)} gaps"
              + (" (eager: host launch time included)" if not a.graph else " (one graph replay)"))
        for g, i in sorted(gaps, reverse=True)[:12]:
            print(f"  gap {g:7.1f} us before #{i} {kernels[i]['name'][:70]}  (after {kernels[i - 1]['name'][:60]})")
    print(f"{'us':>9} {'share':>6}  kernel (in start order)")
    for k in kernels:
        print(f"{k['us']:9.1f} {100 * k['us'] / total:5.1f}%  {k['name'][:150]}")
    by_name = {}
    for k in kernels:
        by_name.setdefault(k["name"], [0.0, 0])
        by_name[k["name"]][0] += k["us"]
        by_name[k["name"]][1] += 1
    print(f"\n{'us':>9} {'share':>6} {'calls':>5}  kernel (grouped)")
    for name, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0]):
        print(f"{us:9.1f} {100 * us / total:5.1f}% {n:5d}  {name[:150]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"experts": a.experts, "tokens": a.tokens, "ranks": world, "recipe": a.recipe,
                       "fp8_weight_grads": a.fp8_weight_grads, "graph": a.graph, "kernels": kernels}, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
