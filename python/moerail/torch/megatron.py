"""moerail inside Megatron-core (0.19.x): a token dispatcher, an experts module and the switch that installs them.

One switch, on the layer spec (docs/megatron.md):

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from moerail.torch.megatron import use_moerail

    spec = use_moerail(get_gpt_layer_local_spec(num_experts=64, moe_grouped_gemm=False))
    model = GPTModel(config, transformer_layer_spec=spec, ...)

Every MoE layer of the spec becomes a `MoELayer` (a subclass of Megatron's) whose token dispatcher is a
`MoerailTokenDispatcher` (a `MoETokenDispatcher`: moerail's fused permute + pad + all-to-all each way) and whose
experts are `MoerailExperts` (moerail's grouped MLP with device-side counts and the fused GLU); `experts=False`
keeps the spec's experts (SequentialMLP, TEGroupedMLP) behind moerail's dispatcher. Megatron's router, shared
experts, schedules, DDP and checkpointing are used as they are; nothing of Megatron is modified.

moerail's configuration is derived from the TransformerConfig (`moerail_config`); a setting moerail cannot honour
raises a ValueError that names it. The per-rank token bound T_max (moerail's buffers are static) is `max_tokens`
when given, else the largest token count of the first forward over the expert-parallel group (one all-reduce,
then never again): a later forward with more tokens on a rank raises.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:
    from megatron.core.activations import squared_relu
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.moe.moe_layer import MoELayer as _MegatronMoELayer
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization, get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("moerail.torch.megatron needs megatron-core 0.19.x (pip install megatron-core): " + str(e)) from e

from .. import Config, make_config
from ._common import capturing
from .functional import Fp8Weights, TokenDispatcher, grouped_mlp, router

__all__ = ["MoerailTokenDispatcher", "MoerailExperts", "MoerailRouter", "MoELayer", "use_moerail", "moerail_config",
           "check", "routing_map_to_topk", "drop_past_capacity"]


def routing_map_to_topk(routing_map: torch.Tensor, probs: torch.Tensor, topk: int):
    """Megatron's routing (routing_map [T, E] bool, probs [T, E]) as (topk_idx [T, K] int32, topk_probs [T, K]
    float32): each token's routed experts in ascending expert order, -1 (prob 0) where a token has fewer than K
    (a capacity drop). No host synchronization."""
    if routing_map.dtype != torch.bool:
        raise ValueError(f"routing_map_to_topk: routing_map has dtype {routing_map.dtype}, expected torch.bool")
    if probs.shape != routing_map.shape:
        raise ValueError(f"routing_map_to_topk: probs {tuple(probs.shape)} and routing_map {tuple(routing_map.shape)} "
                         "differ")
    # A key that is E - e on routed experts and 0 elsewhere: its K largest are the routed experts in ascending
    # order (distinct keys: no ties among them), then unrouted ones (key 0) where a token has fewer than K.
    E = routing_map.shape[1]
    key = routing_map.to(torch.int32) * torch.arange(E, 0, -1, dtype=torch.int32, device=routing_map.device)
    value, order = torch.topk(key, topk, dim=1)
    routed = value > 0
    topk_probs = torch.where(routed, torch.gather(probs.float(), 1, order), torch.zeros((), device=probs.device))
    topk_idx = torch.where(routed, order, torch.full_like(order, -1)).to(torch.int32)
    return topk_idx, topk_probs


# ---- configuration ---------------------------------------------------------------------------------------------

def _activation(config) -> str:
    fn = config.activation_func
    glu = config.gated_linear_unit
    if glu and fn is F.silu:
        return "swiglu"
    if not glu and fn is squared_relu:
        return "relu2"
    raise ValueError(f"moerail: activation_func = {getattr(fn, '__name__', fn)} with gated_linear_unit = {glu} is "
                     "not one of moerail's expert activations (F.silu with gated_linear_unit: SwiGLU; squared_relu "
                     "without: ReLU2); keep Megatron's experts for it (use_moerail(..., experts=False))")


def _unsupported(config, experts: bool) -> list[str]:
    """The settings of `config` that moerail's dispatcher (and, with experts, its experts module) cannot honour."""
    bad = []

    def need(ok: bool, what: str):
        if not ok:
            bad.append(what)

    get = functools.partial(getattr, config)
    need(get("expert_tensor_parallel_size", 1) in (None, 1),
         f"expert_tensor_parallel_size = {get('expert_tensor_parallel_size', 1)} (expert tensor parallelism; "
         "moerail shards experts over expert parallelism only)")
    need(not get("moe_pad_expert_input_to_capacity", False),
         "moe_pad_expert_input_to_capacity (moerail's receive buffer is static already; drop the flag)")
    need(not get("moe_apply_probs_on_input", False), "moe_apply_probs_on_input (moerail applies the probs in the "
         "expert activation, Megatron's default)")
    need(not get("moe_latent_size", None), "moe_latent_size (latent MoE projections)")
    need(get("moe_router_num_groups", None) in (None, 0, 1) or get("moe_router_group_topk", None),
         "moe_router_num_groups without moe_router_group_topk")
    need(not get("fp4", None), f"fp4 = {get('fp4', None)}")
    if experts:
        need(not get("add_bias_linear", False), "add_bias_linear (expert biases; Megatron's experts scale the FC2 "
             "bias by the prob in one place and not in another: keep Megatron's experts for it)")
        need(get("params_dtype", torch.bfloat16) == torch.bfloat16,
             f"params_dtype = {get('params_dtype', None)} (moerail's experts run bf16: train with bf16=True)")
        if get("fp8", None):  # the dispatch moves bf16 whatever the recipe; moerail's experts run three FP8 recipes
            recipe = getattr(get("fp8_recipe", None), "value", get("fp8_recipe", None))
            need(recipe in ("blockwise", "tensorwise"), f"fp8_recipe = {recipe!r} (moerail's experts run the "
                 "blockwise recipe, DeepSeek-V3's 1x128 activations and 128x128 weights, and the tensorwise one, "
                 "per-tensor current scaling: fp8_recipe='blockwise' or 'tensorwise')")
            need(get("fp8") == "e4m3" or (get("fp8") == "hybrid" and recipe == "tensorwise"),
                 f"fp8 = {get('fp8')!r} with fp8_recipe = {recipe!r} (moerail's experts run fp8='e4m3' with either "
                 "recipe and fp8='hybrid', e5m2 gradients, with the tensorwise one; the blockwise recipe is e4m3 in "
                 "both directions, as DeepSeek-V3's)")
            need(recipe != "tensorwise" or get("fp8_wgrad", True), "fp8_wgrad = False with fp8_recipe = "
                 "'tensorwise' (bf16 weight gradients run with the blockwise recipe only)")
            need(get("hidden_size") % 128 == 0 and (get("moe_ffn_hidden_size") or 0) % 128 == 0,
                 f"hidden_size = {get('hidden_size')}, moe_ffn_hidden_size = {get('moe_ffn_hidden_size')} under fp8 "
                 "(the FP8 experts need multiples of 128)")
            need(not get("fp8_param", False), "fp8_param (FP8 primary weights: moerail's experts keep bf16 weights "
                 "and quantize them once per step)")
            need(not get("first_last_layers_bf16", False), "first_last_layers_bf16 with moerail's FP8 experts (every "
                 "MoE layer runs the recipe)")
            need(not (get("delay_wgrad_compute", False) or get("overlap_dispatch_backward_with_experts_wgrad", False)),
                 "delay_wgrad_compute under fp8 (moerail's FP8 experts compute their weight gradients in the "
                 "backward)")
    return bad


def moerail_config(config, ep_size: int, max_tokens: int, *, align: int | None = None, experts: bool = True,
                   capacity_slack: bool = True) -> Config:
    """The moerail.Config of a Megatron MoE layer: H, F, E, K, the activation and GLU layout, the router options,
    the alignment and the capacity, from the TransformerConfig `config`; T_max = max_tokens, R = ep_size.

    align: rows each expert segment is padded to (default: Megatron's quantization alignment when
    moe_router_padding_for_quantization is on, else 16). Capacity: Megatron's router drops tokens past each
    expert's per-rank capacity ceil(c T K / E) itself (moe_expert_capacity_factor c), so the dispatcher's
    per-expert segments are sized to hold R of those (nothing is dropped twice); without a factor, worst case
    (dropless). Raises ValueError naming every setting moerail cannot honour."""
    bad = _unsupported(config, experts)
    if bad:
        raise ValueError("moerail cannot honour these Megatron settings: " + "; ".join(bad))
    E, K = config.num_moe_experts, config.moe_router_topk
    if E is None or E % ep_size:
        raise ValueError(f"moerail: num_moe_experts = {E} is not a multiple of the expert-parallel size {ep_size}")
    if align is None:
        align = get_align_size_for_quantization(config) if config.moe_router_padding_for_quantization else 16
    fields = dict(hidden=config.hidden_size, ffn_hidden=config.moe_ffn_hidden_size, num_experts=E, topk=K,
                  ep_size=ep_size, align=align, max_tokens=max_tokens, activation=_activation(config),
                  prob_mode="in-activation")
    g = getattr(config, "moe_mlp_glu_interleave_size", None)
    if g:
        fields.update(glu_layout="interleaved", glu_block=g)
    score = config.moe_router_score_function
    fields.update(score_function=score, pre_softmax=bool(config.moe_router_pre_softmax),
                  scaling_factor=config.moe_router_topk_scaling_factor or 1.0,
                  use_expert_bias=bool(config.moe_router_enable_expert_bias))
    if config.moe_router_num_groups and config.moe_router_num_groups > 1:
        fields.update(num_groups=config.moe_router_num_groups, group_topk=config.moe_router_group_topk)
    c = config.moe_expert_capacity_factor
    if c is not None:
        if capacity_slack:
            per_rank = math.ceil(max_tokens * K / E * c)  # Megatron's get_capacity on the largest rank
            c = per_rank * E / (max_tokens * K) * (1 + 1e-9)  # segments of R * per_rank rows (rounded up to A)
        fields["capacity_factor"] = c
    return make_config(**fields)


def _ep_max(n: int, group) -> int:
    """The largest n over the ranks of `group` (one all-reduce)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return n  # (no device tensor: the CPU reference backend gets here too)
    t = torch.tensor([n], dtype=torch.int64, device=torch.cuda.current_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


# ---- the router ------------------------------------------------------------------------------------------------

class MoerailRouter(TopKRouter):
    """Megatron's TopKRouter (its gate, parameters and checkpoint keys, z-loss, expert-bias accounting) whose top-k
    selection runs in moerail's fused router: score function, group-limited selection, expert bias and scaling in
    one kernel forward and one backward, handing the dispatcher the top-k ids directly instead of a dense [T, E]
    routing map that the dispatcher converts back. A capacity factor drops as Megatron's router does (drop policy
    "probs": each expert keeps the ceil(c T K / E) tokens of highest prob, on the top-k form). Settings the fused
    router does not cover run Megatron's routing unchanged (fused_refusal() says which): auxiliary losses, the
    "position" drop policy, padding to capacity, sinkhorn and quantile balancing, padding masks, routing replay,
    score functions other than softmax and sigmoid, logits other than float32 and bfloat16.

    routing() returns (probs, routing_map) as Megatron's routers do, in top-k form when fused: probs [T, K] float32
    and routing_map [T, K] int32 expert ids (a dense routing map is [T, E] bool); MoerailTokenDispatcher takes both
    forms, Megatron's own dispatchers the dense one only (use_moerail installs this router with moerail's
    dispatcher)."""

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False):
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        self._cfg_by_tokens: dict = {}

    def fused_refusal(self, logits: torch.Tensor | None = None, padding_mask=None) -> str | None:
        """Why routing() runs Megatron's routing instead of the fused router, or None when it runs the fused one."""
        c = self.config
        if self.routing_type in ("sinkhorn", "quantile_balancing"):
            return f"moe_router_load_balancing_type = {self.routing_type}"
        if self.is_aux_loss_enabled():
            return "auxiliary load-balancing losses (moe_aux_loss_coeff > 0)"
        if c.moe_expert_capacity_factor is not None and c.moe_token_drop_policy != "probs":
            return f"moe_token_drop_policy = {c.moe_token_drop_policy} (the fused router drops by probs)"
        if c.moe_expert_capacity_factor is not None and c.moe_pad_expert_input_to_capacity:
            return "moe_pad_expert_input_to_capacity"
        if c.moe_router_score_function not in ("softmax", "sigmoid"):
            return f"moe_router_score_function = {c.moe_router_score_function}"
        if padding_mask is not None:
            return "a padding mask"
        if self.router_replay is not None:
            return "moe_enable_routing_replay"
        if logits is not None and logits.dtype not in (torch.float32, torch.bfloat16):
            return f"router logits in {logits.dtype} (moe_router_dtype)"
        return None

    def routing(self, logits: torch.Tensor, padding_mask=None):
        if self.fused_refusal(logits, padding_mask) is not None:
            return super().routing(logits, padding_mask=padding_mask)
        E = self.config.num_moe_experts
        logits = self.apply_z_loss(logits.view(-1, E))
        T = logits.shape[0]
        cfg = self._cfg_by_tokens.get(T)
        if cfg is None:  # (the router's own configuration: T_max = this T, so its kernels take logits as they are)
            cfg = self._cfg_by_tokens[T] = moerail_config(self.config, 1, max(T, 1), align=1, experts=False)
        idx, probs, _ = router(logits, cfg, self.expert_bias if cfg.use_expert_bias else None)
        if self.config.moe_expert_capacity_factor is not None:
            idx, probs = drop_past_capacity(idx, probs, E, self.config.moe_expert_capacity_factor)
        if self.enable_expert_bias and torch.is_grad_enabled():  # Megatron's count for the expert-bias update
            with torch.no_grad():
                flat, counts = idx.flatten(), self.local_tokens_per_expert  # (bf16 under Megatron's Float16Module)
                counts.scatter_add_(0, flat.clamp(min=0).long(), (flat >= 0).to(counts.dtype))
        return probs, idx


def drop_past_capacity(topk_idx: torch.Tensor, topk_probs: torch.Tensor, num_experts: int, capacity_factor: float):
    """Megatron's token dropping (apply_router_token_dropping, drop policy "probs") on the top-k form: each expert
    keeps the ceil(c T K / E) of its tokens with the highest probs (ties: the earlier token), the rest of its slots
    become id -1 and prob 0; nothing is dropped when that capacity exceeds T. No host synchronization; the probs'
    gradient flows through the kept slots."""
    T, K = topk_idx.shape
    capacity = math.ceil(T * K / num_experts * capacity_factor)
    if capacity > T:
        return topk_idx, topk_probs
    e = topk_idx.reshape(-1).long()
    e = torch.where(e >= 0, e, torch.full_like(e, num_experts))  # unrouted slots: a bucket of their own, never kept
    p = topk_probs.detach().reshape(-1)
    order = torch.argsort(p, descending=True, stable=True)  # probs descending, then token order
    order = order[torch.argsort(e[order], stable=True)]     # grouped by expert, each group in that order
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=e.device).scatter_add_(0, e, torch.ones_like(e))
    first = torch.cumsum(counts, 0) - counts                 # first sorted position of each expert
    rank = torch.arange(e.numel(), device=e.device) - first[e[order]]
    keep = torch.empty_like(e, dtype=torch.bool)
    keep[order] = rank < capacity
    keep = (keep & (e < num_experts)).view(T, K)
    return (torch.where(keep, topk_idx, torch.full_like(topk_idx, -1)),
            torch.where(keep, topk_probs, torch.zeros_like(topk_probs)))


# ---- the token dispatcher -------------------------------------------------------------------------------------

class MoerailTokenDispatcher(MoETokenDispatcher):
    """Megatron's MoETokenDispatcher over moerail's TokenDispatcher: permutation, per-expert alignment padding and
    the all-to-all fused into one pass each way (NVLink kernels inside a node, NCCL's host API elsewhere).

    Built as Megatron builds its dispatchers, `(num_local_experts, local_expert_indices, config, pg_collection)`;
    the keyword options are moerail's: max_tokens (T_max; None = from the first forward), align (rows per expert
    segment, see moerail_config), transport ("auto" | "nvlink" | "host"), sms (blocks of the data kernels, 0 =
    default), exact_rows, static_shapes, and device (the current CUDA device by default; "cpu" runs the CPU
    reference, one rank).

    exact_rows=True (the default): each dispatch reads on the host how many rows land on this rank (one
    synchronization per dispatch, as Megatron's all-to-all dispatcher makes when dropless) and the receive buffer,
    the experts' activations and their gradients are that many rows: Megatron's memory. exact_rows=False: they are
    the worst case moe_config allows (moe_config.rows_per_rank rows; with a capacity factor, R of Megatron's
    per-rank expert capacities per expert), and nothing is read on the host: capturable in a CUDA graph.

    static_shapes=False (Megatron's contract): the experts get exactly sum(tokens_per_expert) rows and
    tokens_per_expert on the host, as Megatron's SequentialMLP splits them: one host read of the counts per
    dispatch, which also reads the dispatcher's status word (raises on capacity overflow). static_shapes=True
    (moerail's experts): the experts get the receive buffer (only the segments are defined) and tokens_per_expert
    on the device; overflow is then reported by check().

    The rows are expert-major, each expert's segment padded with zero rows (prob 0) to a multiple of align, so
    tokens_per_expert counts padded rows; the probs are applied by the experts (Megatron's default)."""

    def __init__(self, num_local_experts: int, local_expert_indices, config, pg_collection=None, *,
                 max_tokens: int | None = None, align: int | None = None, transport: str = "auto", sms: int = 0,
                 exact_rows: bool = True, static_shapes: bool = False, device: torch.device | str | None = None):
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(config=config, pg_collection=pg_collection)
        if self.tp_size != 1:
            raise ValueError(f"MoerailTokenDispatcher: expert tensor parallel size {self.tp_size} (expt_tp group): "
                             "moerail shards experts over expert parallelism only")
        if num_local_experts * self.ep_size != config.num_moe_experts:
            raise ValueError(f"MoerailTokenDispatcher: num_local_experts = {num_local_experts} on {self.ep_size} "
                             f"expert-parallel ranks, num_moe_experts = {config.num_moe_experts}")
        if list(local_expert_indices) != list(range(self.ep_rank * num_local_experts,
                                                    (self.ep_rank + 1) * num_local_experts)):
            raise ValueError("MoerailTokenDispatcher: local_expert_indices must be the rank's contiguous block "
                             f"(rank {self.ep_rank}: {self.ep_rank * num_local_experts}..)")
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.static_shapes = static_shapes
        self.exact_rows = exact_rows
        self.align, self.transport, self.sms, self.device = align, transport, sms, device
        self.moe_config: Config | None = None
        self.dispatcher: TokenDispatcher | None = None
        # every unsupported setting raises now, not at the first forward
        moerail_config(config, self.ep_size, max_tokens or 1, align=align, experts=False)
        if max_tokens is not None:
            self._setup(max_tokens)
        # Tensors dispatch_preprocess leaves for the later steps (Megatron returns them from a captured
        # moe_preprocess graph).
        self.cudagraph_attrs = ["topk_idx", "topk_probs"]

    def set_shared_experts(self, shared_experts):
        """Shared-expert overlap (moe_shared_expert_overlap): the shared expert runs on its own stream beside the
        dispatch and combine, in the call sequence of Megatron's alltoall dispatcher."""
        super().set_shared_experts(shared_experts)
        if shared_experts.use_shared_expert_gate:
            self.cudagraph_attrs.append("shared_experts.gate_score")
        self.cudagraph_attrs.append("shared_experts.cached_fc1_input")

    def _setup(self, max_tokens: int):
        self.moe_config = moerail_config(self.config, self.ep_size, max_tokens, align=self.align, experts=False)
        self.dispatcher = TokenDispatcher(self.moe_config, self.ep_group, transport=self.transport, sms=self.sms,
                                          check=False, exact_rows=self.exact_rows, device=self.device)

    def check(self) -> None:
        """Reads the status word (one host synchronization) and raises moerail.Error on capacity overflow or bad
        routing since the last check. Call it where a host sync is cheap (at a logging step)."""
        if self.dispatcher is not None and self.dispatcher._impl is not None:  # (the CPU reference raises at once)
            self.dispatcher._impl.check(torch.cuda.current_stream().cuda_stream)

    # Megatron's six calls.
    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """routing_map: Megatron's [T, E] bool routing map with probs [T, E], or MoerailRouter's top-k form,
        [T, K] int32 expert ids with probs [T, K]."""
        self.hidden_shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, self.hidden_shape[-1])
        T, K = hidden.shape[0], self.config.moe_router_topk
        if routing_map.dtype == torch.int32:  # top-k ids already
            if routing_map.numel() != T * K or probs.numel() != T * K:
                raise ValueError(f"MoerailTokenDispatcher: top-k routing {tuple(routing_map.shape)} with probs "
                                 f"{tuple(probs.shape)} for {T} tokens, expected [{T}, {K}] each")
            self.topk_idx, self.topk_probs = routing_map.reshape(T, K), probs.reshape(T, K).float()
        else:
            self.topk_idx, self.topk_probs = routing_map_to_topk(routing_map.reshape(T, -1), probs.reshape(T, -1), K)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        return hidden, self.topk_probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if self.dispatcher is None:
            if capturing():
                raise RuntimeError("MoerailTokenDispatcher: the first forward finds T_max (an all-reduce) and cannot "
                                   "be captured: run one eager step first, or give max_tokens")
            self._setup(_ep_max(hidden_states.shape[0], self.ep_group))
        if hidden_states.shape[0] > self.moe_config.max_tokens:
            raise ValueError(f"MoerailTokenDispatcher: {hidden_states.shape[0]} tokens on rank {self.ep_rank}, "
                             f"T_max = {self.moe_config.max_tokens} (set max_tokens to the most tokens a rank brings "
                             "to one forward: micro-batch size x sequence length / TP / CP)")
        if self.exact_rows and capturing():
            raise RuntimeError("MoerailTokenDispatcher: exact_rows reads each dispatch's row count on the host, which "
                               "a CUDA graph cannot hold: for graphs over the dispatch, build the layers with "
                               "use_moerail(spec, exact_rows=False, max_tokens=...) (worst-case buffers)")
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        recv, recv_probs, self.tokens_per_expert, self.handle = self.dispatcher.dispatch(
            hidden_states, self.topk_idx, probs)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(recv)
        return recv, recv_probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        tpe = self.tokens_per_expert
        self.capacity_rows = hidden_states.shape[0]
        if not self.static_shapes:
            tpe = tpe.cpu()  # the host read of Megatron's contract; the status word is read behind it for free
            self.check()
            used = int(tpe.sum())
            hidden_states, probs = hidden_states[:used], probs[:used]
        self.tokens_per_expert = None
        return hidden_states, tpe, probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        used = hidden_states.shape[0]
        if used < self.capacity_rows:  # rows past the segments are never read by the combine
            full = hidden_states.new_empty((self.capacity_rows, hidden_states.shape[1]))
            full[:used] = hidden_states
            hidden_states = full
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        handle, self.handle = self.handle, None  # autograd keeps it for the backward passes
        out = self.dispatcher.combine(hidden_states, handle)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(out)
            self.shared_experts.post_forward_comm()
        return out

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = hidden_states.view(self.hidden_shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts.get_output()
        return out


# ---- the experts ----------------------------------------------------------------------------------------------

class _DelayedWgrad(torch.autograd.Function):
    """The expert MLP whose backward computes the data gradients only; MoerailExperts.backward_dw the weights'."""

    @staticmethod
    def forward(ctx, x, probs, counts, w1, w2, experts, cfg):
        from .functional import _grouped_mlp_impl
        from ._common import stream_handle
        x, probs = x.detach(), probs.detach()
        R, dev = x.shape[0], x.device
        y = torch.empty((R, cfg.hidden), dtype=x.dtype, device=dev)
        h1 = torch.empty((R, cfg.fc1_out), dtype=x.dtype, device=dev)
        act = torch.empty((R, cfg.ffn_hidden), dtype=x.dtype, device=dev)
        _grouped_mlp_impl(cfg, dev).forward(x, probs, counts, w1.detach(), None, w2.detach(), None, y, h1, act,
                                            stream_handle(dev))
        ctx.save_for_backward(x, probs, counts, w1, w2, h1, act)
        ctx.experts, ctx.cfg = experts, cfg
        return y

    @staticmethod
    def backward(ctx, dy):
        from .functional import _grouped_mlp_impl, _workspace
        from ._common import stream_handle
        x, probs, counts, w1, w2, h1, act = ctx.saved_tensors
        dev, dy = x.device, dy.contiguous()
        mlp = _grouped_mlp_impl(ctx.cfg, dev)
        dx = torch.empty_like(x)
        d_probs = torch.empty(x.shape[0], dtype=torch.float32, device=dev)
        d_h1 = torch.empty_like(h1)
        ws = _workspace(mlp.backward_workspace_bytes(x.shape[0]), dx)
        mlp.backward(x, probs, counts, w1.detach(), None, w2.detach(), None, h1, act, dy, dx, d_probs, d_h1, ws,
                     None, None, None, None, stream_handle(dev))
        ctx.experts._pending_wgrad.append((x, probs, counts, act, dy, d_h1, ctx.cfg))
        return dx, d_probs, None, None, None, None, None


class MoerailExperts(MegatronModule):
    """The routed experts of a Megatron MoE layer on moerail's grouped MLP: one GEMM kernel over all local experts
    for each of FC1 (with the GLU, times the prob, in its epilogue where the layout allows), FC2 and the backward
    GEMMs; the per-expert counts read on the device (no host sync); bf16, or, under config.fp8 = "e4m3" with
    fp8_recipe = "blockwise", moerail's FP8 recipe (DeepSeek-V3's: x and the gradients quantized 1x128, the weights
    in 128x128 blocks once per step, at the first microbatch Megatron marks; config.fp8_wgrad = False keeps the
    weight gradients' GEMMs in bf16); with fp8_recipe = "tensorwise" per-tensor current scaling (fp8-tensor, or
    under config.fp8 = "hybrid" fp8-tensor-hybrid: e5m2 gradients).

    Built as Megatron builds experts, `(num_local_experts, config, pg_collection=..., name=...)`. Parameters
    `weight1` [L, F1, H] (expert i's FC1 weight, [out, in] as linear_fc1's, GLU halves concatenated) and `weight2`
    [L, H, F], initialized as SequentialMLP initializes its experts (config.init_method /
    output_layer_init_method under the expert-parallel RNG, expert by expert: the same values from the same seed)
    and tagged as Megatron tags expert parameters (allreduce = False under expert parallelism: reduced over the
    expert-data-parallel group). When the weights carry a `main_grad` (Megatron's DDP gives them one), the
    kernels add the weight gradients into it (grad_added_to_main_grad); the FP8 ones only into a float32 one (into
    a bf16 main_grad they write .grad, which Megatron's hook adds). Under config.delay_wgrad_compute (or
    overlap_dispatch_backward_with_experts_wgrad) the backward computes the data gradients and backward_dw() the
    weight gradients.

    Checkpoints: state_dict() has SequentialMLP's keys (`local_experts.{i}.linear_fc1.weight`, ...), or
    TEGroupedMLP's (`linear_fc1.weight{i}`, ...) with state_dict_layout="te-grouped"; load_state_dict() takes
    either; sharded_state_dict() is SequentialMLP's (the distributed checkpoint format that TEGroupedMLP shares),
    so distributed checkpoints move between moerail and both Megatron layouts bit for bit."""

    def __init__(self, num_local_experts: int, config, pg_collection=None, name: str | None = None, *,
                 state_dict_layout: str = "sequential"):
        super().__init__(config=config)
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        if state_dict_layout not in ("sequential", "te-grouped"):
            raise ValueError(f"MoerailExperts: state_dict_layout = {state_dict_layout!r}, expected 'sequential' or "
                             "'te-grouped'")
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        ep_size = self.ep_group.size() if self.ep_group is not None else 1
        if self.tp_group is not None and self.tp_group.size() != 1:
            raise ValueError(f"MoerailExperts: expert tensor parallel size {self.tp_group.size()}: moerail shards "
                             "experts over expert parallelism only")
        bad = _unsupported(config, True)
        if bad:
            raise ValueError("moerail cannot honour these Megatron settings: " + "; ".join(bad))
        self.num_local_experts = num_local_experts
        self.ep_size = ep_size
        self.state_dict_layout = state_dict_layout
        self.activation = _activation(config)
        L, H, F = num_local_experts, config.hidden_size, config.moe_ffn_hidden_size
        F1 = 2 * F if config.gated_linear_unit else F
        dev = torch.device("cpu") if config.use_cpu_initialization else torch.device("cuda", torch.cuda.current_device())
        self.weight1 = torch.nn.Parameter(torch.empty((L, F1, H), dtype=config.params_dtype, device=dev))
        self.weight2 = torch.nn.Parameter(torch.empty((L, H, F), dtype=config.params_dtype, device=dev))
        if config.perform_initialization:
            self._initialize()
        expert_groups = config.expert_model_parallel_size > 1 or (
            config.expert_tensor_parallel_size not in (None, config.tensor_model_parallel_size))
        for p in (self.weight1, self.weight2):
            p.allreduce = not expert_groups
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
        self.dispatcher: MoerailTokenDispatcher | None = None  # set by moerail's MoELayer: its config is shared
        self._cfg_by_bound: dict = {}  # behind another dispatcher: moerail configs by token bound (_moe_config)
        self._pending_wgrad: list = []
        # config.fp8 (recipe blockwise or tensorwise): the weights quantized once per step. Megatron's schedules set
        # is_first_microbatch on every module that has it at the first microbatch of each step (as for
        # TransformerEngine's weight caches); the FP8 weights are refreshed then, and whenever the weights were
        # replaced or changed in place through autograd-visible ops.
        fp8_recipe = getattr(getattr(config, "fp8_recipe", None), "value", getattr(config, "fp8_recipe", None))
        fp8 = getattr(config, "fp8", None)
        self.recipe = "bf16" if not fp8 else "fp8-blockwise" if fp8_recipe != "tensorwise" else \
            "fp8-tensor-hybrid" if fp8 == "hybrid" else "fp8-tensor"
        self.fp8_weight_grads = "fp8" if getattr(config, "fp8_wgrad", True) else "bf16"
        self.is_first_microbatch = True
        self._fp8_weights = None
        self._fp8_of = None  # (data_ptr, _version) of each weight at the last quantization

    @torch.no_grad()
    def _initialize(self):
        """SequentialMLP's initialization, value for value: expert by expert, FC1 then FC2, each weight drawn
        whole by its init method (on the GPU under the expert-parallel RNG; on the CPU in fp32, then rounded)."""
        config = self.config
        inits = ((self.weight1, config.init_method), (self.weight2, config.output_layer_init_method))
        if config.use_cpu_initialization:
            for i in range(self.num_local_experts):
                for w, init in inits:
                    master = torch.empty(w.shape[1:], dtype=torch.float)
                    init(master)
                    w[i].copy_(master)
            return
        with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
            for i in range(self.num_local_experts):
                for w, init in inits:
                    init(w[i])

    def _moe_config(self, rows: int) -> Config:
        if self.dispatcher is not None and self.dispatcher.moe_config is not None:
            return self.dispatcher.moe_config
        # Behind another dispatcher the rows arrive trimmed, a different count every step. The bound only steers the
        # kernels' tile choice (more rows run on the grouped GEMMs), but each config is a GroupedMlp of its own (set
        # up once, with a device synchronization): bound it by the power of two at or above the rows' tokens, so that
        # a few configs serve every step.
        t = 1 << max(0, math.ceil(rows / self.config.moe_router_topk) - 1).bit_length()
        cfg = self._cfg_by_bound.get(t)
        if cfg is None:
            cfg = self._cfg_by_bound[t] = moerail_config(self.config, self.ep_size, t, align=1, capacity_slack=False)
        return cfg

    def forward(self, dispatched_input: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor,
                **_zero_copy_buffers):
        x = dispatched_input
        cfg = self._moe_config(x.shape[0])
        counts = tokens_per_expert.to(device=x.device, dtype=torch.int32, non_blocking=True)
        probs = permuted_probs.float()
        main_grad = getattr(self.weight1, "main_grad", None)
        fuse = isinstance(main_grad, torch.Tensor)
        if self.recipe != "bf16":  # the FP8 kernels add into a float32 main_grad; a bf16 one gets .grad (the hook adds)
            return grouped_mlp(x, probs, counts, self.weight1, self.weight2, cfg, recipe=self.recipe,
                               fp8_weight_grads=self.fp8_weight_grads, fp8_weights=self._current_fp8_weights(cfg),
                               fuse_wgrad_accumulation=fuse and main_grad.dtype == torch.float32), None
        if self._delay_wgrad():
            return _DelayedWgrad.apply(x, probs, counts, self.weight1, self.weight2, self, cfg), None
        return grouped_mlp(x, probs, counts, self.weight1, self.weight2, cfg, fuse_wgrad_accumulation=fuse), None

    def _current_fp8_weights(self, cfg: Config) -> Fp8Weights:
        """The step's FP8 weights, quantized again at the first microbatch of a step (Megatron sets
        is_first_microbatch) or when the weights are other tensors or were changed in place through autograd.
        Outside Megatron's schedules, set is_first_microbatch = True after each optimizer step."""
        w = (self.weight1, self.weight2)
        seen = tuple((t.data_ptr(), t._version) for t in w)
        if self._fp8_weights is None or self._fp8_weights.device != self.weight1.device:
            self._fp8_weights = Fp8Weights(cfg, self.weight1.device, self.recipe)
        if self.is_first_microbatch or not self._fp8_weights.ready or seen != self._fp8_of:
            self._fp8_weights.refresh(*w)
            self._fp8_of = seen
        self.is_first_microbatch = False
        return self._fp8_weights

    def _delay_wgrad(self) -> bool:
        return bool(getattr(self.config, "delay_wgrad_compute", False)
                    or getattr(self.config, "overlap_dispatch_backward_with_experts_wgrad", False))

    def backward_dw(self):
        """The weight gradients of the backward passes run since the last call (delayed wgrad): into main_grad
        when the weights have one (added), else into .grad (added)."""
        from .functional import _grouped_mlp_impl
        from ._common import stream_handle
        pending, self._pending_wgrad = self._pending_wgrad, []
        for x, probs, counts, act, dy, d_h1, cfg in pending:
            out = {}
            for name, p in (("w1", self.weight1), ("w2", self.weight2)):
                mg = getattr(p, "main_grad", None)
                if isinstance(mg, torch.Tensor):
                    out[name] = mg
                    if hasattr(p, "grad_added_to_main_grad"):
                        p.grad_added_to_main_grad = True
                else:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    out[name] = p.grad
            _grouped_mlp_impl(cfg, x.device).backward_dw(x, probs, counts, act, dy, d_h1, out["w1"], None, out["w2"],
                                                         None, stream_handle(x.device), accumulate=True)
        for p in (self.weight1, self.weight2):
            hook = getattr(p, "post_wgrad_grad_acc_hook", None)
            if hook is not None:
                hook()

    # ---- checkpoints: Megatron's keys ----
    def _keys(self, i: int):
        if self.state_dict_layout == "sequential":
            return f"local_experts.{i}.linear_fc1.weight", f"local_experts.{i}.linear_fc2.weight"
        return f"linear_fc1.weight{i}", f"linear_fc2.weight{i}"

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for i in range(self.num_local_experts):
            k1, k2 = self._keys(i)
            w1, w2 = self.weight1[i], self.weight2[i]
            destination[prefix + k1] = w1 if keep_vars else w1.detach()
            destination[prefix + k2] = w2 if keep_vars else w2.detach()
            if self.state_dict_layout == "sequential":
                destination[prefix + f"local_experts.{i}.linear_fc1._extra_state"] = None
                destination[prefix + f"local_experts.{i}.linear_fc2._extra_state"] = None
        if self.state_dict_layout == "te-grouped":
            destination[prefix + "linear_fc1._extra_state"] = None
            destination[prefix + "linear_fc2._extra_state"] = None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        layouts = {
            "sequential": lambda i: (f"local_experts.{i}.linear_fc1.weight", f"local_experts.{i}.linear_fc2.weight"),
            "te-grouped": lambda i: (f"linear_fc1.weight{i}", f"linear_fc2.weight{i}"),
        }
        found = [name for name, keys in layouts.items() if prefix + keys(0)[0] in state_dict]
        if not found:
            for i in range(self.num_local_experts):
                missing_keys.extend(prefix + k for k in self._keys(i))
            return
        keys = layouts[found[0]]
        with torch.no_grad():
            for i in range(self.num_local_experts):
                for j, (param, k) in enumerate(zip((self.weight1, self.weight2), keys(i))):
                    t = state_dict.get(prefix + k)
                    if t is None:
                        missing_keys.append(prefix + k)
                    elif tuple(t.shape) != tuple(param.shape[1:]):
                        error_msgs.append(f"size mismatch for {prefix + k}: copying a param with shape "
                                          f"{tuple(t.shape)}, the shape in moerail's experts is {tuple(param.shape[1:])}")
                    else:
                        param[i].copy_(t)
        ours = {prefix + k for i in range(self.num_local_experts) for k in keys(i)}
        for k in state_dict:  # other experts' keys of the layout (more experts than this module has)
            rest = k[len(prefix):] if k.startswith(prefix) else None
            if rest is not None and k not in ours and not rest.endswith("_extra_state") and \
                    rest.startswith(("local_experts.", "linear_fc1.weight", "linear_fc2.weight")):
                unexpected_keys.append(k)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """SequentialMLP's sharded state dict (its keys, expert-axis offsets and replica ids), over views of
        weight1 and weight2."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton = (metadata or {}).get("singleton_local_shards", False)
        num_global = self.ep_size * self.num_local_experts
        first = (self.ep_group.rank() if self.ep_group is not None else 0) * self.num_local_experts
        out = {}
        for i in range(self.num_local_experts):
            g = first + i
            local_prefix = f"{prefix}local_experts.{i}."
            if singleton:
                sharded_prefix, offsets = f"{prefix}experts.{g}.", sharded_offsets
            else:
                sharded_prefix = f"{prefix}experts."
                offsets = (*sharded_offsets, (len(sharded_offsets), g, num_global))
            sd = {}
            for name, w, axis in (("linear_fc1", self.weight1[i], 0), ("linear_fc2", self.weight2[i], 1)):
                sub = make_sharded_tensors_for_checkpoint({"weight": w, "_extra_state": None},
                                                          f"{local_prefix}{name}.", {"weight": axis}, offsets,
                                                          tp_group=self.tp_group,
                                                          dp_cp_group=metadata["dp_cp_group"])
                if name == "linear_fc1" and self.config.gated_linear_unit:
                    k = f"{local_prefix}{name}.weight"
                    sub[k] = apply_swiglu_sharded_factory(sub[k], offsets, singleton, tp_group=self.tp_group,
                                                          dp_group=metadata["dp_cp_group"])
                sd.update(sub)
            replace_prefix_for_sharding(sd, local_prefix, sharded_prefix)
            for sh in sd.values():
                sh.replica_id = (*sh.replica_id[:2], self.dp_group.rank() if self.dp_group is not None else 0)
            if self.state_dict_layout == "te-grouped":  # the dict keys are the module's state-dict keys
                sd = {k.replace(f"{local_prefix}linear_fc1.weight", f"{prefix}linear_fc1.weight{i}")
                       .replace(f"{local_prefix}linear_fc2.weight", f"{prefix}linear_fc2.weight{i}"): v
                      for k, v in sd.items() if not k.endswith("_extra_state")}
            out.update(sd)
        return out


# ---- the layer and the switch ---------------------------------------------------------------------------------

class MoELayer(_MegatronMoELayer):
    """Megatron's MoELayer with moerail's token dispatcher (and, when the spec's experts are MoerailExperts, with
    moerail's experts fed the static receive buffer and device-side counts: no host sync in the layer). Everything
    else (router, shared experts and their overlap, recompute, CUDA-graph hooks) is Megatron's. Keyword options:
    those of MoerailTokenDispatcher (max_tokens, align, transport, sms, exact_rows)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, is_mtp_layer=False,
                 name=None, *, max_tokens: int | None = None, align: int | None = None, transport: str = "auto",
                 sms: int = 0, exact_rows: bool = True):
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         pg_collection=pg_collection, is_mtp_layer=is_mtp_layer, name=name)
        ours = isinstance(self.experts, MoerailExperts)
        self.token_dispatcher = MoerailTokenDispatcher(self.num_local_experts, self.local_expert_indices,
                                                       config=self.config, pg_collection=pg_collection,
                                                       max_tokens=max_tokens, align=align, transport=transport,
                                                       sms=sms, exact_rows=exact_rows, static_shapes=ours)
        if ours:
            self.experts.dispatcher = self.token_dispatcher
        if self.use_shared_expert and self.shared_expert_overlap:
            self.token_dispatcher.set_shared_experts(self.shared_experts)


def _is_moe_builder(obj) -> bool:
    f = obj.func if isinstance(obj, functools.partial) else getattr(obj, "module", None)
    return isinstance(f, type) and issubclass(f, _MegatronMoELayer)


def _moerail_builder(builder, experts: bool, fused_router: bool, options: dict):
    """The MoE builder `builder` (a functools.partial of MoELayer, as Megatron's GPT specs make it, or a
    ModuleSpec) with moerail's MoELayer and, if `experts`, MoerailExperts; if `fused_router`, MoerailRouter in place
    of Megatron's TopKRouter."""
    if isinstance(builder, functools.partial):
        submodules = builder.keywords.get("submodules")
        keywords = dict(builder.keywords)
    else:
        submodules, keywords = builder.submodules, dict(builder.params)
    if experts and submodules is not None:
        layout = "sequential"
        exp = submodules.experts
        cls = exp.func if isinstance(exp, functools.partial) else getattr(exp, "module", exp)
        if getattr(cls, "__name__", "") == "TEGroupedMLP":
            layout = "te-grouped"
        submodules = dataclasses.replace(submodules, experts=functools.partial(MoerailExperts,
                                                                               state_dict_layout=layout))
    if fused_router and submodules is not None and getattr(submodules, "router", None) is TopKRouter:
        submodules = dataclasses.replace(submodules, router=MoerailRouter)
    keywords.update(submodules=submodules, **options)
    return functools.partial(MoELayer, *getattr(builder, "args", ()), **keywords)


def use_moerail(spec, *, experts: bool = True, router: bool = True, **options):
    """A copy of a Megatron layer or block spec in which every MoE layer is moerail's MoELayer (moerail's token
    dispatcher) and, with experts=True, its experts MoerailExperts (keeping the state-dict keys of the experts it
    replaces: TEGroupedMLP's or SequentialMLP's); with router=True, Megatron's TopKRouter becomes MoerailRouter (the
    same parameters and keys; the top-k selection in moerail's fused router where it covers the settings).
    options: MoELayer's (max_tokens, align, transport, sms, exact_rows).
    Raises ValueError when the spec has no MoE layer."""
    found = []

    def walk(obj):
        if _is_moe_builder(obj):
            found.append(obj)
            return _moerail_builder(obj, experts, router, options)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            changes = {f.name: walk(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
            changes = {k: v for k, v in changes.items() if v is not getattr(obj, k)}
            return dataclasses.replace(obj, **changes) if changes else obj
        if isinstance(obj, (list, tuple)):
            new = [walk(o) for o in obj]
            return obj if all(a is b for a, b in zip(new, obj)) else type(obj)(new)
        return obj

    out = walk(spec)
    if not found:
        raise ValueError("use_moerail: the spec has no MoE layer (a MoELayer builder); build it with num_experts")
    return out


def check(model) -> None:
    """check() of every moerail dispatcher in `model` (one host synchronization): raises moerail.Error on capacity
    overflow or bad routing since the last check."""
    for m in model.modules():
        d = getattr(m, "token_dispatcher", None)
        if isinstance(d, MoerailTokenDispatcher):
            d.check()
