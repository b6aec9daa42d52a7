"""Expert parallelism over a torch.distributed NCCL group (two and four GPUs, one process each): MoELayer against the
plain PyTorch layer with all_to_all_single, each rank with its own token count, and microbatches in flight."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOKENS = [300, 123, 64, 257]  # a different token count on every rank (the first `world` of them)


def _worker(rank, world, init_file, transport, result_dir):
    from test_layer import LAYERS, compare_with_torch

    import moerail
    import moerail.torch as mt

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for kind in ("softmax-swiglu", "deepseek-like"):
            cfg = moerail.make_config(max_tokens=512, ep_size=world, **LAYERS[kind])
            torch.manual_seed(7)  # replicated weights (router, shared expert) equal on every rank ...
            layer = mt.MoELayer(cfg, transport=transport)
            with torch.no_grad():  # ... the experts this rank's own
                g = torch.Generator(device="cuda").manual_seed(100 + rank)
                for w in (layer.w1, layer.w2):
                    w.copy_(torch.randn(w.shape, generator=g, device="cuda") * w.shape[-1] ** -0.5)
                if layer.expert_bias is not None:
                    layer.expert_bias.copy_(torch.linspace(-0.1, 0.1, cfg.num_experts))
            g = torch.Generator(device="cuda").manual_seed(200 + rank)
            x = torch.randn(TOKENS[rank], cfg.hidden, generator=g, device="cuda").bfloat16()
            d_out = torch.randn(TOKENS[rank], cfg.hidden, generator=g, device="cuda")
            errs = compare_with_torch(layer, x, d_out, group=dist.group.WORLD)
            bad = {k: v for k, v in errs.items() if v > 1e-2}
            assert not bad, f"rank {rank} {kind} {transport}: errors above 1e-2: {bad} (all: {errs})"
            check_microbatches_in_flight(layer, x, d_out, rank, f"{kind} {transport}")
        open(os.path.join(result_dir, f"ok{rank}"), "w").close()
    finally:
        dist.destroy_process_group()


def check_microbatches_in_flight(layer, x, d_out, rank, what):
    """Three forwards in flight over the group (a different token count on every rank and microbatch), the backwards
    in shuffled order: each microbatch's output and gradients are the bits it gets alone."""
    micro = [(x[: len(x) - 40 * i].clone(), d_out[: len(x) - 40 * i].clone()) for i in range(3)]

    def grads():
        g = [p.grad.clone() for p in layer.parameters()]
        for p in layer.parameters():
            p.grad = None
        return g

    for p in layer.parameters():
        p.grad = None
    alone = []
    for xi, di in micro:
        xi = xi.clone().requires_grad_()
        out = layer(xi)
        out.backward(di.to(out.dtype))
        alone.append([out.detach(), xi.grad] + grads())
    xs = [xi.clone().requires_grad_() for xi, _ in micro]
    outs = [layer(xi) for xi in xs]
    for i in (1, 2, 0):
        outs[i].backward(micro[i][1].to(outs[i].dtype))
        got = [outs[i].detach(), xs[i].grad] + grads()
        for j, (a, b) in enumerate(zip(got, alone[i])):
            assert torch.equal(a, b), f"rank {rank} {what}: microbatch {i} tensor {j} differs from it alone"


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("transport", ["nvlink", "host"])
@pytest.mark.parametrize("world", [2, 4])
def test_layer_over_ranks_matches_plain_torch(world, transport):
    if torch.cuda.device_count() < world:
        pytest.skip(f"fewer than {world} CUDA GPUs")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "init"), transport, d), nprocs=world, join=True)
        assert all(os.path.exists(os.path.join(d, f"ok{r}")) for r in range(world))
