"""moerail inside Megatron-core (moerail.torch.megatron), against the real megatron-core package; skipped without it.

On the CPU (one rank, gloo): the configuration derived from a TransformerConfig and its errors, the spec switch,
the token dispatcher's six calls with identity experts (the CPU reference backend), MoerailExperts' initialization,
state dicts in SequentialMLP's and TEGroupedMLP's keys and the sharded state dict, against Megatron's SequentialMLP.
On 2 and 4 GPUs: megatron_worker.py's checks (layer against Megatron's alltoall layer, checkpoint round trip, the
pipeline-parallel GPT run), each in processes of its own.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

megatron = pytest.importorskip("megatron.core", reason="megatron-core is not installed")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import rel_err  # noqa: E402

import moerail  # noqa: E402

mm = pytest.importorskip("moerail.torch.megatron")


@pytest.fixture(scope="module")
def one_rank():
    """Megatron's parallel state over one CPU rank (gloo), for the module's tests."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    yield get_default_pg_collection()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def tconfig(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig
    base = dict(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_router_topk=2,
                moe_ffn_hidden_size=32, ffn_hidden_size=128, gated_linear_unit=True, activation_func=F.silu,
                add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=True,
                moe_token_dispatcher_type="alltoall")
    base.update(kw)
    return TransformerConfig(**base)


def sequential_mlp(cfg, pg):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    return SequentialMLP(cfg.num_moe_experts, cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                 linear_fc2=RowParallelLinear), pg_collection=pg)


def test_config_from_transformer_config():
    cfg = mm.moerail_config(tconfig(moe_router_score_function="sigmoid", moe_router_num_groups=4,
                                    moe_router_group_topk=2, moe_router_enable_expert_bias=True,
                                    moe_router_topk_scaling_factor=2.5), ep_size=2, max_tokens=300)
    assert (cfg.hidden, cfg.ffn_hidden, cfg.num_experts, cfg.topk, cfg.ep_size, cfg.max_tokens) == (64, 32, 8, 2, 2, 300)
    assert (cfg.activation, cfg.prob_mode, cfg.score_function, cfg.num_groups, cfg.group_topk) == \
        ("swiglu", "in-activation", "sigmoid", 4, 2)
    assert cfg.use_expert_bias and cfg.scaling_factor == 2.5 and cfg.capacity_factor is None  # dropless
    assert cfg.align == 16 and mm.moerail_config(tconfig(), 1, 8, align=128).align == 128
    # Megatron's router keeps ceil(c T K / E) rows per expert on each rank; the segments hold R of them
    c = mm.moerail_config(tconfig(moe_expert_capacity_factor=1.0), ep_size=2, max_tokens=100)
    assert c.expert_rows >= 2 * 25 and c.expert_rows % c.align == 0


@pytest.mark.parametrize("setting, match", [
    (dict(add_bias_linear=True), "add_bias_linear"),
    (dict(activation_func=F.gelu), "activation_func"),
    (dict(moe_apply_probs_on_input=True, moe_router_topk=1, moe_router_pre_softmax=True), "moe_apply_probs_on_input"),
    (dict(params_dtype=torch.float32, bf16=False), "params_dtype"),
])
def test_settings_moerail_cannot_honour_raise_and_name_them(setting, match):
    with pytest.raises(ValueError, match=match):
        mm.moerail_config(tconfig(**setting), 1, 64)


def test_use_moerail_switches_every_moe_layer():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    spec = mm.use_moerail(get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False), max_tokens=256)
    mlp = spec.submodules.mlp
    assert mlp.func is mm.MoELayer and mlp.keywords["max_tokens"] == 256
    assert mlp.keywords["submodules"].experts.func is mm.MoerailExperts
    assert mlp.keywords["submodules"].router is mm.MoerailRouter
    kept = mm.use_moerail(get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False), experts=False,
                          router=False)
    experts = kept.submodules.mlp.keywords["submodules"].experts
    assert getattr(experts, "func", experts).__name__ == "SequentialMLP"
    assert kept.submodules.mlp.keywords["submodules"].router.__name__ == "TopKRouter"
    with pytest.raises(ValueError, match="no MoE layer"):
        mm.use_moerail(get_gpt_layer_local_spec())


ROUTERS = {
    "softmax": dict(),
    "softmax-pre": dict(moe_router_pre_softmax=True),
    "sigmoid-groups-scaled": dict(moe_router_score_function="sigmoid", moe_router_num_groups=4,
                                  moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5, moe_router_topk=4),
}


@pytest.mark.parametrize("kind", ROUTERS)
def test_router_matches_megatrons(one_rank, kind):
    """MoerailRouter's fused top-k against Megatron's TopKRouter routing the same logits: the same experts per token,
    the same probs and logit gradients (float32), in top-k form; with a setting it does not cover, Megatron's."""
    from megatron.core.transformer.moe.router import TopKRouter
    cfg = tconfig(moe_router_load_balancing_type="none", **ROUTERS[kind])
    ours, theirs = mm.MoerailRouter(cfg, one_rank), TopKRouter(cfg, one_rank)
    assert ours.fused_refusal() is None
    T, E, K = 300, cfg.num_moe_experts, cfg.moe_router_topk
    logits = torch.randn(T, 1, E, generator=torch.Generator().manual_seed(4))
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    probs, idx = ours.routing(a)
    dense_probs, routing_map = theirs.routing(b)
    assert idx.dtype == torch.int32 and idx.shape == (T, K) and probs.shape == (T, K)
    assert torch.equal(torch.zeros(T, E, dtype=torch.bool).scatter_(1, idx.long(), True), routing_map)
    assert rel_err(probs, torch.gather(dense_probs, 1, idx.long())) < 1e-6
    w = torch.randn(T, E, generator=torch.Generator().manual_seed(5))
    (probs * torch.gather(w, 1, idx.long())).sum().backward()
    (dense_probs * w).sum().backward()
    assert rel_err(a.grad, b.grad) < 1e-5
    # a capacity factor: Megatron's drops (policy "probs"), on the top-k form
    capped = tconfig(moe_router_load_balancing_type="none", moe_expert_capacity_factor=1.0, **ROUTERS[kind])
    ours_c, theirs_c = mm.MoerailRouter(capped, one_rank), TopKRouter(capped, one_rank)
    assert ours_c.fused_refusal() is None
    pc, ic = ours_c.routing(logits.clone())
    dpc, mapc = theirs_c.routing(logits.clone())
    assert (ic == -1).any() and bool(mapc.sum() < T * K), "the case is meant to drop"
    kept = ic >= 0
    got_map = torch.zeros(T, E, dtype=torch.bool)
    got_map[kept.nonzero()[:, 0], ic[kept].long()] = True
    assert torch.equal(got_map, mapc)
    assert not pc[~kept].any() and rel_err(pc[kept], dpc[mapc.nonzero()[:, 0], ic[kept].long()]) < 1e-6
    # a setting the fused router does not cover: Megatron's routing, dense
    aux = mm.MoerailRouter(tconfig(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01), one_rank)
    assert "auxiliary" in aux.fused_refusal()
    with torch.no_grad():
        p, m = aux.routing(logits.clone())
    assert m.dtype == torch.bool and m.shape == (T, E)


def test_drop_past_capacity_edges():
    """Unrouted slots stay unrouted (never counted against an expert's capacity), a capacity above T drops nothing,
    and each expert keeps exactly its capacity of highest-prob slots, ties to the earlier token."""
    idx = torch.tensor([[0, 1], [0, -1], [0, 1], [1, 0], [-1, -1]], dtype=torch.int32)
    probs = torch.tensor([[0.5, 0.2], [0.9, 0.0], [0.5, 0.7], [0.1, 0.3], [0.0, 0.0]])
    # T 5, K 2, E 2, c 0.3: capacity ceil(5 * 2 / 2 * 0.3) = 2 per expert
    i2, p2 = mm.drop_past_capacity(idx, probs, 2, 0.3)
    # expert 0 (slots with probs 0.5, 0.9, 0.5, 0.3): keeps 0.9 and the first 0.5 (token 0); expert 1 (0.2, 0.7,
    # 0.1): keeps 0.7 and 0.2
    assert i2.tolist() == [[0, 1], [0, -1], [-1, 1], [-1, -1], [-1, -1]]
    assert torch.equal(p2, torch.tensor([[0.5, 0.2], [0.9, 0.0], [0.0, 0.7], [0.0, 0.0], [0.0, 0.0]]))
    same_i, same_p = mm.drop_past_capacity(idx, probs, 2, 10.0)  # capacity 50 > T: nothing dropped
    assert same_i is idx and same_p is probs


@pytest.mark.parametrize("static_shapes,exact_rows", [(False, True), (True, True), (False, False), (True, False)])
def test_dispatcher_six_calls(one_rank, static_shapes, exact_rows):
    """Megatron's six dispatcher calls with identity experts (probs applied in the "activation"), on the CPU
    reference: out = sum over a token's routed experts of its prob x its row; tokens without experts get 0."""
    T, H, E, K = 100, 64, 8, 2
    cfg = tconfig(hidden_size=H)
    d = mm.MoerailTokenDispatcher(E, range(E), cfg, one_rank, static_shapes=static_shapes, exact_rows=exact_rows,
                                  align=16, device="cpu")
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(T, 1, H, generator=g).requires_grad_()
    scores = torch.rand(T, E, generator=g)
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, scores.topk(K, dim=1).indices, True)
    routing_map[:5, :] = False  # tokens dropped entirely
    probs = (scores * routing_map).requires_grad_()
    h, p = d.dispatch_preprocess(hidden, routing_map, probs)
    h, p = d.token_dispatch(h, p)
    h, tokens_per_expert, p = d.dispatch_postprocess(h, p)
    assert d.moe_config.max_tokens == T  # T_max from the first forward
    static_rows = d.moe_config.rows_per_rank if static_shapes and not exact_rows else None
    assert h.shape[0] == (static_rows or int(tokens_per_expert.sum()))
    assert tokens_per_expert.device.type == "cpu" or static_shapes
    assert all(int(n) % 16 == 0 for n in tokens_per_expert)  # padded segments
    out = d.combine_postprocess(d.token_combine(d.combine_preprocess(h * p[:, None].to(h.dtype))))
    assert out.shape == hidden.shape
    ref = (probs.detach().sum(1, keepdim=True) * hidden.detach().squeeze(1)).unsqueeze(1)
    assert rel_err(out, ref) < 1e-5
    out.sum().backward()
    want = hidden.detach().squeeze(1).sum(1, keepdim=True).expand(T, E)
    assert rel_err(probs.grad[routing_map], want[routing_map]) < 1e-5
    idx, tp = mm.routing_map_to_topk(routing_map, probs.detach(), K)
    assert (idx[:5] == -1).all() and not tp[:5].any()
    # the same tokens in MoerailRouter's top-k form: the same output and probs' gradient
    tp = tp.clone().requires_grad_()
    h, p = d.dispatch_preprocess(hidden.detach(), idx, tp)
    h, tokens_per_expert, p = d.dispatch_postprocess(*d.token_dispatch(h, p))
    out2 = d.combine_postprocess(d.token_combine(d.combine_preprocess(h * p[:, None].to(h.dtype))))
    assert torch.equal(out2, out.detach())
    out2.sum().backward()
    assert rel_err(tp.grad[idx >= 0], probs.grad[routing_map]) < 1e-6
    with pytest.raises(ValueError, match="T_max"):
        d.token_dispatch(torch.zeros(T + 1, H), torch.zeros(T + 1, K))


def test_experts_initialize_as_sequential_mlp(one_rank):
    cfg = tconfig()
    torch.manual_seed(3)
    theirs = sequential_mlp(cfg, one_rank)
    torch.manual_seed(3)
    ours = mm.MoerailExperts(8, cfg, pg_collection=one_rank)
    assert ours.weight1.allreduce and ours.weight2.allreduce  # no expert parallelism: reduced with the rest
    for k, v in theirs.state_dict().items():
        assert (v is None and ours.state_dict()[k] is None) or torch.equal(v, ours.state_dict()[k]), k


def test_state_dicts_both_layouts_bit_exact(one_rank):
    cfg = tconfig()
    torch.manual_seed(1)
    theirs = sequential_mlp(cfg, one_rank)
    torch.manual_seed(2)
    ours = mm.MoerailExperts(8, cfg, pg_collection=one_rank)
    ours.load_state_dict(theirs.state_dict(), strict=True)  # SequentialMLP's keys in
    assert ours.state_dict().keys() == theirs.state_dict().keys()  # and out
    te = mm.MoerailExperts(8, cfg, pg_collection=one_rank, state_dict_layout="te-grouped")
    te.load_state_dict(ours.state_dict())
    keys = set(te.state_dict())
    assert {"linear_fc1.weight0", "linear_fc2.weight7", "linear_fc1._extra_state"} <= keys
    torch.manual_seed(9)
    back = sequential_mlp(cfg, one_rank)
    back.load_state_dict(mm.MoerailExperts(8, cfg, pg_collection=one_rank).state_dict())  # (other values)
    ours2 = mm.MoerailExperts(8, cfg, pg_collection=one_rank)
    ours2.load_state_dict(te.state_dict())  # TEGroupedMLP's keys in
    back.load_state_dict(ours2.state_dict(), strict=True)
    for k, v in theirs.state_dict().items():
        if v is not None:
            assert torch.equal(back.state_dict()[k], v), k
    missing = mm.MoerailExperts(8, cfg, pg_collection=one_rank).load_state_dict({}, strict=False).missing_keys
    assert "local_experts.0.linear_fc1.weight" in missing


def test_sharded_state_dict_is_sequential_mlps(one_rank):
    cfg = tconfig()
    theirs = sequential_mlp(cfg, one_rank)
    ours = mm.MoerailExperts(8, cfg, pg_collection=one_rank)
    ours.load_state_dict(theirs.state_dict())

    def flat(module):
        out = []
        for k, v in sorted(module.sharded_state_dict(prefix="mlp.experts.").items()):
            for t in (v.build() if hasattr(v, "build") else [v]):
                out.append((k, t.key, getattr(t, "global_shape", None), getattr(t, "global_offset", None),
                            t.replica_id, getattr(t, "data", None)))
        return out

    a, b = flat(theirs), flat(ours)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x[:5] == y[:5]
        assert (x[5] is None) == (y[5] is None) and (x[5] is None or torch.equal(x[5], y[5]))


@pytest.mark.gpu
def test_experts_delayed_wgrad_and_main_grad(one_rank):
    """MoerailExperts on the GPU behind a dispatcher that is not moerail's (host counts, trimmed rows, an expert
    without rows): the plain backward; the delayed one (data gradients in backward, weight gradients in
    backward_dw, added into .grad); and the fused accumulation into fp32 main_grad (Megatron's DDP buffers)."""
    import copy
    cfg = tconfig(hidden_size=256, moe_ffn_hidden_size=128)
    delayed = copy.copy(cfg)
    delayed.delay_wgrad_compute = True  # (Megatron's own validation asks for TransformerEngine's A2A overlap)
    plain = mm.MoerailExperts(8, cfg, pg_collection=one_rank).cuda()
    late = mm.MoerailExperts(8, delayed, pg_collection=one_rank).cuda()
    fused = mm.MoerailExperts(8, cfg, pg_collection=one_rank).cuda()
    late.load_state_dict(plain.state_dict())
    fused.load_state_dict(plain.state_dict())
    for w in (fused.weight1, fused.weight2):
        w.main_grad = torch.full(w.shape, 0.5, dtype=torch.float32, device="cuda")
        w.grad_added_to_main_grad = False
    counts = torch.tensor([30, 0, 17, 64, 5, 40, 12, 22])
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(int(counts.sum()), 256, generator=g, device="cuda").bfloat16()
    probs = torch.rand(x.shape[0], generator=g, device="cuda")
    dy = torch.randn(x.shape[0], 256, generator=g, device="cuda").bfloat16()
    grads = {}
    for name, m in (("plain", plain), ("late", late), ("fused", fused)):
        xi = x.clone().requires_grad_()
        y, bias = m(xi, counts, probs)
        assert bias is None and y.shape == x.shape
        y.backward(dy)
        if name == "late":
            assert m.weight1.grad is None and m.weight2.grad is None  # not yet
            m.backward_dw()
        grads[name] = (y.detach(), xi.grad, m.weight1.grad, m.weight2.grad)
    y0, dx0, dw1, dw2 = grads["plain"]
    for name in ("late", "fused"):
        y, dx, _, _ = grads[name]
        assert torch.equal(y, y0) and rel_err(dx, dx0) < 1e-3, name  # the same forward; the same dgrad kernels
    _, _, lw1, lw2 = grads["late"]
    assert not dw1[1].any() and not lw1[1].any()  # the expert without rows
    for e in (0, 2, 3, 4, 5, 6, 7):
        assert rel_err(lw1[e], dw1[e]) < 1e-2 and rel_err(lw2[e], dw2[e]) < 1e-2, e
        assert rel_err(fused.weight1.main_grad[e] - 0.5, dw1[e]) < 1e-2, e
        assert rel_err(fused.weight2.main_grad[e] - 0.5, dw2[e]) < 1e-2, e
    assert fused.weight1.grad_added_to_main_grad  # Megatron's hook then drops the placeholder


def test_fp8_settings_moerail_takes_and_refuses():
    """config.fp8 under moerail's experts: the blockwise and tensorwise recipes in e4m3, and tensorwise in the
    hybrid format, are taken; other recipes, the blockwise one in the hybrid format, FP8 primary weights, delayed
    weight gradients and tensorwise bf16 weight gradients are refused by name. The dispatcher alone takes any recipe
    (it moves bf16; Megatron's experts quantize)."""
    import copy
    ok = copy.copy(tconfig(hidden_size=256, moe_ffn_hidden_size=128))  # (Megatron's own checks want TE for fp8)
    ok.fp8, ok.fp8_recipe = "e4m3", "blockwise"
    assert mm._unsupported(ok, True) == []
    tensorwise = copy.copy(ok)
    tensorwise.fp8_recipe = "tensorwise"
    assert mm._unsupported(tensorwise, True) == []
    hybrid = copy.copy(tensorwise)
    hybrid.fp8 = "hybrid"  # e5m2 gradients: the fp8-tensor-hybrid recipe
    assert mm._unsupported(hybrid, True) == []
    tensorwise.fp8_wgrad = False
    assert any("fp8_wgrad = False" in b for b in mm._unsupported(tensorwise, True))
    for field, value, match in (("fp8_recipe", "delayed", "fp8_recipe = 'delayed'"),
                                ("fp8", "hybrid", "fp8 = 'hybrid' with fp8_recipe = 'blockwise'"),
                                ("fp8_param", True, "fp8_param"),
                                ("delay_wgrad_compute", True, "delay_wgrad_compute"),
                                ("overlap_dispatch_backward_with_experts_wgrad", True, "delay_wgrad_compute"),
                                ("first_last_layers_bf16", True, "first_last_layers_bf16"),
                                ("moe_ffn_hidden_size", 96, "multiples of 128")):
        bad = copy.copy(ok)
        setattr(bad, field, value)
        assert any(match in b for b in mm._unsupported(bad, True)), (field, mm._unsupported(bad, True))
        assert mm._unsupported(bad, False) == [], field


@pytest.mark.parametrize("fp8,fp8_recipe,recipe", [("e4m3", "blockwise", "fp8-blockwise"),
                                                    ("e4m3", "tensorwise", "fp8-tensor"),
                                                    ("hybrid", "tensorwise", "fp8-tensor-hybrid")])
def test_experts_fp8(one_rank, fp8, fp8_recipe, recipe):
    """MoerailExperts under config.fp8 = 'e4m3' (fp8_recipe 'blockwise' or 'tensorwise') or 'hybrid' (tensorwise,
    e5m2 gradients) on the GPU: forward and
    backward against the CPU reference of moerail's recipe on the same weights; the FP8 weights refreshed at the
    first microbatch Megatron marks (is_first_microbatch) after the weights changed through .data (as an optimizer
    writes them), and kept otherwise; fp8_wgrad = False gives the bf16 weight gradients' variant (blockwise)."""
    import copy
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    cfg = copy.copy(tconfig(hidden_size=256, moe_ffn_hidden_size=128))
    cfg.fp8, cfg.fp8_recipe = fp8, fp8_recipe
    m = mm.MoerailExperts(8, cfg, pg_collection=one_rank).cuda()
    assert m.recipe == recipe and m.fp8_weight_grads == "fp8"
    counts = torch.tensor([30, 0, 17, 64, 5, 40, 12, 22])
    g = torch.Generator().manual_seed(5)
    R = int(counts.sum())
    x = torch.randn(R, 256, generator=g).bfloat16()
    probs = torch.rand(R, generator=g) * 0.9 + 0.1
    dy = torch.randn(R, 256, generator=g).bfloat16()
    mcfg = mm.moerail_config(cfg, 1, R, align=1, capacity_slack=False)

    def reference():
        xi, pi = x.float().requires_grad_(), probs.clone().requires_grad_()
        a, b = (torch.nn.Parameter(w.detach().float().cpu()) for w in (m.weight1, m.weight2))
        y = mt_grouped_mlp(xi, pi, counts, a, b, mcfg, recipe=recipe)
        y.backward(dy.float())
        return y.detach(), xi.grad, a.grad, b.grad

    def gpu():
        m.weight1.grad = m.weight2.grad = None
        xi = x.cuda().requires_grad_()
        y, _ = m(xi, counts, probs.cuda())
        y.backward(dy.cuda())
        return y.detach().float().cpu(), xi.grad.float().cpu(), m.weight1.grad.float().cpu(), m.weight2.grad.float().cpu()

    def close(got, want):
        for name, a, b in zip(("y", "dx", "dw1", "dw2"), got, want):
            assert rel_err(a, b) < 2e-2, (name, rel_err(a, b))

    close(gpu(), reference())
    with torch.no_grad():  # an optimizer step: the weights change through .data, which autograd does not see
        m.weight1.data.mul_(-0.5)
        m.weight2.data.add_(0.01)
    stale = gpu()  # not the first microbatch: the step's FP8 weights are kept
    m.is_first_microbatch = True  # what Megatron's schedule sets at the first microbatch of the next step
    fresh = gpu()
    close(fresh, reference())
    assert rel_err(stale[0], fresh[0]) > 0.1  # the stale output used the old weights
    if recipe == "fp8-blockwise":
        bf16_wgrad = copy.copy(cfg)
        bf16_wgrad.fp8_wgrad = False
        assert mm.MoerailExperts(8, bf16_wgrad, pg_collection=one_rank).fp8_weight_grads == "bf16"


def mt_grouped_mlp(*args, **kw):
    import moerail.torch as mt
    return mt.grouped_mlp(*args, **kw)


# ---- the GPU checks, in processes of their own ----

def _run_worker(check: str, gpus: int, tmp_path, timeout: int = 300):
    if not (moerail.with_cuda and moerail.with_nccl and torch.cuda.is_available()):
        pytest.skip("no CUDA GPU")
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"fewer than {gpus} GPUs")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus),
           "--master-port", str(29700 + gpus + len(check)), os.path.join(here, "megatron_worker.py"), check,
           str(tmp_path)]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace")[-3000:], (e.stderr or b"").decode(errors="replace")[-8000:]
        pytest.fail(f"{check} on {gpus} GPUs did not finish in {timeout} s:\n{out[0]}\n{out[1]}")
    assert p.returncode == 0, f"{check} on {gpus} GPUs failed:\n{p.stdout[-4000:]}\n{p.stderr[-8000:]}"
    results = [json.load(open(tmp_path / f"{check}.rank{r}.json")) for r in range(gpus)]
    assert all(r["ok"] for r in results)
    print(json.dumps(results))
    return results


@pytest.mark.multigpu
@pytest.mark.parametrize("gpus", [2, 4])
def test_layer_against_megatron_alltoall(gpus, tmp_path):
    _run_worker("layer", gpus, tmp_path)


@pytest.mark.multigpu
def test_checkpoint_round_trip(tmp_path):
    _run_worker("checkpoint", 2, tmp_path)


@pytest.mark.multigpu
def test_gpt_pipeline_parallel_loss_curve(tmp_path):
    _run_worker("gpt", 4, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_recipe", ["blockwise", "tensorwise", "tensorwise-hybrid"])
def test_gpt_fp8_loss_curve(tmp_path, monkeypatch, fp8_recipe):
    """A small GPT trained with Megatron's schedule and optimizer, moerail's experts in FP8 (each recipe) against
    bf16 (one GPU)."""
    monkeypatch.setenv("MOERAIL_GPT_FP8_RECIPE", fp8_recipe)
    _run_worker("gpt-fp8", 1, tmp_path, timeout=900)  # 8 trainings of 100 steps (~100 s on an H200)
