#!/usr/bin/env python3
"""Peak device memory of one training step of the MoE layer, per GPU: moerail.torch.MoELayer under the worst-case
capacity and under a per-expert capacity factor, beside the plain PyTorch layer of bench/torch_layer_baseline.py on
the same shape; one JSON line per moerail policy on rank 0 (bench `layer-memory`, for bench/record.py).

    python3 -m torch.distributed.run --nproc-per-node N bench/layer_memory.py [--experts 64] [--tokens 4096]
        [--capacity-factor 1.25] [--steps 3] [--json FILE]

Layer: the deepseek-v3 preset (H 7168, F 2048, top-8, sigmoid group-limited routing, A 128) with --experts experts
over the N ranks, no shared expert and no router losses (as the plain layer), --tokens tokens per rank.

What is measured, per rank, each layer alone in the process (the others freed, the caching allocator emptied):
construction, then --steps forward + backward steps (gradients set to None before each, as a step without
accumulation), all under one torch.cuda.reset_peak_memory_stats. peak = torch.cuda.max_memory_allocated (the
weights, their gradients, the layer's buffers, the activations a step keeps, the step's transients) minus what was
allocated before the layer, plus, for moerail, its NCCL window (window_bytes: the NVLink staging area, which
PyTorch's allocator does not hold). The plain layer's NCCL buffers are NCCL's own and not counted (moerail's host-API
transport uses the same). The largest peak over the ranks is reported. Every step is checked as it runs (its output
and input gradient finite), and after the steps the moerail layer's status word is read: an error but a capacity
drop fails the bench; a drop under the factor is reported in the row (rows_dropped), not raised.
"""
import argparse
import datetime
import json
import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_layer_baseline as plain  # noqa: E402

MIB = float(1 << 20)


def peak_of(make, step, steps):
    """(peak bytes above what was allocated before make(), what make() returned)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    obj = make()
    for _ in range(steps):
        step(obj)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, obj


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", help="also write the rows as a JSON array (bench/record.py's input)")
    a = ap.parse_args()
    dist.init_process_group("nccl")
    R, me = dist.get_world_size(), dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", me)))
    import moerail
    import moerail.torch as mt

    T, E = a.tokens, a.experts
    base = dict(num_experts=E, ep_size=R, max_tokens=T, shared_expert_ffn=0, aux_loss_coeff=0.0, z_loss_coeff=0.0)
    torch.manual_seed(1234 + me)
    x = torch.randn(T, 7168, device="cuda", dtype=torch.bfloat16)
    d_out = torch.randn(T, 7168, device="cuda", dtype=torch.bfloat16)
    rows = []

    def moerail_step(layer):
        for p in layer.parameters():
            p.grad = None
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.backward(d_out)
        assert torch.isfinite(out).all() and torch.isfinite(xi.grad).all(), "non-finite output or gradient"

    for policy, fields in (("worst-case", {}), (f"per-expert({a.capacity_factor:g})",
                                                {"capacity_factor": a.capacity_factor})):
        cfg = moerail.make_config("deepseek-v3", **base, **fields)
        holder = {}

        def make():
            layer = mt.MoELayer(cfg, transport=a.transport, check=False)
            holder["layer"] = layer
            return layer

        dropped = 0
        try:
            peak, layer = peak_of(make, moerail_step, a.steps)
        except torch.OutOfMemoryError:
            peak, layer = math.inf, holder.get("layer")
        if layer is not None and math.isfinite(peak):
            try:
                layer._impl.check(torch.cuda.current_stream().cuda_stream)
            except moerail.Error as e:
                if "did not fit" not in str(e):
                    raise
                dropped = 1
            window, workspace, saved = layer.window_bytes, layer.workspace_bytes, layer.saved_bytes
        else:
            window = workspace = saved = 0
        rows.append(dict(policy=policy, peak=peak + window, window=window, workspace=workspace, saved=saved,
                         capacity=cfg.rows_per_rank, dropped=dropped))
        layer = holder = None

    # the plain PyTorch layer on the same shape
    L = E // R

    def make_plain():
        bf = torch.bfloat16
        return dict(Wr=(torch.randn(E, 7168, device="cuda") / 7168 ** 0.5).to(bf).requires_grad_(),
                    bias=torch.zeros(E, device="cuda"),
                    W1=(torch.randn(L, 2 * 2048, 7168, device="cuda", dtype=bf) / 7168 ** 0.5).requires_grad_(),
                    W2=(torch.randn(L, 7168, 2048, device="cuda", dtype=bf) / 2048 ** 0.5).requires_grad_())

    def plain_step(w):
        for p in (w["Wr"], w["W1"], w["W2"]):
            p.grad = None
        xi = x.clone().requires_grad_()
        out = plain.layer(xi, w["Wr"], w["bias"], w["W1"], w["W2"], R, L, 8)
        out.backward(d_out)
        assert torch.isfinite(out).all(), "non-finite output of the plain layer"

    try:
        base_peak, _ = peak_of(make_plain, plain_step, a.steps)
    except torch.OutOfMemoryError:
        base_peak = math.inf
    t = torch.tensor([r["peak"] for r in rows] + [base_peak], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    drops = torch.tensor([r["dropped"] for r in rows], device="cuda")
    dist.all_reduce(drops, op=dist.ReduceOp.MAX)
    if me == 0:
        base_mib = float(t[-1]) / MIB
        out = []
        for i, r in enumerate(rows):
            peak_mib = float(t[i]) / MIB
            out.append({
                "bench": "layer-memory", "case": "deepseek-v3" if i == 1 else "deepseek-v3-worst-case",
                "direction": "step", "gpu": torch.cuda.get_device_name(), "gpus": R,
                "commit": os.environ.get("MOERAIL_COMMIT", "unknown"), "date": str(datetime.date.today()),
                "time_us": None, "metric": "MiB", "value": round(peak_mib, 1),
                "ceiling": None, "floor_us": None,
                "baseline": {"name": "plain PyTorch layer (bench/torch_layer_baseline.py)", "time_us": None,
                             "value": round(base_mib, 1)},
                "verified": "every step's outputs and input gradient finite; moerail's status word read",
                "config": {"policy": r["policy"], "peak_mib": round(peak_mib, 1),
                           "baseline_peak_mib": round(base_mib, 1), "ratio": round(peak_mib / base_mib, 3),
                           "window_mib": round(r["window"] / MIB, 1), "workspace_mib": round(r["workspace"] / MIB, 1),
                           "saved_mib": round(r["saved"] / MIB, 1), "capacity_rows": r["capacity"],
                           "rows_dropped": bool(drops[i]), "experts": E, "tokens": T, "ranks": R,
                           "steps": a.steps}})
            print(json.dumps(out[-1]), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
