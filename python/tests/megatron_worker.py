"""The Megatron-core checks on GPUs, one process per GPU (python -m torch.distributed.run --nproc-per-node N
megatron_worker.py CHECK OUT_DIR); test_megatron.py runs them. Each rank writes OUT_DIR/CHECK.rank{r}.json with its
figures and "ok"; an assertion failure raises (the run's exit status says it).

  layer       Megatron's MoELayer (alltoall dispatcher, SequentialMLP) against the same layer with moerail's dispatcher
              (SequentialMLP experts) and with moerail's dispatcher and experts: same weights, same routing, a
              different token count on every rank, dropless, with capacity drops, and with a shared expert overlapped
              with the dispatch and combine; outputs and every gradient
  checkpoint  distributed checkpoint round trip: Megatron's layout -> moerail's experts -> Megatron's layout, bit-exact
  gpt         a small GPT, pipeline parallel 2 x expert parallel 2 (4 GPUs), 1F1B, 20 steps with Megatron's DDP and
              optimizer: the loss of every step with moerail switched on against the alltoall run from the same seed
  gpt-fp8     the same GPT (1 GPU, or pipeline 2 x expert parallel 2 on 4) with moerail's experts in bf16 and in FP8
              (fp8 = "e4m3", fp8_recipe = MOERAIL_GPT_FP8_RECIPE: "blockwise", the default, or "tensorwise"; or
              "tensorwise-hybrid": fp8 = "hybrid" with the tensorwise recipe), 100 steps from each of 4 seeds: every run learns, the final losses' means over the seeds within 2%, the
              FP8 weights quantized once per step and MoE layer
"""
import faulthandler
import json
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

import moerail.torch.megatron as mm


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def moe_config(world, **kw):
    base = dict(num_layers=1, hidden_size=256, num_attention_heads=4, num_moe_experts=4 * world, moe_router_topk=4,
                moe_ffn_hidden_size=128, ffn_hidden_size=512, gated_linear_unit=True, activation_func=F.silu,
                add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16, moe_token_dispatcher_type="alltoall",
                expert_model_parallel_size=world, moe_aux_loss_coeff=1e-2, hidden_dropout=0.0,
                attention_dropout=0.0, moe_router_dtype="fp32")
    base.update(kw)
    return TransformerConfig(**base)


def build(cfg, kind, seed):
    """kind: alltoall (Megatron's), moerail-dispatcher (moerail's dispatcher, SequentialMLP), moerail (both)."""
    spec = get_moe_module_spec(use_te=False, num_experts=cfg.num_moe_experts, moe_grouped_gemm=False)
    if kind != "alltoall":
        spec = mm.use_moerail(spec, experts=(kind == "moerail"))
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return spec(config=cfg, layer_number=1).cuda()


def expert_weights(layer):
    """[(fc1 [F1, H], fc2 [H, F])] of every local expert, and their gradients."""
    ex = layer.experts
    if isinstance(ex, mm.MoerailExperts):
        g1 = ex.weight1.grad if ex.weight1.grad is not None else torch.zeros_like(ex.weight1)
        g2 = ex.weight2.grad if ex.weight2.grad is not None else torch.zeros_like(ex.weight2)
        return [(ex.weight1[i], ex.weight2[i], g1[i], g2[i]) for i in range(ex.num_local_experts)]
    out = []
    for e in ex.local_experts:
        w1, w2 = e.linear_fc1.weight, e.linear_fc2.weight
        out.append((w1, w2, w1.grad if w1.grad is not None else torch.zeros_like(w1),
                    w2.grad if w2.grad is not None else torch.zeros_like(w2)))
    return out


def run_layer(layer, x, d_out):
    x = x.clone().requires_grad_()
    out, _ = layer(x)
    out.backward(d_out)
    torch.cuda.synchronize()
    return out.detach(), x.grad, layer.router.weight.grad.clone()


def check_layer(rank, world, out_dir):
    figures = {}
    # dropless; capacity factor 1 (the router drops); a shared expert run beside the dispatch and combine on its
    # own stream (moe_shared_expert_overlap, the dispatcher's shared-expert calls)
    # own stream (moe_shared_expert_overlap, the dispatcher's shared-expert calls); no auxiliary loss, a sigmoid
    # group-limited router with expert bias and scaling (MoerailRouter's fused top-k; the other cases' aux loss runs
    # Megatron's routing)
    cases = {"dropless": {}, "cap=1.0": dict(moe_expert_capacity_factor=1.0),
             "shared-overlap": dict(moe_shared_expert_intermediate_size=128, moe_shared_expert_overlap=True),
             "fused-router": dict(moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
                                  moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                  moe_router_num_groups=4, moe_router_group_topk=2,
                                  moe_router_topk_scaling_factor=2.5)}
    for case, settings in cases.items():
        cfg = moe_config(world, **settings)
        layers = {k: build(cfg, k, 1234) for k in ("alltoall", "moerail-dispatcher", "moerail")}
        ref = layers["alltoall"]
        # same seed, same values: moerail's experts initialize as SequentialMLP does
        for (a1, a2, _, _), (b1, b2, _, _) in zip(expert_weights(ref), expert_weights(layers["moerail"])):
            assert torch.equal(a1, b1) and torch.equal(a2, b2), "MoerailExperts' initialization differs"
        seq, hid = 64 + 29 * rank, cfg.hidden_size  # a different token count on every rank
        g = torch.Generator(device="cuda").manual_seed(77 + rank)
        x = torch.randn(seq, 2, hid, generator=g, device="cuda").bfloat16()
        d_out = torch.randn(seq, 2, hid, generator=g, device="cuda").bfloat16()
        if case == "fused-router":
            with torch.no_grad():  # a bias that changes the selection (the same on every rank and layer)
                bias = torch.linspace(-0.05, 0.05, cfg.num_moe_experts, device="cuda")
                for layer in layers.values():
                    layer.router.expert_bias.copy_(bias)
                    # Megatron's Float16Module turns the token-count buffer bf16 (the expert bias it keeps fp32)
                    layer.router.local_tokens_per_expert = layer.router.local_tokens_per_expert.bfloat16()
        fused = layers["moerail"].router.fused_refusal()
        assert (fused is None) == (case == "fused-router"), f"{case}: MoerailRouter's fused_refusal() = {fused}"
        results = {k: run_layer(l, x, d_out) for k, l in layers.items()}
        ro, rx, rr = results["alltoall"]
        if cfg.moe_router_enable_expert_bias:  # the counts of the expert-bias update
            for kind in ("moerail-dispatcher", "moerail"):
                assert torch.equal(layers[kind].router.local_tokens_per_expert,
                                   ref.router.local_tokens_per_expert), f"{case} {kind}: tokens per expert differ"
        for kind in ("moerail-dispatcher", "moerail"):
            o, gx, gr = results[kind]
            errs = {"out": rel(o, ro), "dx": rel(gx, rx), "d_router": rel(gr, rr)}
            for i, (ours, theirs) in enumerate(zip(expert_weights(layers[kind]), expert_weights(ref))):
                if theirs[2].norm() > 0:
                    errs[f"dw1[{i}]"] = rel(ours[2], theirs[2])
                    errs[f"dw2[{i}]"] = rel(ours[3], theirs[3])
                else:
                    assert ours[2].norm() == 0, f"expert {i} has no rows but a gradient"
            worst = max(errs.items(), key=lambda kv: kv[1])
            figures[f"{case} {kind}"] = {"worst": worst, "out": errs["out"], "dx": errs["dx"]}
            bad = {k: v for k, v in errs.items() if v > 2e-2}
            assert not bad, f"rank {rank} {case} {kind}: errors above 2e-2: {bad}"
        del layers
    return figures


def check_checkpoint(rank, world, out_dir):
    cfg = moe_config(world)
    theirs = build(cfg, "alltoall", 11)
    ours = build(cfg, "moerail", 99)  # other values: the load must overwrite them
    root = [tempfile.mkdtemp(prefix="moerail-ckpt-") if rank == 0 else None]
    dist.broadcast_object_list(root)
    a, b = os.path.join(root[0], "megatron"), os.path.join(root[0], "moerail")
    if rank == 0:
        os.makedirs(a), os.makedirs(b)
    dist.barrier()
    dist_checkpointing.save(theirs.sharded_state_dict(prefix="mlp."), a)
    ours.load_state_dict({k[len("mlp."):]: v for k, v in
                          dist_checkpointing.load(ours.sharded_state_dict(prefix="mlp."), a).items()})
    for (w1, w2, _, _), (v1, v2, _, _) in zip(expert_weights(ours), expert_weights(theirs)):
        assert torch.equal(w1, v1) and torch.equal(w2, v2), "Megatron -> moerail: weights differ"
    assert torch.equal(ours.router.weight, theirs.router.weight)
    dist_checkpointing.save(ours.sharded_state_dict(prefix="mlp."), b)
    back = build(cfg, "alltoall", 5)
    back.load_state_dict({k[len("mlp."):]: v for k, v in
                          dist_checkpointing.load(back.sharded_state_dict(prefix="mlp."), b).items()})
    for (w1, w2, _, _), (v1, v2, _, _) in zip(expert_weights(back), expert_weights(theirs)):
        assert torch.equal(w1, v1) and torch.equal(w2, v2), "moerail -> Megatron: weights differ"
    return {"experts": len(expert_weights(ours)), "bit_exact": True}


def train_gpt(rank, kind, steps, pp, ep, fp8=None, seed=5):
    """A small GPT (4 layers, 8 experts top-2, H 256, F 256), pipeline parallel pp x expert parallel ep, 1F1B over 4
    microbatches a step, Megatron's DDP and Adam (bf16 with fp32 master weights); kind "alltoall" (Megatron's MoE) or
    "moerail" (use_moerail); fp8: None (bf16), or config.fp8 = "e4m3" with fp8_recipe = fp8 ("blockwise" or
    "tensorwise"), or "tensorwise-hybrid" (config.fp8 = "hybrid" with the tensorwise recipe; set after construction: Megatron's own checks want TransformerEngine for fp8); seed: the weights' initialization (the data is the same for every
    seed). Returns the losses (on the last stage) and how often the FP8 experts quantized their weights."""
    faulthandler.dump_traceback_later(170, exit=True)  # each training its own time (a hung collective shows where)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module
    from moerail.torch.functional import Fp8Weights

    S, mbs, micro, vocab = 128, 2, 4, 1024
    dp_rank = parallel_state.get_data_parallel_rank()
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    cfg = TransformerConfig(
        num_layers=4, hidden_size=256, num_attention_heads=4, num_moe_experts=8, moe_router_topk=2,
        moe_ffn_hidden_size=256, ffn_hidden_size=512, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        pipeline_model_parallel_size=pp, expert_model_parallel_size=ep, moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=1e-2, hidden_dropout=0.0, attention_dropout=0.0, moe_router_dtype="fp32")
    if fp8:  # "tensorwise-hybrid": fp8 = "hybrid" (e5m2 gradients) with the tensorwise recipe
        cfg.fp8, cfg.fp8_recipe = ("hybrid", "tensorwise") if fp8 == "tensorwise-hybrid" else ("e4m3", fp8)
    spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)
    if kind == "moerail":
        spec = mm.use_moerail(spec)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    model = Float16Module(cfg, GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=vocab,
                                        max_sequence_length=S, pre_process=first, post_process=last,
                                        share_embeddings_and_output_weights=False).cuda())
    ddp = DistributedDataParallel(config=cfg, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                  module=model)
    cfg.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, weight_decay=0.0, bf16=True,
                                                 params_dtype=torch.bfloat16, clip_grad=1.0), [ddp])
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool, device="cuda"), 1)[None, None]
    pos = torch.arange(S, device="cuda")[None].expand(mbs, S)

    def batches(step):
        g = torch.Generator(device="cuda").manual_seed(1000 * step + dp_rank)
        for _ in range(micro):
            tok = torch.randint(0, vocab, (mbs, S + 1), generator=g, device="cuda")
            tok[:, 1::2] = (tok[:, 0::2][:, : tok[:, 1::2].shape[1]] * 7 + 3) % vocab  # something to learn
            yield tok[:, :-1].contiguous(), tok[:, 1:].contiguous()

    def step_func(it, m):
        tokens, labels = next(it)

        def loss_func(out):
            loss = out.float().mean()
            return loss, {"lm loss": loss.detach().clone()}  # (the schedule scales `loss` in place)
        return m(tokens, pos, mask, labels=labels), loss_func

    refreshes = [0]
    original = Fp8Weights.refresh

    def counted(self, w1, w2):
        refreshes[0] += 1
        original(self, w1, w2)

    Fp8Weights.refresh = counted
    try:
        fb = get_forward_backward_func()
        losses = []
        for step in range(steps):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            out = fb(forward_step_func=step_func, data_iterator=batches(step), model=[ddp], num_microbatches=micro,
                     seq_length=S, micro_batch_size=mbs, forward_only=False)
            ok, _, _ = opt.step()
            assert ok, f"{kind} step {step}: the optimizer step was skipped"
            if last:
                losses.append(float(torch.stack([o["lm loss"] for o in out]).mean()))
                print(f"{kind}{' fp8' if fp8 else ''} step {step} loss {losses[-1]:.5f} (rank {rank})", flush=True)
    finally:
        Fp8Weights.refresh = original
    if kind == "moerail":
        mm.check(model)
    moe_layers = sum(isinstance(m, mm.MoerailExperts) for m in model.modules())
    del ddp, model, opt
    torch.cuda.empty_cache()
    return losses, refreshes[0], moe_layers


def check_gpt(rank, world, out_dir):
    assert world == 4
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    base, ours = (train_gpt(rank, kind, 20, 2, 2)[0] for kind in ("alltoall", "moerail"))
    figures = {"pp_rank": pp_rank, "alltoall": base, "moerail": ours}
    if parallel_state.is_pipeline_last_stage():
        diffs = [abs(a - b) / abs(a) for a, b in zip(ours, base)]
        figures["max_rel_diff"] = max(diffs)
        assert base[-1] < base[0], f"the alltoall run did not learn: {base}"
        assert max(diffs) <= 0.01, f"loss differs by more than 1% at some step: {diffs}"
    return figures


def check_gpt_fp8(rank, world, out_dir):
    """The GPT with moerail's experts in bf16 and in FP8 (MOERAIL_GPT_FP8_RECIPE), 100 steps from each of several seeds (the FP8
    run of a seed from the bf16 run's initial weights): every run learns (the mean loss of the last 10 steps 0.1
    below the first 10's), the FP8 final loss (mean of the last 10 steps, averaged over the seeds) within 2% of
    bf16's, and the FP8 weights quantized once per step and MoE layer (at the first microbatch Megatron's schedule
    marks; Megatron's optimizer writes the weights through .data, which only that mark catches).

    Several seeds, because one run's final loss is a poor estimate of a recipe's: a top-2 router turns any rounding
    difference into other routing decisions, and 100 steps end in the middle of the descent, where trajectories
    that part early stay apart. Two bf16 runs from one seed that differ only in where the weight gradients are
    rounded (added into fp32 main_grad, or written to bf16 .grad first) end 2.2% apart; the bf16 final losses of
    three seeds spread 3%."""
    pp = 2 if world >= 4 else 1
    steps = int(os.environ.get("MOERAIL_GPT_FP8_STEPS", "100"))
    seeds = [int(v) for v in os.environ.get("MOERAIL_GPT_FP8_SEEDS", "5 6 7 8").split()]
    recipe = os.environ.get("MOERAIL_GPT_FP8_RECIPE", "blockwise")
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    figures = {"pp": pp, "seeds": seeds, "recipe": recipe, "bf16": [], "fp8": [], "refreshes": [], "moe_layers": []}
    for seed in seeds:
        bf16, _, _ = train_gpt(rank, "moerail", steps, pp, world // pp, seed=seed)
        fp8, refreshes, moe_layers = train_gpt(rank, "moerail", steps, pp, world // pp, fp8=recipe, seed=seed)
        for k, v in (("bf16", bf16), ("fp8", fp8), ("refreshes", refreshes), ("moe_layers", moe_layers)):
            figures[k].append(v)
        assert moe_layers > 0 and refreshes == steps * moe_layers, \
            f"seed {seed}: {refreshes} weight quantizations for {steps} steps of {moe_layers} MoE layers (expected " \
            "one per step and layer)"
    if parallel_state.is_pipeline_last_stage():
        final = {k: [mean(v[-10:]) for v in figures[k]] for k in ("bf16", "fp8")}
        figures["final"] = final
        figures["ratio_by_seed"] = [f / b for f, b in zip(final["fp8"], final["bf16"])]
        figures["final_ratio"] = mean(final["fp8"]) / mean(final["bf16"])
        for k in ("bf16", "fp8"):
            for seed, v in zip(seeds, figures[k]):
                assert mean(v[-10:]) < mean(v[:10]) - 0.1, f"the {k} run of seed {seed} did not learn: {v}"
        assert abs(figures["final_ratio"] - 1) <= 0.02, \
            f"{recipe}: final loss fp8 / bf16 = {figures['final_ratio']:.4f} (mean over seeds {seeds}; by seed " \
            f"{[round(r, 4) for r in figures['ratio_by_seed']]})"
    return figures


def main():
    check, out_dir = sys.argv[1], sys.argv[2]
    faulthandler.dump_traceback_later(170, exit=True)  # a hung collective shows where it hangs
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    if check == "gpt":
        parallel_state.initialize_model_parallel(1, 2, expert_model_parallel_size=2)
    elif check == "gpt-fp8":
        pp = 2 if world >= 4 else 1
        parallel_state.initialize_model_parallel(1, pp, expert_model_parallel_size=world // pp)
    else:
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    try:
        figures = {"layer": check_layer, "checkpoint": check_checkpoint, "gpt": check_gpt,
                   "gpt-fp8": check_gpt_fp8}[check](rank, world, out_dir)
    except BaseException:  # report now: the other ranks may wait in a collective for this one forever
        traceback.print_exc()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(1)
    with open(os.path.join(out_dir, f"{check}.rank{rank}.json"), "w") as f:
        json.dump({"ok": True, "world": world, **figures}, f, indent=1)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
