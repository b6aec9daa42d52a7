"""moerail.torch.MoELayer against the plain PyTorch layer (moerail.torch.testing)."""
import gc

import pytest
import torch
from conftest import DEVICES, rel_err

import moerail
import moerail.torch as mt
from moerail.torch.testing import torch_moe_layer

LAYERS = {
    "softmax-swiglu": dict(hidden=128, ffn_hidden=64, num_experts=8, topk=2, align=16),
    "deepseek-like": dict(hidden=256, ffn_hidden=128, num_experts=16, topk=4, align=8, score_function="sigmoid",
                          num_groups=4, group_topk=2, use_expert_bias=True, scaling_factor=2.5,
                          aux_loss_coeff=0.01, z_loss_coeff=0.001, shared_expert_ffn=64),
    "in-combine-geglu": dict(hidden=128, ffn_hidden=64, num_experts=8, topk=3, activation="geglu",
                             prob_mode="in-combine", capacity_factor=2.0),
}


def compare_with_torch(layer, x, d_out, topk_idx=None, group=None):
    """Runs layer forward + backward and the plain PyTorch layer on the same weights; returns {name: rel err}."""
    x = x.clone().requires_grad_()
    out = layer(x)
    (out.float() * d_out).sum().backward()
    names = layer._param_names
    ref_params = {n: getattr(layer, n).detach().float().clone().requires_grad_() for n in names}
    rx = x.detach().clone().requires_grad_()
    if topk_idx is None and x.device.type == "cuda":
        topk_idx = layer.routing()[0]  # the layer's own selection: no near-tie flips between the two GEMMs
    ref_out, aux, z = torch_moe_layer(layer.cfg, rx, ref_params["router_weight"].to(x.dtype), ref_params["w1"],
                                      ref_params["w2"], ref_params.get("b1"), ref_params.get("b2"),
                                      ref_params.get("shared_w1"), ref_params.get("shared_w2"), layer.expert_bias,
                                      group=group, topk_idx=topk_idx)
    ((ref_out * d_out).sum() + aux + z).backward()
    errs = {"out": rel_err(out, ref_out), "dx": rel_err(x.grad, rx.grad),
            "aux": abs(float(layer.aux_loss) - float(aux)), "z": abs(float(layer.z_loss) - float(z))}
    for n in names:
        errs["d_" + n] = rel_err(getattr(layer, n).grad, ref_params[n].grad)
    return errs


def check_layer_matches_plain_torch(device, kind, seed, **layer_options):
    torch.manual_seed(seed)
    cfg = moerail.make_config(max_tokens=512, **LAYERS[kind])
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layer = moerail.torch.MoELayer(cfg, device=device, dtype=dtype, **layer_options)
    if layer.expert_bias is not None:
        layer.expert_bias.uniform_(-0.1, 0.1)
    x = torch.randn(300, cfg.hidden, device=device).to(dtype)
    errs = compare_with_torch(layer, x, torch.randn(300, cfg.hidden, device=device))
    tol = 1e-2 if device == "cuda" else 1e-5
    bad = {k: v for k, v in errs.items() if v > tol}
    assert not bad, f"errors above {tol}: {bad} (all: {errs})"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", LAYERS)
def test_layer_matches_plain_torch(device, kind):
    check_layer_matches_plain_torch(device, kind, 4)


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_layer_matches_plain_torch(device):
    """chunks = 4: the tokens in four chunks (the last partial, 300 of 512), dispatch and combine beside the GEMMs."""
    check_layer_matches_plain_torch(device, "deepseek-like", 6, chunks=4)
    cfg = moerail.make_config(max_tokens=512, **LAYERS["deepseek-like"])
    with pytest.raises(ValueError, match="chunks = 3"):
        moerail.torch.MoELayer(cfg, device=device, chunks=3)  # does not divide 512


FP8_LAYER = dict(hidden=256, ffn_hidden=128, num_experts=16, topk=4, align=16, score_function="sigmoid",
                 num_groups=4, group_topk=2, use_expert_bias=True, aux_loss_coeff=0.01, shared_expert_ffn=128)


@pytest.mark.parametrize("recipe", ["fp8-blockwise", "fp8-tensor", "fp8-tensor-hybrid"])
@pytest.mark.parametrize("device", DEVICES)
def test_fp8_layer_is_the_recipes_distance_from_bf16(device, recipe):
    """each FP8 recipe against the plain PyTorch layer on the same weights: the FP8 rounding of every GEMM operand
    (~2.6% RMS each in e4m3, twice that for the hybrid recipe's e5m2 gradients) puts the outputs and gradients a few
    percent away, not more (the C++ tests hold the GPU step to the FP8 reference itself; on the CPU the layer is
    that reference)."""
    torch.manual_seed(8)
    cfg = moerail.make_config(max_tokens=512, **FP8_LAYER)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layer = mt.MoELayer(cfg, device=device, dtype=dtype, recipe=recipe)
    layer.expert_bias.uniform_(-0.1, 0.1)
    x = torch.randn(300, cfg.hidden, device=device).to(dtype)
    errs = compare_with_torch(layer, x, torch.randn(300, cfg.hidden, device=device))
    bound = 0.3 if recipe == "fp8-tensor-hybrid" else 0.15
    bad = {k: v for k, v in errs.items() if v > bound}
    assert not bad, f"errors above {bound}: {bad} (all: {errs})"
    assert errs["out"] > 1e-3, f"the FP8 recipe's output equals bf16's: was it applied? ({errs})"


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_weight_grads_in_bf16(device):
    """fp8_weight_grads="bf16": the same forward and data gradients, bit for bit, as the recipe's FP8 weight
    gradients, and other weight gradients (no quantized copies of their operands), within the recipe's distance of
    bf16."""
    torch.manual_seed(10)
    cfg = moerail.make_config(max_tokens=512, **FP8_LAYER)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = mt.MoELayer(cfg, device=device, dtype=dtype, recipe="fp8-blockwise")
    b = mt.MoELayer(cfg, device=device, dtype=dtype, recipe="fp8-blockwise", fp8_weight_grads="bf16")
    a.expert_bias.uniform_(-0.1, 0.1)
    b.load_state_dict(a.state_dict())
    x = torch.randn(300, cfg.hidden, device=device).to(dtype)
    dy = torch.randn(300, cfg.hidden, device=device).to(dtype)
    outs, dxs = [], []
    for layer in (a, b):
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        out.backward(dy)
        outs.append(out.detach())
        dxs.append(xi.grad)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(dxs[0], dxs[1])
    for n in ("w1", "w2"):
        ga, gb = getattr(a, n).grad.float(), getattr(b, n).grad.float()
        assert not torch.equal(ga, gb), f"d{n}: the same bits in both: was the option applied?"
        assert (ga - gb).norm() / gb.norm() < 0.15, n
    b.zero_grad(set_to_none=True)
    errs = compare_with_torch(b, x, torch.randn(300, cfg.hidden, device=device))
    bad = {k: v for k, v in errs.items() if v > 0.15}
    assert not bad, f"errors above 0.15: {bad} (all: {errs})"


def test_per_tensor_fp8_recipes_on_the_reference_backend():
    """recipes fp8-tensor and fp8-tensor-hybrid (CPU reference backend): both near the plain PyTorch layer on the same
    weights; the hybrid one's forward is fp8-tensor's, its e5m2 gradients differ; both differ from fp8-blockwise."""
    torch.manual_seed(10)
    cfg = moerail.make_config(max_tokens=256, **FP8_LAYER)
    x, d = torch.randn(200, cfg.hidden), torch.randn(200, cfg.hidden)
    outs, grads = {}, {}
    for recipe in ("fp8-tensor", "fp8-tensor-hybrid", "fp8-blockwise"):
        torch.manual_seed(11)
        layer = mt.MoELayer(cfg, device="cpu", dtype=torch.float32, recipe=recipe)
        errs = compare_with_torch(layer, x, d)
        bound = 0.3 if recipe == "fp8-tensor-hybrid" else 0.15
        bad = {k: v for k, v in errs.items() if v > bound}
        assert not bad, f"{recipe}: errors above {bound}: {bad} (all: {errs})"
        assert errs["out"] > 1e-3, f"{recipe}: the output equals bf16's: was the recipe applied? ({errs})"
        xi = x.clone().requires_grad_()
        outs[recipe] = layer(xi)
        outs[recipe].backward(d)
        grads[recipe] = (xi.grad, layer.w1.grad)
    assert torch.equal(outs["fp8-tensor"], outs["fp8-tensor-hybrid"])
    assert not torch.equal(grads["fp8-tensor"][0], grads["fp8-tensor-hybrid"][0])
    assert not torch.equal(outs["fp8-tensor"], outs["fp8-blockwise"])

def test_fp8_recipe_is_checked():
    cfg = moerail.make_config(max_tokens=64, **FP8_LAYER)
    with pytest.raises(ValueError, match="recipe = 'fp4'"):
        mt.MoELayer(cfg, device="cpu", recipe="fp4")
    with pytest.raises(ValueError, match="fp8_weight_grads = 'fp16'"):
        mt.MoELayer(cfg, device="cpu", recipe="fp8-blockwise", fp8_weight_grads="fp16")
    L, H, F = cfg.local_experts, cfg.hidden, cfg.ffn_hidden
    x, probs = torch.randn(8, H), torch.rand(8)
    w1, w2 = torch.randn(L, cfg.fc1_out, H), torch.randn(L, H, F)
    with pytest.raises(ValueError, match="fp8_weight_grads = 'e5m2'"):
        moerail.torch.grouped_mlp(x, probs, torch.tensor([8] + [0] * (L - 1)), w1, w2, cfg, recipe="fp8-blockwise",
                                  fp8_weight_grads="e5m2")


@pytest.mark.gpu
def test_fp8_weights_follow_the_weights():
    """The FP8 weights are made again when w1 or w2 changed in place (an optimizer step), and only then: the
    output after a change equals a fresh layer's on the changed weights, bit for bit."""
    torch.manual_seed(9)
    cfg = moerail.make_config(max_tokens=256, **FP8_LAYER)
    a = mt.MoELayer(cfg, recipe="fp8-blockwise")
    b = mt.MoELayer(cfg, recipe="fp8-blockwise")
    b.load_state_dict(a.state_dict())
    x = torch.randn(200, cfg.hidden, device="cuda").bfloat16()
    with torch.no_grad():
        first = a(x)
        a.w1.mul_(1.5)  # in place, as an optimizer updates
        a.w2.add_(0.01)
        second = a(x)
        b.w1.mul_(1.5)
        b.w2.add_(0.01)
        fresh = b(x)
    assert not torch.equal(first, second), "the forward after an update ran on the old FP8 weights"
    assert torch.equal(second, fresh)
    # a write through .data is not counted by PyTorch: the optimizer hook quantizes after every step regardless
    opt = torch.optim.SGD(a.parameters(), lr=0.0)
    handle = a.refresh_fp8_weights_after(opt)
    with torch.no_grad():
        a.w1.data.mul_(0.5)
        b.w1.mul_(0.5)
        opt.step()
        after_hook = a(x)
        assert torch.equal(after_hook, b(x))
    handle.remove()
    with pytest.raises(RuntimeError, match="recipe is bf16"):
        mt.MoELayer(cfg).refresh_fp8_weights()


@pytest.mark.gpu
@pytest.mark.parametrize("wgrad", ["fp8", "bf16"])
def test_fp8_fused_wgrad_accumulation_into_fp32_main_grad(wgrad):
    """recipe fp8-blockwise with fuse_wgrad_accumulation: the weight-gradient GEMMs add their fp32 sums g into
    float32 main_grad. Into zeros, g's bf16 rounding is the plain FP8 layer's gradient bit for bit; into other
    values, main_grad becomes old + g in fp32, bit for bit; the other gradients as the plain layer's; a bfloat16
    main_grad is refused, naming it."""
    torch.manual_seed(13)
    cfg = moerail.make_config(max_tokens=256, **FP8_LAYER)
    plain = mt.MoELayer(cfg, recipe="fp8-blockwise", fp8_weight_grads=wgrad)
    fused = mt.MoELayer(cfg, recipe="fp8-blockwise", fp8_weight_grads=wgrad, fuse_wgrad_accumulation=True)
    fused.load_state_dict(plain.state_dict())
    for n in ("w1", "w2"):
        p = getattr(fused, n)
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        p.grad_added_to_main_grad = False
    x = torch.randn(200, cfg.hidden, device="cuda").bfloat16()
    d = torch.randn(200, cfg.hidden, device="cuda").bfloat16()
    dx = []
    for layer in (plain, fused):
        xi = x.clone().requires_grad_()
        layer(xi).backward(d)
        dx.append(xi.grad)
    assert torch.equal(dx[0], dx[1])
    g = {n: getattr(fused, n).main_grad.clone() for n in ("w1", "w2")}
    for n in ("w1", "w2"):
        assert torch.count_nonzero(g[n]) > 0, n
        assert torch.equal(g[n].to(torch.bfloat16), getattr(plain, n).grad), f"bf16({n} fp32 gradient) != plain"
        p = getattr(fused, n)
        assert p.grad_added_to_main_grad and p.grad.shape == p.shape  # Megatron's placeholder
    for n in ("router_weight",) + tuple(n for n in ("shared_w1", "shared_w2") if getattr(plain, n) is not None):
        assert torch.equal(getattr(fused, n).grad, getattr(plain, n).grad), n
    old = {n: torch.randn_like(g[n]) for n in g}
    for n in g:
        getattr(fused, n).main_grad.copy_(old[n])
    fused(x).backward(d)
    for n in g:
        assert torch.equal(getattr(fused, n).main_grad, old[n] + g[n]), f"{n}.main_grad is not old + g in fp32"
    for n in ("w1", "w2"):
        getattr(fused, n).main_grad = getattr(fused, n).main_grad.bfloat16()
    with pytest.raises(ValueError, match="w1.main_grad is torch.bfloat16.*float32 main_grad only"):
        fused(x).backward(d)


@pytest.mark.gpu
def test_layer_graph_replay_equals_eager():
    """Forward + backward captured with torch.cuda.graph, replayed with new inputs: the same bits as eager steps."""
    torch.manual_seed(5)
    cfg = moerail.make_config(max_tokens=256, **LAYERS["deepseek-like"])
    layer = mt.MoELayer(cfg, check=False)
    static_x = torch.randn(256, cfg.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    static_d = torch.randn(256, cfg.hidden, device="cuda", dtype=torch.bfloat16)

    def step():
        for p in layer.parameters():
            p.grad = None
        static_x.grad = None
        out = layer(static_x)
        out.backward(static_d)
        return out

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up outside the graph (the host-API transport connects on first use)
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    static_x.grad = None
    for p in layer.parameters():
        p.grad = None
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
        static_out.backward(static_d)
    graph_outputs = [static_out, static_x.grad] + [p.grad for p in layer.parameters()]  # the graph's own memory
    for trial in range(3):
        with torch.no_grad():
            static_x.copy_(torch.randn_like(static_x))
            static_d.copy_(torch.randn_like(static_d))
        graph.replay()
        got = [t.clone() for t in graph_outputs]
        eager_out = step()
        want = [eager_out, static_x.grad] + [p.grad for p in layer.parameters()]
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"replay {trial}: tensor {i} differs from the eager step"


@pytest.mark.gpu
def test_fused_wgrad_accumulation_into_main_grad():
    """fuse_wgrad_accumulation: the expert weights' gradients are added into main_grad by the kernels, bit for bit
    bf16(main_grad + g) with g the gradient the plain layer returns; Megatron's flags; the other gradients as before."""
    torch.manual_seed(11)
    cfg = moerail.make_config(max_tokens=512, fc1_bias=True, fc2_bias=True, **LAYERS["deepseek-like"])
    plain = mt.MoELayer(cfg)
    fused = mt.MoELayer(cfg, fuse_wgrad_accumulation=True)
    with torch.no_grad():  # biases that are not zero
        for n in ("b1", "b2"):
            getattr(plain, n).normal_(0.0, 0.1)
    fused.load_state_dict(plain.state_dict())
    experts = [n for n in ("w1", "w2", "b1", "b2") if getattr(plain, n) is not None]
    old = {}
    for n in experts:
        p = getattr(fused, n)
        old[n] = torch.randn_like(p, dtype=torch.float32).to(p.dtype)
        p.main_grad = old[n].clone()
        p.grad_added_to_main_grad = False
    fused.w2.zero_out_wgrad = True
    del fused.b1.grad_added_to_main_grad  # no Megatron flag: autograd gets no gradient for b1
    x = torch.randn(300, cfg.hidden, device="cuda", dtype=torch.bfloat16)
    d = torch.randn(300, cfg.hidden, device="cuda", dtype=torch.bfloat16)
    for layer in (plain, fused):
        xi = x.clone().requires_grad_()
        layer(xi).backward(d)
        layer.dx = xi.grad
    assert torch.equal(plain.dx, fused.dx)
    for n in experts:
        p = getattr(fused, n)
        want = (old[n].float() + getattr(plain, n).grad.float()).to(p.dtype)
        assert torch.equal(p.main_grad, want), f"{n}.main_grad is not bf16(old + g)"
    assert fused.w1.grad_added_to_main_grad and fused.w2.grad_added_to_main_grad
    assert fused.w1.grad is not None and fused.w1.grad.shape == fused.w1.shape  # the placeholder
    assert torch.count_nonzero(fused.w2.grad) == 0  # zero_out_wgrad: zeros
    assert fused.b1.grad is None
    for n in ("router_weight", "shared_w1", "shared_w2"):
        assert torch.equal(getattr(fused, n).grad, getattr(plain, n).grad), n

    fused.w1.main_grad = fused.w1.main_grad.float()  # w1 fp32, w2 bf16
    with pytest.raises(ValueError, match="w2.main_grad is torch.bfloat16 but w1.main_grad is torch.float32"):
        fused(x).backward(d)
    fused.w1.main_grad = fused.w1.main_grad.half()
    with pytest.raises(ValueError, match="w1.main_grad is torch.float16"):
        fused(x).backward(d)
    del fused.w1.main_grad
    with pytest.raises(ValueError, match="w1.main_grad is absent"):
        fused(x).backward(d)


@pytest.mark.gpu
def test_fused_wgrad_accumulation_into_fp32_main_grad():
    """fp32 main_grad (Megatron-LM's under bf16 training): the kernels add the GEMMs' fp32 sums g, whose bf16
    rounding is the plain layer's gradient bit for bit; main_grad becomes old + g in fp32, bit for bit."""
    torch.manual_seed(12)
    cfg = moerail.make_config(max_tokens=512, fc1_bias=True, fc2_bias=True, **LAYERS["deepseek-like"])
    plain = mt.MoELayer(cfg)
    fused = mt.MoELayer(cfg, fuse_wgrad_accumulation=True)
    with torch.no_grad():
        for n in ("b1", "b2"):
            getattr(plain, n).normal_(0.0, 0.1)
    fused.load_state_dict(plain.state_dict())
    experts = [n for n in ("w1", "w2", "b1", "b2") if getattr(plain, n) is not None]
    for n in experts:
        p = getattr(fused, n)
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        p.grad_added_to_main_grad = False
    x = torch.randn(300, cfg.hidden, device="cuda", dtype=torch.bfloat16)
    d = torch.randn(300, cfg.hidden, device="cuda", dtype=torch.bfloat16)
    plain(x).backward(d)
    fused(x).backward(d)  # into zeros: g
    g = {n: getattr(fused, n).main_grad.clone() for n in experts}
    for n in experts:
        assert torch.equal(g[n].to(torch.bfloat16), getattr(plain, n).grad), f"bf16({n} fp32 gradient) != bf16 one"
    old = {n: torch.randn_like(g[n]) for n in experts}
    for n in experts:
        getattr(fused, n).main_grad.copy_(old[n])
    fused(x).backward(d)
    for n in experts:
        assert torch.equal(getattr(fused, n).main_grad, old[n] + g[n]), f"{n}.main_grad is not old + g in fp32"


def test_fused_wgrad_accumulation_needs_cuda():
    cfg = moerail.make_config(max_tokens=64, **LAYERS["softmax-swiglu"])
    with pytest.raises(ValueError, match="fuse_wgrad_accumulation needs the CUDA backend"):
        mt.MoELayer(cfg, device="cpu", dtype=torch.float32, fuse_wgrad_accumulation=True)


@pytest.mark.parametrize("device", DEVICES)
def test_layer_microbatches_in_flight(device):
    """Four forwards before any backward (a pipeline schedule's warm-up), then the backwards in reverse and in a
    shuffled order: every microbatch's output, input gradient and weight gradients are the bits it gets alone."""
    torch.manual_seed(14)
    cfg = moerail.make_config(max_tokens=256, **LAYERS["deepseek-like"])
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layer = mt.MoELayer(cfg, device=device, dtype=dtype, check=False)
    if layer.expert_bias is not None:
        layer.expert_bias.uniform_(-0.1, 0.1)
    micro = [(torch.randn(n, cfg.hidden, device=device).to(dtype), torch.randn(n, cfg.hidden, device=device).to(dtype))
             for n in (256, 100, 1, 201)]

    def grads():
        g = [p.grad.clone() for p in layer.parameters()]
        for p in layer.parameters():
            p.grad = None
        return g

    alone = []
    for x, d in micro:
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.backward(d)
        alone.append([out.detach(), xi.grad] + grads())
    for order in ((3, 2, 1, 0), (1, 3, 0, 2)):
        xs = [x.clone().requires_grad_() for x, _ in micro]
        outs = [layer(x) for x in xs]
        for i in order:
            outs[i].backward(micro[i][1])
            got = [outs[i].detach(), xs[i].grad] + grads()
            for j, (a, b) in enumerate(zip(got, alone[i])):
                assert torch.equal(a, b), f"order {order}: microbatch {i} tensor {j} differs from it alone"


@pytest.mark.gpu
def test_layer_memory_is_pytorchs():
    """Every device buffer of the layer but its NCCL window comes from PyTorch's allocator: the layer holds exactly its
    workspace from it, memory_allocated grows by that at construction and by the saved bytes per forward in flight,
    and everything goes back to PyTorch's pool."""
    from moerail.torch._common import torch_allocator

    torch.manual_seed(15)
    cfg = moerail.make_config(max_tokens=256, **LAYERS["deepseek-like"])
    x = torch.randn(256, cfg.hidden, device="cuda", dtype=torch.bfloat16)
    pool = torch_allocator(x.device)  # what moerail holds from PyTorch's allocator, exactly
    torch.cuda.synchronize()
    before, held_before = torch.cuda.memory_allocated(), pool.bytes
    layer = mt.MoELayer(cfg, check=False)
    params = sum(p.numel() * p.element_size() for p in layer.parameters()) + sum(
        b.numel() * b.element_size() for b in layer.buffers())
    own = layer.workspace_bytes - layer.window_bytes
    assert own > 0 and pool.bytes - held_before == own, f"moerail holds {pool.bytes - held_before}, expected {own}"
    seen = torch.cuda.memory_allocated() - before - params  # PyTorch rounds each block up to 512 bytes
    assert abs(seen - own) <= 0.01 * own, f"torch sees {seen} bytes, the layer holds {own} (+ window)"
    start = torch.cuda.memory_allocated()
    outs = [layer(x.clone().requires_grad_()) for _ in range(3)]  # three forwards in flight
    grown = torch.cuda.memory_allocated() - start
    assert grown >= 3 * layer.saved_bytes, f"three forwards in flight hold {grown} bytes < 3 x {layer.saved_bytes}"
    for i in range(len(outs)):
        outs[i].backward(torch.ones_like(outs[i]))
    outs = None  # the outputs, their graphs and the inputs' gradients go
    torch.cuda.synchronize()
    for p in layer.parameters():
        p.grad = None
    # what remains: the module's copies of the last routing (a few KiB)
    assert torch.cuda.memory_allocated() - start <= 0.01 * layer.saved_bytes + 65536, "saved state not given back"
    layer = None
    gc.collect()
    torch.cuda.synchronize()
    assert pool.bytes == held_before, f"moerail still holds {pool.bytes - held_before} bytes of PyTorch's memory"
    left = torch.cuda.memory_allocated() - before
    assert left <= 0.01 * own + 65536, f"the layer's buffers not given back: {left} of {own} bytes still allocated"


@pytest.mark.gpu
def test_per_expert_capacity_overflow_is_reported():
    """capacity_factor (per expert): an expert bias that sends every token to the same experts overflows their
    segments; the check names the drop with its counts, and nothing past the buffers is touched."""
    cfg = moerail.make_config(max_tokens=128, capacity_factor=0.5, **LAYERS["deepseek-like"])
    assert cfg.expert_rows > 0 and cfg.rows_per_rank == cfg.local_experts * cfg.expert_rows
    layer = mt.MoELayer(cfg, check=True)
    with torch.no_grad():
        layer.expert_bias.zero_()
        layer.expert_bias[: cfg.topk] = 100.0  # every token to experts 0..K-1 (selection only)
    x = torch.randn(128, cfg.hidden, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(moerail.Error, match=r"routed rows did not fit: the fullest expert needed \d+ rows, "
                                            rf"{cfg.expert_rows} per expert available \(capacity per-expert\(0.5\)\)"):
        layer(x)


@pytest.mark.gpu
def test_layer_graph_with_microbatches_in_flight_and_device_token_counts():
    """Two forwards in flight, then their backwards in reverse, captured once with torch.cuda.graph over token counts
    on the device; replayed with T = 0, 1, T_max and random counts per microbatch: the bits of eager steps over the
    same device counts, outputs and input gradients zero past T."""
    torch.manual_seed(16)
    Tm = 256
    cfg = moerail.make_config(max_tokens=Tm, **LAYERS["deepseek-like"])
    layer = mt.MoELayer(cfg, check=False)
    layer.expert_bias.uniform_(-0.1, 0.1)
    xs = [torch.randn(Tm, cfg.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    ds = [torch.randn(Tm, cfg.hidden, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    nts = [torch.full((1,), Tm, dtype=torch.int32, device="cuda") for _ in range(2)]

    def zero_grads():
        for t in list(layer.parameters()) + xs:
            t.grad = None

    def eager():  # one microbatch at a time
        res = []
        for x, d, nt in zip(xs, ds, nts):
            zero_grads()
            out = layer(x, num_tokens=nt)
            out.backward(d)
            res.append([out.detach().clone(), x.grad.clone()])
        return res

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        eager()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(s)
    zero_grads()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [layer(x, num_tokens=nt) for x, nt in zip(xs, nts)]
        for i in (1, 0):
            outs[i].backward(ds[i])
    g_dx = [x.grad for x in xs]  # the graph's own memory
    for counts in ((0, 1), (Tm, 37), (1, Tm), (200, 0)):
        with torch.no_grad():
            for x, d, nt, T in zip(xs, ds, nts, counts):
                x.copy_(torch.randn_like(x))
                d.copy_(torch.randn_like(d))
                nt.fill_(T)
        graph.replay()
        got = [[outs[i].detach().clone(), g_dx[i].clone()] for i in range(2)]
        want = eager()
        for i, T in enumerate(counts):
            for name, a, b in zip(("out", "dx"), got[i], want[i]):
                assert torch.equal(a, b), f"counts {counts}: microbatch {i} {name} of the replay differs from eager"
                assert not a[T:].any(), f"counts {counts}: microbatch {i} {name} is not zero past T = {T}"
