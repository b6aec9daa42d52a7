"""moerail.torch's ops against plain PyTorch: the reference backend on the CPU, the kernels on a GPU."""
import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, rel_err

import moerail
import moerail.torch as mt
from moerail.torch.layer import activation
from moerail.torch.testing import torch_router


def dtype_of(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


ROUTERS = {
    "softmax-post": dict(score_function="softmax"),
    "softmax-pre": dict(score_function="softmax", pre_softmax=True, aux_loss_coeff=0.01),
    "sigmoid-groups-bias": dict(score_function="sigmoid", num_groups=4, group_topk=2, use_expert_bias=True,
                                scaling_factor=2.5, aux_loss_coeff=0.01, z_loss_coeff=0.001),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ROUTERS)
def test_router_matches_torch(device, kind):
    cfg = moerail.make_config(num_experts=32, topk=4, **ROUTERS[kind])
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(300, 32, generator=g).to(device).requires_grad_()
    bias = (torch.rand(32, generator=g) * 0.2 - 0.1).to(device) if cfg.use_expert_bias else None
    idx, probs, losses = mt.router(logits, cfg, bias)
    ridx, rprobs, aux, z = torch_router(cfg, logits.detach().clone().requires_grad_(), bias)
    assert torch.equal(idx.long().cpu(), ridx.cpu())
    assert rel_err(probs, rprobs) < 1e-5
    assert abs(float(losses[0]) - float(aux)) <= 1e-5 * max(1.0, abs(float(aux)))
    assert abs(float(losses[1]) - float(z)) <= 1e-5 * max(1.0, abs(float(z)))
    # gradients through the weights and both losses
    d = torch.randn(300, 4, generator=g).to(device)
    (probs * d).sum().add(losses.sum()).backward()
    ref_logits = logits.detach().clone().requires_grad_()
    _, w, aux, z = torch_router(cfg, ref_logits, bias, ridx)
    ((w * d).sum() + aux + z).backward()
    assert rel_err(logits.grad, ref_logits.grad) < 1e-4


def random_routing(T, E, K, g, device, drop=0.1):
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int() if T else \
        torch.zeros((0, K), dtype=torch.int32)
    idx[torch.rand(T, K, generator=g) < drop] = -1  # some unrouted slots
    probs = torch.rand(T, K, generator=g)
    return idx.to(device), probs.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prob_mode", ["in-activation", "in-combine"])
def test_dispatch_combine_matches_torch(device, prob_mode):
    T, H, E, K, A = 200, 64, 8, 2, 16
    cfg = moerail.make_config(hidden=H, num_experts=E, topk=K, align=A, max_tokens=256, prob_mode=prob_mode)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, H, generator=g).to(dtype_of(device)).to(device).requires_grad_()
    idx, p = random_routing(T, E, K, g, device)
    p.requires_grad_()
    d = mt.TokenDispatcher(cfg, device=device)
    recv, recv_probs, seg, handle = d.dispatch(x, idx, p)
    assert recv.shape == (d.capacity, H) and seg.shape == (E,)

    # the layout: expert-major, by token then k inside an expert, each segment padded to A with zero rows
    flat = idx.long().flatten().cpu()
    counts = torch.bincount(flat[flat >= 0], minlength=E)
    assert torch.equal(seg.cpu().long(), (counts + A - 1) // A * A)
    row_of = torch.full((T * K,), -1, dtype=torch.long)
    start = 0
    for e in range(E):
        slots = (flat == e).nonzero().flatten()
        n = len(slots)
        row_of[slots] = torch.arange(start, start + n)
        assert torch.equal(recv[start:start + n].cpu(), x.detach()[slots // K].cpu())
        assert torch.equal(recv_probs[start:start + n].cpu(), p.detach().flatten()[slots].cpu())
        assert not recv[start + n:start + int(seg[e])].any() and not recv_probs[start + n:start + int(seg[e])].any()
        start += int(seg[e])
    if device == "cpu":  # the GPU writes only the routed and pad rows (TokenDispatcher's zero_unused_rows)
        assert not recv[start:].any()

    # combine of the experts' output (a leaf here): the weighted (or plain) sum over each token's slots
    y = (torch.randn(d.capacity, H, generator=g)).to(x.dtype).to(device).requires_grad_()
    out = d.combine(y, handle, p)

    # the same in torch ops, with autograd: gradients of <out, d_out> + <recv, d_recv> + <recv_probs, d_rp>
    routed = row_of >= 0
    rows_r, slot_r = row_of[routed].to(device), routed.nonzero().flatten().to(device)
    rx, rp, ry = (t.detach().float().clone().requires_grad_() for t in (x, p, y))
    ref_recv = torch.zeros(d.capacity, H, device=device).index_copy(0, rows_r, rx[slot_r // K])
    ref_rp = torch.zeros(d.capacity, device=device).index_copy(0, rows_r, rp.flatten()[slot_r])
    w = rp.flatten()[slot_r] if prob_mode == "in-combine" else torch.ones(len(slot_r), device=device)
    ref_out = torch.zeros(T, H, device=device).index_add(0, slot_r // K, ry[rows_r] * w[:, None])
    assert rel_err(out, ref_out) < 1e-2
    d_out, d_recv, d_rp = (torch.randn(*s, generator=g).to(device) for s in ((T, H), (d.capacity, H), (d.capacity,)))
    ((out.float() * d_out).sum() + (recv.float() * d_recv).sum() + (recv_probs * d_rp).sum()).backward()
    ((ref_out * d_out).sum() + (ref_recv * d_recv).sum() + (ref_rp * d_rp).sum()).backward()
    assert rel_err(x.grad, rx.grad) < 1e-2
    # d probs under in-combine is <y, d_out> over bf16 data on the GPU (d_out rounded to y's dtype): bf16 bound there
    assert rel_err(p.grad, rp.grad) < (1e-5 if device == "cpu" else 1e-2)
    assert rel_err(y.grad[rows_r], ry.grad[rows_r]) < 1e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act,bias,prob_mode", [("swiglu", False, "in-activation"), ("geglu", True, "in-combine"),
                                                 ("relu2", False, "in-activation"),
                                                 ("quick-geglu", True, "in-activation")])
def test_grouped_mlp_matches_torch(device, act, bias, prob_mode):
    H, F_, L = 128, 64, 4
    cfg = moerail.make_config(hidden=H, ffn_hidden=F_, num_experts=L, topk=1, activation=act, fc1_bias=bias,
                              fc2_bias=bias, prob_mode=prob_mode)
    g = torch.Generator().manual_seed(3)
    dt = dtype_of(device)
    counts = torch.tensor([40, 0, 7, 90], dtype=torch.int32)
    C = 160
    mk = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dt).to(device).requires_grad_()  # noqa
    x, w1, w2 = mk(C, H), mk(L, cfg.fc1_out, H, scale=H ** -0.5), mk(L, H, F_, scale=F_ ** -0.5)
    b1, b2 = (mk(L, cfg.fc1_out, scale=0.1), mk(L, H, scale=0.1)) if bias else (None, None)
    probs = torch.rand(C, generator=g).to(device).requires_grad_()
    y = mt.grouped_mlp(x, probs, counts.to(device), w1, w2, cfg, b1, b2)
    leaves = [t for t in (x, probs, w1, w2, b1, b2) if t is not None]
    refs = [t.detach().float().clone().requires_grad_() for t in leaves]
    rx, rp, rw1, rw2 = refs[:4]
    rb1, rb2 = (refs[4], refs[5]) if bias else (None, None)
    parts, start = [], 0
    for e, n in enumerate(counts.tolist()):
        h = F.linear(rx[start:start + n], rw1[e], None if rb1 is None else rb1[e])
        ye = F.linear(activation(cfg, h), rw2[e], None if rb2 is None else rb2[e])
        parts.append(ye * rp[start:start + n, None] if prob_mode == "in-activation" else ye)
        start += n
    ref = torch.cat(parts)
    rows = int(counts.sum())
    assert rel_err(y[:rows], ref) < 1e-2
    if device == "cpu":  # the GPU writes only the segments' rows
        assert not y[rows:].any()
    dy = torch.randn(rows, H, generator=g).to(device)
    (y[:rows].float() * dy).sum().backward()
    (ref * dy).sum().backward()
    for name, t, r in zip(("x", "probs", "w1", "w2", "b1", "b2"), leaves, refs):
        if name == "probs" and prob_mode == "in-combine":
            assert t.grad is None or not t.grad.any()
            continue
        if name == "x":
            t, r = t.grad[:rows], r.grad[:rows]
        elif name == "probs":
            t, r = t.grad[:rows], r.grad[:rows]
        else:
            t, r = t.grad, r.grad
        assert rel_err(t, r) < 1e-2, name


def _accumulation_case(seed):
    """The fused-accumulation tests' grouped MLP on CUDA: cfg (both biases), counts with an empty expert, x, probs,
    dy, the generator, and two copies of the weights as Parameters (w1, w2, b1, b2): plain and fused."""
    H, F_, L = 128, 64, 4
    cfg = moerail.make_config(hidden=H, ffn_hidden=F_, num_experts=L, topk=1, fc1_bias=True, fc2_bias=True)
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor([40, 0, 7, 90], dtype=torch.int32, device="cuda")
    mk = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(torch.bfloat16).cuda()  # noqa: E731
    x, probs = mk(160, H), torch.rand(160, generator=g).cuda()
    dy = mk(160, H)
    weights = [mk(L, cfg.fc1_out, H, scale=H ** -0.5), mk(L, H, F_, scale=F_ ** -0.5), mk(L, cfg.fc1_out, scale=0.1),
               mk(L, H, scale=0.1)]
    plain = [torch.nn.Parameter(w.clone()) for w in weights]
    fused = [torch.nn.Parameter(w.clone()) for w in weights]
    return cfg, counts, x, probs, dy, g, plain, fused


@pytest.mark.gpu
def test_grouped_mlp_fused_wgrad_accumulation():
    """fuse_wgrad_accumulation: the weight gradients are added into main_grad, bit for bit bf16(old + g) with g the
    gradient of the same call without it; grad_added_to_main_grad and the placeholder; dx and d_probs unchanged."""
    cfg, counts, x, probs, dy, g, plain, fused = _accumulation_case(8)
    old = [(torch.randn(*w.shape, generator=g)).to(torch.bfloat16).cuda() for w in fused]
    for p, o in zip(fused, old):
        p.main_grad = o.clone()
        p.grad_added_to_main_grad = False
    outs = []
    for params, fuse in ((plain, False), (fused, True)):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        w1, w2, b1, b2 = params
        y = mt.grouped_mlp(xi, pi, counts, w1, w2, cfg, b1, b2, fuse_wgrad_accumulation=fuse)
        (y.float() * dy.float()).sum().backward()
        rows = int(counts.sum())  # the rows of the segments: the rest is not written
        outs.append((y[:rows], xi.grad[:rows], pi.grad[:rows]))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    for name, p, q, o in zip(("w1", "w2", "b1", "b2"), plain, fused, old):
        assert torch.equal(q.main_grad, (o.float() + p.grad.float()).to(torch.bfloat16)), name
        assert q.grad_added_to_main_grad and q.grad.shape == q.shape, name
    del fused[0].main_grad
    with pytest.raises(ValueError, match="w1.main_grad is absent"):
        mt.grouped_mlp(x, probs, counts, *fused[:2], cfg, *fused[2:], fuse_wgrad_accumulation=True)


@pytest.mark.gpu
def test_grouped_mlp_fused_wgrad_accumulation_fp32():
    """fuse_wgrad_accumulation into fp32 main_grad: old + g in fp32, g the GEMMs' fp32 sums (bf16(g) is the plain
    call's gradient bit for bit)."""
    cfg, counts, x, probs, dy, g, plain, fused = _accumulation_case(9)
    for p in fused:
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda")
        p.grad_added_to_main_grad = False

    def step(params, fuse):
        w1, w2, b1, b2 = params
        y = mt.grouped_mlp(x, probs, counts, w1, w2, cfg, b1, b2, fuse_wgrad_accumulation=fuse)
        (y.float() * dy.float()).sum().backward()

    step(plain, False)
    step(fused, True)  # into zeros: g
    sums = [q.main_grad.clone() for q in fused]
    old = [torch.randn(q.shape, generator=g).cuda() for q in fused]
    for q, o in zip(fused, old):
        q.main_grad.copy_(o)
    step(fused, True)
    for name, p, q, s, o in zip(("w1", "w2", "b1", "b2"), plain, fused, sums, old):
        assert torch.equal(s.to(torch.bfloat16), p.grad), name
        assert torch.equal(q.main_grad, o + s), name


def test_grouped_mlp_fused_wgrad_accumulation_needs_cuda():
    cfg = moerail.make_config(hidden=64, ffn_hidden=32, num_experts=2, topk=1)
    x, w1, w2 = torch.zeros(4, 64), torch.zeros(2, cfg.fc1_out, 64), torch.zeros(2, 64, 32)
    with pytest.raises(ValueError, match="fuse_wgrad_accumulation needs CUDA tensors"):
        mt.grouped_mlp(x, torch.ones(4), torch.tensor([2, 2]), w1, w2, cfg, fuse_wgrad_accumulation=True)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe,wgrad", [("fp8-blockwise", "fp8"), ("fp8-blockwise", "bf16"), ("fp8-tensor", "fp8"),
                                          ("fp8-tensor-hybrid", "fp8")])
def test_grouped_mlp_fp8_on_cuda_is_the_reference_recipe(recipe, wgrad):
    """the FP8 recipes on CUDA (x quantized 1x128 or per expert, FP8 GEMMs, one backward
    call) against the CPU reference of the recipe on the same inputs: y, dx, d_probs, dw1, dw2 within the GPU step's
    own rounding (bf16 intermediates, fp32 sums in another order: ~5e-3 measured over whole tensors; bound 2e-2, the
    recipe's distance from bf16 being ~6e-2). With Fp8Weights reused across calls, and quantized per call without
    it: the same bits. Weights of another layout or another recipe are refused."""
    H, F_, L = 256, 128, 4
    cfg = moerail.make_config(hidden=H, ffn_hidden=F_, num_experts=L, topk=1, prob_mode="in-activation")
    g = torch.Generator().manual_seed(21)
    counts = torch.tensor([70, 0, 129, 41], dtype=torch.int32)
    R = int(counts.sum())
    x = torch.randn(R, H, generator=g).bfloat16()
    probs = torch.rand(R, generator=g) * 0.9 + 0.1
    dy = torch.randn(R, H, generator=g).bfloat16()
    w1 = (torch.randn(L, cfg.fc1_out, H, generator=g) * H ** -0.5).bfloat16()
    w2 = (torch.randn(L, H, F_, generator=g) * F_ ** -0.5).bfloat16()

    def run(device, fp8_weights=None):
        xi = (x.float() if device == "cpu" else x.to(device)).clone().requires_grad_()
        pi = probs.to(device).clone().requires_grad_()  # (a copy: probs itself stays a plain tensor)
        a, b = (torch.nn.Parameter(w.to(device).float() if device == "cpu" else w.to(device)) for w in (w1, w2))
        y = mt.grouped_mlp(xi, pi, counts.to(device), a, b, cfg, recipe=recipe, fp8_weight_grads=wgrad,
                           fp8_weights=fp8_weights)
        y.backward(dy.to(device).to(y.dtype))
        return [t.detach().float().cpu() for t in (y, xi.grad, pi.grad, a.grad, b.grad)]

    ref = run("cpu")
    weights = mt.Fp8Weights(cfg, "cuda", recipe)
    weights.refresh(w1.cuda(), w2.cuda())
    cached, per_call = run("cuda", weights), run("cuda")
    for name, c, p, r in zip(("y", "dx", "d_probs", "dw1", "dw2"), cached, per_call, ref):
        assert torch.equal(c, p), name
        assert rel_err(c, r) < 2e-2, (name, rel_err(c, r))
    other = moerail.make_config(hidden=H, ffn_hidden=2 * F_, num_experts=L, topk=1, prob_mode="in-activation")
    wrong = mt.Fp8Weights(other, "cuda", recipe)  # another layout
    wrong.refresh((torch.randn(L, other.fc1_out, H) * 0.05).bfloat16().cuda(),
                  (torch.randn(L, H, 2 * F_) * 0.05).bfloat16().cuda())
    with pytest.raises(ValueError, match="fp8_weights were made for L"):
        mt.grouped_mlp(x.cuda(), probs.cuda(), counts.cuda(), w1.cuda(), w2.cuda(), cfg, recipe=recipe,
                       fp8_weights=wrong)
    # (fp8-tensor's weights have the hybrid recipe's layout: refused by name all the same)
    other_recipe = {"fp8-blockwise": "fp8-tensor", "fp8-tensor": "fp8-blockwise", "fp8-tensor-hybrid": "fp8-tensor"}[recipe]
    with pytest.raises(ValueError, match=f"fp8_weights were made for recipe '{other_recipe}'"):
        mt.grouped_mlp(x.cuda(), probs.cuda(), counts.cuda(), w1.cuda(), w2.cuda(), cfg, recipe=recipe,
                       fp8_weights=mt.Fp8Weights(cfg, "cuda", other_recipe))
    stale = mt.Fp8Weights(cfg, "cuda", recipe)  # never refreshed
    with pytest.raises(ValueError, match="fp8_weights must be refreshed"):
        mt.grouped_mlp(x.cuda(), probs.cuda(), counts.cuda(), w1.cuda(), w2.cuda(), cfg, recipe=recipe,
                       fp8_weights=stale)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8-blockwise", "fp8-tensor", "fp8-tensor-hybrid"])
def test_grouped_mlp_takes_the_callers_fp8_activations(recipe):
    """quantize_fp8 gives float8_e4m3fn codes and the recipe's scales (the codes times the scales within e4m3's
    rounding of x); grouped_mlp(..., x_fp8=) over them is the call that quantizes x itself, bit for bit, forward and
    every gradient; codes or scales of the wrong shape or dtype, and x_fp8 without an FP8 recipe, are refused."""
    H, F_, L = 256, 128, 4
    cfg = moerail.make_config(hidden=H, ffn_hidden=F_, num_experts=L, topk=1, prob_mode="in-activation")
    g = torch.Generator().manual_seed(31)
    counts = torch.tensor([70, 0, 129, 41], dtype=torch.int32, device="cuda")
    R = 250  # 10 rows past the segments
    x = torch.randn(R, H, generator=g).bfloat16().cuda()
    probs = (torch.rand(R, generator=g) * 0.9 + 0.1).cuda()
    dy = torch.randn(R, H, generator=g).bfloat16().cuda()
    w1 = (torch.randn(L, cfg.fc1_out, H, generator=g) * H ** -0.5).bfloat16().cuda()
    w2 = (torch.randn(L, H, F_, generator=g) * F_ ** -0.5).bfloat16().cuda()
    codes, scales = mt.quantize_fp8(x, cfg, recipe, counts)
    assert codes.dtype == torch.float8_e4m3fn and tuple(codes.shape) == (R, H)
    used = int(counts.sum())
    if recipe == "fp8-blockwise":
        assert tuple(scales.shape) == (R, H // 128)
        deq = (codes.float().view(R, H // 128, 128) * scales[:, :, None]).view(R, H)
    else:
        assert tuple(scales.shape) == (L,)
        seg = torch.repeat_interleave(torch.arange(L, device="cuda"), counts.long())
        deq = codes[:used].float() * scales[seg][:, None]
        assert torch.all(codes[used:].view(torch.uint8) == 0)
    assert rel_err(deq[:used].cpu(), x[:used].float().cpu()) < 4e-2

    def run(x_fp8):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        a, b = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
        y = mt.grouped_mlp(xi, pi, counts, a, b, cfg, recipe=recipe, x_fp8=x_fp8)
        y.backward(dy)
        return [t.detach()[:used] if t.dim() <= 2 and t.shape[0] == R else t.detach()
                for t in (y, xi.grad, pi.grad, a.grad, b.grad)]

    for name, got, want in zip(("y", "dx", "d_probs", "dw1", "dw2"), run((codes, scales)), run(None)):
        assert torch.equal(got, want), name
    with pytest.raises(ValueError, match="x_fp8 has codes"):
        mt.grouped_mlp(x, probs, counts, w1, w2, cfg, recipe=recipe, x_fp8=(codes, scales[:-1]))
    with pytest.raises(ValueError, match=r"x_fp8\[0\] \(codes\) has dtype"):
        mt.grouped_mlp(x, probs, counts, w1, w2, cfg, recipe=recipe, x_fp8=(codes.view(torch.uint8), scales))
    with pytest.raises(ValueError, match="x_fp8 is for an FP8 recipe"):
        mt.grouped_mlp(x, probs, counts, w1, w2, cfg, x_fp8=(codes, scales))
    with pytest.raises(ValueError, match="the FP8 quantizers run on CUDA"):
        mt.quantize_fp8(x.cpu(), cfg, recipe, counts.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("wgrad", ["fp8", "bf16"])
def test_grouped_mlp_fp8_fused_wgrad_accumulation(wgrad):
    """recipe fp8-blockwise with fuse_wgrad_accumulation: the weight gradients are added into float32 main_grad
    (old + the fp32 sums: the plain call's bf16 gradients within their rounding), grad_added_to_main_grad and the
    placeholder; y, dx and d_probs the plain call's bit for bit; a bfloat16 main_grad is refused."""
    H, F_, L = 256, 128, 4
    cfg = moerail.make_config(hidden=H, ffn_hidden=F_, num_experts=L, topk=1, prob_mode="in-activation")
    g = torch.Generator().manual_seed(23)
    counts = torch.tensor([70, 0, 129, 41], dtype=torch.int32, device="cuda")
    R = int(counts.sum())
    x = torch.randn(R, H, generator=g).bfloat16().cuda()
    probs = (torch.rand(R, generator=g) * 0.9 + 0.1).cuda()
    dy = torch.randn(R, H, generator=g).bfloat16().cuda()
    weights = [(torch.randn(L, cfg.fc1_out, H, generator=g) * H ** -0.5).bfloat16().cuda(),
               (torch.randn(L, H, F_, generator=g) * F_ ** -0.5).bfloat16().cuda()]
    old = [torch.randn(w.shape, generator=g).cuda() * 0.05 for w in weights]
    outs, params = [], []
    for fuse in (False, True):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        w1, w2 = (torch.nn.Parameter(w.clone()) for w in weights)
        if fuse:
            for p_, o in zip((w1, w2), old):
                p_.main_grad = o.clone()
                p_.grad_added_to_main_grad = False
        y = mt.grouped_mlp(xi, pi, counts, w1, w2, cfg, recipe="fp8-blockwise", fp8_weight_grads=wgrad,
                           fuse_wgrad_accumulation=fuse)
        y.backward(dy)
        outs.append((y, xi.grad, pi.grad))
        params.append((w1, w2))
    for name, a, b in zip(("y", "dx", "d_probs"), *outs):
        assert torch.equal(a, b), name
    for name, p_, q, o in zip(("w1", "w2"), params[0], params[1], old):
        assert q.grad_added_to_main_grad and q.grad.shape == q.shape, name
        added = q.main_grad - o
        assert rel_err(added, p_.grad.float()) < 1e-2, (name, rel_err(added, p_.grad.float()))
        assert torch.equal(q.main_grad[1], o[1]), name  # expert 1 has no rows: its main_grad is as it was
    w1, w2 = (torch.nn.Parameter(w.clone()) for w in weights)
    for p_ in (w1, w2):
        p_.main_grad = torch.zeros(p_.shape, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="float32 main_grad"):
        mt.grouped_mlp(x, probs, counts, w1, w2, cfg, recipe="fp8-blockwise", fuse_wgrad_accumulation=True)


def test_bad_arguments_are_named():
    cfg = moerail.make_config(hidden=64, num_experts=8, topk=2, max_tokens=16)
    d = mt.TokenDispatcher(cfg, device="cpu")
    x = torch.randn(10, 64)
    idx, p = random_routing(10, 8, 2, torch.Generator().manual_seed(0), "cpu")
    with pytest.raises(ValueError, match="topk_idx"):
        d.dispatch(x, idx.long(), p)
    with pytest.raises(ValueError, match="max_tokens"):
        d.dispatch(torch.randn(20, 64), torch.zeros(20, 2, dtype=torch.int32), torch.zeros(20, 2))
    with pytest.raises(ValueError, match="logits has 7 columns"):
        mt.router(torch.randn(4, 7), cfg)
    bad = idx.clone()
    bad[0, 0] = 99
    with pytest.raises(moerail.Error, match="expert"):
        d.dispatch(x, bad, p)
    with pytest.raises(ValueError, match="ranks_per_node = 2"):
        mt.TokenDispatcher(cfg, device="cpu", ranks_per_node=2)


@pytest.mark.parametrize("device", DEVICES)
def test_dispatcher_microbatches_in_flight(device):
    """Four dispatches (and their combines, out of order) before any backward, then the backward passes in a shuffled
    order, each microbatch with its handle: every gradient and output is the one the microbatch gets alone."""
    T, H, E, K = 96, 64, 8, 2
    cfg = moerail.make_config(hidden=H, num_experts=E, topk=K, align=16, max_tokens=128, prob_mode="in-combine")
    d = mt.TokenDispatcher(cfg, device=device)
    g = torch.Generator().manual_seed(12)
    micro = []
    for i in range(4):
        n = T - 17 * i
        x = torch.randn(n, H, generator=g).to(dtype_of(device)).to(device)
        idx, p = random_routing(n, E, K, g, device)
        y = torch.randn(d.capacity, H, generator=g).to(x.dtype).to(device)
        micro.append((x, idx, p, y, torch.randn(n, H, generator=g).to(device)))

    def leaves(m):
        return [t.clone().requires_grad_() for t in (m[0], m[2], m[3])]

    def alone(m):
        x, p, y = leaves(m)
        recv, recv_probs, seg, h = d.dispatch(x, m[1], p)
        out = d.combine(y, h, p)
        ((out.float() * m[4]).sum() + recv.float().sum() + recv_probs.sum()).backward()
        return [out.detach(), x.grad, p.grad, y.grad[: int(seg.sum())]]  # d_y past the segments is not written

    want = [alone(m) for m in micro]
    ls = [leaves(m) for m in micro]
    fwd = [d.dispatch(l[0], m[1], l[1]) for l, m in zip(ls, micro)]
    outs = {i: d.combine(ls[i][2], fwd[i][3], ls[i][1]) for i in (1, 0, 3, 2)}
    for i in (2, 0, 3, 1):
        m, (recv, recv_probs, seg, _) = micro[i], fwd[i]
        ((outs[i].float() * m[4]).sum() + recv.float().sum() + recv_probs.sum()).backward()
        got = [outs[i].detach(), ls[i][0].grad, ls[i][1].grad, ls[i][2].grad[: int(seg.sum())]]
        for name, a, b in zip(("out", "dx", "d_probs", "d_y"), got, want[i]):
            assert torch.equal(a, b), f"microbatch {i}: {name} differs from the microbatch alone"
    with pytest.raises(ValueError, match="handle must be"):
        d.combine(micro[0][3], None)


@pytest.mark.parametrize("device", DEVICES)
def test_exact_rows_matches_static_buffers(device):
    """exact_rows: recv, y and their gradients have the rows each dispatch brings (the padded segments), and every
    result is the bits of the static-buffer dispatcher's; several handles in flight, one dispatch with no tokens."""
    H, E, K = 64, 8, 2
    cfg = moerail.make_config(hidden=H, num_experts=E, topk=K, align=16, max_tokens=128, prob_mode="in-combine")
    static, exact = mt.TokenDispatcher(cfg, device=device), mt.TokenDispatcher(cfg, device=device, exact_rows=True)
    g = torch.Generator().manual_seed(14)
    micro = []
    for n in (128, 5, 0, 77):
        x = torch.randn(n, H, generator=g).to(dtype_of(device)).to(device)
        idx, p = random_routing(n, E, K, g, device)
        micro.append((x, idx, p, torch.randn(n, H, generator=g).to(device)))

    def run(d, m, y_of):
        x, p = m[0].clone().requires_grad_(), m[2].clone().requires_grad_()
        recv, recv_probs, seg, h = d.dispatch(x, m[1], p)
        y = y_of(recv.detach()).requires_grad_()
        out = d.combine(y, h, p)
        return recv, recv_probs, seg, h, x, p, y, out

    fwd = {}
    for name, d in (("static", static), ("exact", exact)):
        fwd[name] = [run(d, m, lambda r: (r.float() * 0.5 + 1).to(r.dtype)) for m in micro]
    for i in (2, 0, 3, 1):  # the backward passes of the exact dispatcher out of order
        for name in ("static", "exact"):
            recv, recv_probs, seg, h, x, p, y, out = fwd[name][i]
            ((out.float() * micro[i][3]).sum() + recv.float().sum() + recv_probs.sum()).backward()
    for i, m in enumerate(micro):
        a, b = fwd["static"][i], fwd["exact"][i]
        used = int(a[2].sum())
        assert torch.equal(a[2], b[2])
        assert b[0].shape == (max(1, used), H) and b[3].capacity == max(1, used) and a[0].shape[0] == static.capacity
        for what, u, v in (("recv", a[0][:used], b[0][:used]), ("recv_probs", a[1][:used], b[1][:used]),
                           ("out", a[7], b[7]), ("dx", a[4].grad, b[4].grad), ("d_probs", a[5].grad, b[5].grad),
                           ("d_y", a[6].grad[:used], b[6].grad[:used])):
            assert torch.equal(u, v), f"microbatch {i} ({m[0].shape[0]} tokens): {what} differs"
    with pytest.raises(ValueError, match="expected \\(1, 64\\)"):
        exact.combine(torch.zeros(static.capacity, H, dtype=dtype_of(device), device=device), fwd["exact"][2][3],
                      micro[2][2])


@pytest.mark.gpu
def test_device_token_count_graph_replay():
    """router -> dispatch -> grouped_mlp -> combine with the token count on the device, captured once with
    torch.cuda.graph and replayed with T = 0, 1, T_max and random counts: the eager bits, zeros past T."""
    Tm, H, E, K = 128, 64, 8, 2
    cfg = moerail.make_config(hidden=H, ffn_hidden=64, num_experts=E, topk=K, align=16, max_tokens=Tm)
    torch.manual_seed(13)
    d = mt.TokenDispatcher(cfg, check=False)
    router_w = (torch.randn(E, H, device="cuda") * H ** -0.5).bfloat16()
    w1 = (torch.randn(E, cfg.fc1_out, H, device="cuda") * H ** -0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(E, H, cfg.ffn_hidden, device="cuda") * cfg.ffn_hidden ** -0.5).bfloat16().requires_grad_()
    x = torch.randn(Tm, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(Tm, H, device="cuda", dtype=torch.bfloat16)
    nt = torch.zeros(1, dtype=torch.int32, device="cuda")

    def forward_backward():
        for t in (x, w1, w2):
            t.grad = None
        idx, probs, _ = mt.router(x.float() @ router_w.float().t(), cfg, num_tokens=nt)
        recv, recv_probs, seg, h = d.dispatch(x, idx, probs, num_tokens=nt)
        out = d.combine(mt.grouped_mlp(recv, recv_probs, seg, w1, w2, cfg), h)
        out.backward(dy)
        return out

    def step():
        out = forward_backward()
        return [out.detach().clone(), x.grad.clone(), w1.grad.clone(), w2.grad.clone()]

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        nt.fill_(Tm)
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = forward_backward()
    g_res = [g_out, x.grad, w1.grad, w2.grad]  # the graph's own memory
    for T in (0, 1, Tm, 37, 100):
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
            dy.copy_(torch.randn_like(dy))
        nt.fill_(T)
        graph.replay()
        got = [t.clone() for t in g_res]
        want = step()
        for name, a, b in zip(("out", "dx", "dw1", "dw2"), got, want):
            assert torch.equal(a, b), f"T = {T}: {name} of the replay differs from the eager step"
        assert not got[0][T:].any() and not got[1][T:].any(), f"T = {T}: rows past T are not zero"
        if T > 0:  # the eager step with a host count (x[:T]) gives the same rows
            xs = x.detach()[:T].clone()
            idx2, p2, _ = mt.router((x.detach().float() @ router_w.float().t())[:T], cfg)  # the same logits
            r2, rp2, seg2, h2 = d.dispatch(xs, idx2, p2)
            out2 = d.combine(mt.grouped_mlp(r2, rp2, seg2, w1.detach(), w2.detach(), cfg), h2)
            assert torch.equal(out2, got[0][:T]), f"T = {T}: out differs from the host-count step"
