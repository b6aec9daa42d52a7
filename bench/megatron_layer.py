"""Megatron-core's MoELayer, forward + backward, with moerail switched on (moerail.torch.megatron.use_moerail:
moerail's dispatcher and experts) beside Megatron's alltoall dispatcher with SequentialMLP (the experts Megatron
runs without TransformerEngine). One process per GPU:

    python3 -m torch.distributed.run --nproc-per-node 2 bench/megatron_layer.py [--experts 64] [--tokens 4096]

Shape: that of `moerail bench layer --config deepseek-v3` (H 7168, F 2048, K 8, sigmoid group-limited router, 8
groups keep 4, expert bias, scaling 2.5, no shared expert, no auxiliary loss; the router's GEMM in bf16, Megatron's
default), bf16, the same tokens on every rank; dropless, or --capacity-factor c (Megatron's router drops).
moerail's segments are padded as the integration pads them by default (16 rows in bf16; --align to change it;
`moerail bench layer` pads to 128); its buffers are sized to each dispatch's rows
(exact_rows, the default: one host read per dispatch, as the alltoall path makes), or with --static-rows to the
worst case (no host read; capturable). Before timing, the moerail layer's output and input
gradient are checked against the alltoall layer's (same weights, same routing). Timing: CUDA events, 3 warm-up
steps, then 10 steps of each path in alternating blocks, medians; every step starts with the gradients set to None.
Peak memory: torch.cuda.max_memory_allocated over one step of each path built alone (weights, gradients and
activations; moerail's buffers come from PyTorch's allocator, and the NCCL window that the NVLink transport
registers, which PyTorch does not see, is added). --fp8: a third path, moerail's layer with its experts in FP8
(Megatron's fp8 = "e4m3", fp8_recipe = "blockwise", set on a copy of the config after construction: Megatron's own
checks want TransformerEngine for fp8), checked against the alltoall layer to the recipe's distance from bf16
(relative error below 0.1; the recipe itself is ~6% off bf16, docs/fp8.md) and timed in the same alternation.
Prints one JSON line on rank 0."""
import copy
import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

import moerail.torch.megatron as mm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--router-only", action="store_true",
                    help="time Megatron's router (forward + backward), the routing map's conversion to top-k ids "
                         "and MoerailRouter (forward + backward) alone, at this shape, on each rank")
    ap.add_argument("--capacity-factor", type=float, default=None,
                    help="Megatron's moe_expert_capacity_factor (tokens past it dropped by the router); none: dropless")
    ap.add_argument("--align", type=int, default=None,
                    help="rows each expert segment is padded to (default: the integration's, 16 in bf16)")
    ap.add_argument("--fp8", action="store_true",
                    help="also time moerail's layer with its experts in FP8 (the blockwise recipe)")
    ap.add_argument("--static-rows", action="store_true",
                    help="moerail's buffers sized to the worst case (use_moerail(exact_rows=False)) instead of each "
                         "dispatch's rows")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=7168, num_attention_heads=56, num_moe_experts=args.experts, moe_router_topk=8,
        moe_ffn_hidden_size=2048, ffn_hidden_size=18432, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16, moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=world, moe_router_score_function="sigmoid", moe_router_num_groups=8,
        moe_router_group_topk=4, moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
        moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none", moe_expert_capacity_factor=args.capacity_factor,
        hidden_dropout=0.0)

    if args.router_only:
        router_times(cfg, args, rank)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        return

    cfg_fp8 = copy.copy(cfg)
    cfg_fp8.fp8, cfg_fp8.fp8_recipe = "e4m3", "blockwise"
    kinds = ("alltoall", "moerail") + (("moerail-fp8",) if args.fp8 else ())

    def build(kind):
        spec = get_moe_module_spec(use_te=False, num_experts=args.experts, moe_grouped_gemm=False)
        if kind != "alltoall":
            spec = mm.use_moerail(spec, align=args.align, max_tokens=args.tokens, exact_rows=not args.static_rows)
        torch.manual_seed(1)
        model_parallel_cuda_manual_seed(1)
        layer = spec(config=cfg_fp8 if kind == "moerail-fp8" else cfg, layer_number=1).cuda()
        with torch.no_grad():  # balanced-ish routing as in a trained model: the bias stays 0, weights small
            layer.router.weight.normal_(0, 0.02)
        return layer

    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    x = torch.randn(args.tokens, 1, cfg.hidden_size, generator=g, device="cuda").bfloat16().requires_grad_()
    d_out = torch.randn(args.tokens, 1, cfg.hidden_size, generator=g, device="cuda").bfloat16()

    def step(layer):
        for p in layer.parameters():
            p.grad = None
        x.grad = None
        out, _ = layer(x)
        out.backward(d_out)
        return out

    def window(layer):
        d = getattr(layer.token_dispatcher, "dispatcher", None)
        return d.window_bytes if d is not None else 0

    # peak memory, each path alone
    peak = {}
    for kind in kinds:
        layer = build(kind)
        for _ in range(2):
            step(layer)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step(layer)
        torch.cuda.synchronize()
        peak[kind] = (torch.cuda.max_memory_allocated() + window(layer)) / 2**20
        del layer
        torch.cuda.empty_cache()

    layers = {k: build(k) for k in kinds}
    ref = step(layers["alltoall"]).detach().float()
    ref_dx = x.grad.float()

    def errors(kind):
        out = step(layers[kind]).detach().float()
        return float((out - ref).norm() / ref.norm()), float((x.grad.float() - ref_dx).norm() / ref_dx.norm())

    err, err_dx = errors("moerail")
    verified = err < 2e-2 and err_dx < 2e-2
    fp8_err = errors("moerail-fp8") if args.fp8 else None
    fp8_verified = fp8_err is not None and max(fp8_err) < 0.1
    for _ in range(3):
        for layer in layers.values():
            step(layer)
    times = {k: [] for k in layers}
    for _ in range(args.iters):
        for kind, layer in layers.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step(layer)
            b.record()
            b.synchronize()
            times[kind].append(a.elapsed_time(b) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    # the slowest rank's median is the step
    t = torch.tensor([med["alltoall"], med["moerail"], peak["alltoall"], peak["moerail"],
                      med.get("moerail-fp8", 0.0), peak.get("moerail-fp8", 0.0)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    fp8 = {} if not args.fp8 else {
        "fp8_us": float(t[4]), "fp8_vs_moerail_bf16": float(t[4] / t[1]), "fp8_speedup_vs_alltoall": float(t[0] / t[4]),
        "fp8_peak_mib": float(t[5]), "fp8_out_rel_err": fp8_err[0], "fp8_dx_rel_err": fp8_err[1],
        "fp8_verified": fp8_verified}
    if rank == 0:
        print(json.dumps({**fp8, "bench": "megatron-layer", "gpus": world, "experts": args.experts, "tokens": args.tokens,
                          "capacity_factor": args.capacity_factor, "exact_rows": not args.static_rows,
                          "align": layers["moerail"].token_dispatcher.moe_config.align,
                          "alltoall_us": float(t[0]), "moerail_us": float(t[1]), "speedup": float(t[0] / t[1]),
                          "baseline_peak_mib": float(t[2]), "peak_mib": float(t[3]),
                          "window_mib": window(layers["moerail"]) / 2**20, "verified": verified,
                          "out_rel_err": err, "dx_rel_err": err_dx, "device": torch.cuda.get_device_name()}),
              flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def router_times(cfg, args, rank):
    """Megatron's TopKRouter forward + backward, moerail's conversion of its routing map (routing_map_to_topk,
    forward + backward), and MoerailRouter forward + backward (the same gate, moerail's fused top-k), each alone:
    medians of CUDA-event timings after 3 warm-ups."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    torch.manual_seed(1)
    model_parallel_cuda_manual_seed(1)
    router = TopKRouter(config=cfg, pg_collection=get_default_pg_collection()).cuda()
    router.set_layer_number(1)
    with torch.no_grad():
        router.weight.normal_(0, 0.02)
    fused = mm.MoerailRouter(config=cfg, pg_collection=get_default_pg_collection()).cuda()
    fused.set_layer_number(1)
    with torch.no_grad():
        fused.weight.copy_(router.weight)
    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    x = torch.randn(args.tokens, cfg.hidden_size, generator=g, device="cuda").bfloat16().requires_grad_()

    def route():
        probs, routing_map = router(x)
        return probs, routing_map

    def timed(fn):
        for _ in range(3):
            fn()
        ts = []
        for _ in range(args.iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3)
        return statistics.median(ts)

    def router_step():
        probs, _ = route()
        probs.sum().backward()

    def fused_step():
        probs, _ = fused(x)
        probs.sum().backward()

    probs, routing_map = route()
    probs = probs.detach().requires_grad_()

    def convert_step():
        _, topk_probs = mm.routing_map_to_topk(routing_map, probs, cfg.moe_router_topk)
        topk_probs.sum().backward()

    out = {"bench": "megatron-router", "experts": args.experts, "tokens": args.tokens, "rank": rank,
           "router_us": timed(router_step), "routing_map_to_topk_us": timed(convert_step),
           "moerail_router_us": timed(fused_step), "moerail_router_refusal": fused.fused_refusal(),
           "device": torch.cuda.get_device_name()}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
