"""The FP8 recipes' convergence check: one small model trained from the same seed in bf16 and in each FP8 recipe,
the final losses compared (the target: each FP8 recipe within 2% of bf16 after 100 steps).

    python3 bench/fp8_convergence.py [--device cpu|cuda] [--steps 100] [--recipes fp8-blockwise fp8-tensor ...]
                                     [--json FILE]

Model: x -> MoELayer (moerail.torch, the recipe under test) -> linear head, regressing a fixed random teacher (a
two-layer tanh MLP) on fresh Gaussian inputs every step; MSE loss; Adam, lr 1e-3. Both recipes see the same
initial weights and the same batches. On the CPU the layer is moerail's reference backend (fp8-blockwise: its
quantize-dequantize recipe, moerail/reference/experts.h), on CUDA the GPU step (bf16 activations, FP8 GEMMs).
Prints one line per recipe every 20 steps and a JSON summary: the final loss of each (the mean of the last 10
steps, smoothing the batch noise) and each FP8 recipe's ratio to bf16's.
"""
import argparse
import json
import sys

import torch

import moerail
import moerail.torch as mt


def train(recipe, device, steps, seed):
    cfg = moerail.make_config(hidden=128, ffn_hidden=128, num_experts=8, topk=2, align=16, max_tokens=256,
                              score_function="softmax")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(seed)
    layer = mt.MoELayer(cfg, device=device, dtype=dtype, recipe=recipe, check=False)
    head = torch.nn.Linear(cfg.hidden, 16, device=device, dtype=dtype)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    teacher_1 = torch.randn(cfg.hidden, 256, generator=g) / cfg.hidden ** 0.5
    teacher_2 = torch.randn(256, 16, generator=g) / 16.0
    params = list(layer.parameters()) + list(head.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)
    if recipe != "bf16":
        layer.refresh_fp8_weights_after(opt)
    data = torch.Generator(device="cpu").manual_seed(seed + 2)
    losses = []
    for step in range(steps):
        x = torch.randn(256, cfg.hidden, generator=data)
        y = torch.tanh(x @ teacher_1) @ teacher_2
        x, y = x.to(device=device, dtype=dtype), y.to(device=device, dtype=torch.float32)
        opt.zero_grad(set_to_none=True)
        out = head(layer(x)).float()
        loss = torch.nn.functional.mse_loss(out, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 20 == 19 or step == steps - 1:
            print(f"fp8_convergence.py: {recipe} step {step + 1} loss {losses[-1]:.5f}", file=sys.stderr, flush=True)
    return losses


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--recipes", nargs="+", default=["fp8-blockwise", "fp8-tensor", "fp8-tensor-hybrid"],
                    help="the FP8 recipes to train beside bf16")
    ap.add_argument("--json", help="also write the summary to this file")
    a = ap.parse_args()
    runs = {r: train(r, a.device, a.steps, a.seed) for r in ["bf16", *a.recipes]}
    final = {r: sum(v[-10:]) / len(v[-10:]) for r, v in runs.items()}
    summary = {"bench": "fp8-convergence", "device": a.device, "steps": a.steps, "seed": a.seed,
               "first_loss": {r: v[0] for r, v in runs.items()}, "final_loss": final,
               "over_bf16": {r: final[r] / final["bf16"] for r in a.recipes}}
    print(json.dumps(summary))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
