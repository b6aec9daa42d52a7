"""Step time (forward + backward) of moerail.torch.MoELayer from Python, eager and under torch.cuda.graph, to show
what the Python path costs over the C++ layer (`moerail bench layer`). One process per GPU:

    python3 -m torch.distributed.run --nproc-per-node 2 bench/python_layer_step.py [--experts 64] [--tokens 4096]

Layer: the DeepSeek-V3 shape of `moerail bench layer` (H 7168, F 2048, K 8, A 128, sigmoid group-limited router
with expert bias, no shared expert, no losses), bf16. Modes:
  eager, graph        each step starts with the gradients set to None (one microbatch per step);
  eager-accumulate    the gradients of the previous steps are kept, and PyTorch adds each step's into .grad (the
                      microbatches after the first: a pass over 2.8 GB of expert gradients at E 64);
  eager-main-grad     the same, with fuse_wgrad_accumulation: the kernels add the expert weight gradients into
                      bf16 main_grad tensors (Megatron-LM's gradient buffer), no pass of their own;
  eager-fp32-main-grad-pass   fp32 main_grad (Megatron-LM's under bf16 training) without the fusion: the expert
                      weight gradients are written to .grad, then added into main_grad and dropped (what Megatron's
                      gradient hook does);
  eager-fp32-main-grad        the same buffers with fuse_wgrad_accumulation. The four accumulating modes alternate
                      step by step.
Prints one JSON line per mode on rank 0 (median of 10 steps after 3 warm-ups, CUDA events)."""
import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

import moerail
import moerail.torch as mt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if world > 1:
        dist.init_process_group("nccl")
    cfg = moerail.make_config("deepseek-v3", num_experts=a.experts, ep_size=world, max_tokens=a.tokens,
                              shared_expert_ffn=0, aux_loss_coeff=0.0, z_loss_coeff=0.0)
    layer = mt.MoELayer(cfg, check=False)
    x = torch.randn(a.tokens, cfg.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    d = torch.randn(a.tokens, cfg.hidden, device="cuda", dtype=torch.bfloat16)

    def step():  # one microbatch per step, gradients set to None first (no accumulation pass over the grads)
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = layer(x)
        out.backward(d)

    def timed_alternating(fns):  # medians of each fn when every step runs them in turn
        times = [[] for _ in fns]
        for i in range(3 + a.steps):
            for j, fn in enumerate(fns):
                if world > 1:
                    dist.barrier()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                if i >= 3:
                    times[j].append(s.elapsed_time(e))
        return [statistics.median(t) for t in times]

    def timed(fn):
        return timed_alternating([fn])[0]

    def accumulating_step():  # a later microbatch: the gradients of the earlier ones are kept
        x.grad = None
        out = layer(x)
        out.backward(d)

    eager = timed(step)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    replay = timed(graph.replay)
    # The accumulating modes alternate step by step (a GPU under load slows down within about a second, so modes
    # timed one after the other are not comparable): .grad of w1 and w2 is left alone by the main_grad steps.
    experts = (layer.w1, layer.w2)
    main_bf16 = [torch.zeros_like(p) for p in experts]
    main_f32 = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in experts]

    def main_grad_step(buffers):
        for p, b in zip(experts, buffers):
            p.main_grad = b
        layer.fuse_wgrad_accumulation = True
        try:
            accumulating_step()
        finally:
            layer.fuse_wgrad_accumulation = False

    def fp32_pass_step():
        grads = [p.grad for p in experts]  # what the bf16 accumulating steps keep
        for p in experts:
            p.grad = None
        accumulating_step()
        for p, b, g in zip(experts, main_f32, grads):
            b.add_(p.grad)
            p.grad = g

    accumulate, main_grad, fp32_pass, fp32_main_grad = timed_alternating(
        [accumulating_step, lambda: main_grad_step(main_bf16), fp32_pass_step, lambda: main_grad_step(main_f32)])
    for p in experts:
        del p.main_grad
    if rank == 0:
        for mode, ms in (("eager", eager), ("graph", replay), ("eager-accumulate", accumulate),
                         ("eager-main-grad", main_grad), ("eager-fp32-main-grad-pass", fp32_pass),
                         ("eager-fp32-main-grad", fp32_main_grad)):
            print(json.dumps({"bench": "python-layer", "mode": mode, "gpus": world, "experts": a.experts,
                              "tokens": a.tokens, "step_ms": round(ms, 3)}), flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
