"""Where one moerail.torch.MoELayer step spends its GPU time, kernel by kernel (torch.profiler, CUPTI): the kernels of
one forward + backward in the order they started, with their durations, and the same grouped by kernel name. One GPU (the
whole layer on one rank) or one process per GPU (rank 0 prints):

    python3 bench/profile_layer.py [--experts 32] [--tokens 4096] [--recipe bf16|fp8-blockwise]
                                   [--fp8-weight-grads fp8|bf16] [--json FILE]

Layer: the DeepSeek-V3 shape of `moerail bench layer` (H 7168, F 2048, K 8, no shared expert, no losses), eager
steps (3 warm-ups, then one profiled). Kernel durations are CUPTI's; their sum is the GPU's busy time, not the step
time (gaps and overlap between streams are not in it)."""
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

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    if world > 1:
        dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [{"name": e.name, "us": e.device_time, "start_us": e.time_range.start}
               for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0]
    kernels.sort(key=lambda k: k["start_us"])
    if rank != 0:
        return
    total = sum(k["us"] for k in kernels)
    print(f"profile_layer.py: E {a.experts}, {a.tokens} tokens per rank, {world} rank(s), recipe {a.recipe}"
          + ("" if a.recipe == "bf16" else f", weight gradients in {a.fp8_weight_grads}")
          + f": {len(kernels)} kernels, {total:.0f} us of kernel time")
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
                       "fp8_weight_grads": a.fp8_weight_grads, "kernels": kernels}, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
