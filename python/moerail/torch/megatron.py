"""An adapter with the interface of Megatron-LM's MoE token dispatchers, on moerail's TokenDispatcher.

Megatron's MoELayer drives a dispatcher in six steps:

    hidden, probs = d.dispatch_preprocess(hidden, routing_map, probs)   # routing_map [T, E] bool, probs [T, E]
    hidden, probs = d.token_dispatch(hidden, probs)
    hidden, tokens_per_expert, probs = d.dispatch_postprocess(hidden, probs)
    ... experts(hidden, tokens_per_expert, probs) ...
    hidden = d.combine_preprocess(hidden)
    hidden = d.token_combine(hidden)
    hidden = d.combine_postprocess(hidden)

MoerailTokenDispatcher does the same with moerail's fused kernels (permutation, alignment padding and the
all-to-all in one pass each way). Rows come expert-major, each expert's rows padded with zero rows to a multiple of
cfg.align (what Megatron's moe_router_padding_for_fp8 / permute-and-pad does), so tokens_per_expert counts padded
rows. Under cfg.prob_mode = "in-activation" the experts get the permuted probs (Megatron's
moe_apply_probs_on_input off, probs applied in the activation); under "in-combine" combine applies them.

static_shapes=False (default) trims the expert input to the rows used, as Megatron's all-to-all dispatcher
delivers it, at the cost of one host read of the row count; static_shapes=True keeps the full receive buffer
(cfg.rows_per_rank rows; rows past the last segment are zero) and tokens_per_expert on the device: no host
synchronization, for CUDA graphs and for experts that take device-side counts (moerail.torch.grouped_mlp).

To switch a Megatron model over, construct it in place of the model's dispatcher, e.g. behind a flag:

    if args.moe_token_dispatcher_type == "moerail":
        self.token_dispatcher = MoerailTokenDispatcher(num_local_experts, local_expert_indices, config,
                                                       moe_config=moerail.make_config(...), group=ep_group)
"""
from __future__ import annotations

import torch

from .. import Config
from .functional import TokenDispatcher

__all__ = ["MoerailTokenDispatcher", "routing_map_to_topk"]


def routing_map_to_topk(routing_map: torch.Tensor, probs: torch.Tensor, topk: int):
    """Megatron's routing (routing_map [T, E] bool, probs [T, E]) as (topk_idx [T, K] int32, topk_probs [T, K]
    float32): each token's routed experts in ascending expert order, -1 (prob 0) where a token has fewer than K
    (a capacity drop). No host synchronization."""
    T, E = routing_map.shape
    if routing_map.dtype != torch.bool:
        raise ValueError(f"routing_map_to_topk: routing_map has dtype {routing_map.dtype}, expected torch.bool")
    if probs.shape != routing_map.shape:
        raise ValueError(f"routing_map_to_topk: probs {tuple(probs.shape)} and routing_map {tuple(routing_map.shape)} "
                         "differ")
    # Routed experts first, each group in ascending expert order (stable sort of the 0/1 map, descending).
    order = torch.sort(routing_map.to(torch.uint8), dim=1, descending=True, stable=True).indices[:, :topk]
    routed = torch.gather(routing_map, 1, order)
    topk_probs = torch.where(routed, torch.gather(probs.float(), 1, order), torch.zeros((), device=probs.device))
    topk_idx = torch.where(routed, order, torch.full_like(order, -1)).to(torch.int32)
    return topk_idx, topk_probs


class MoerailTokenDispatcher:
    """Megatron-LM's token dispatcher interface over moerail.torch.TokenDispatcher (see the module docstring).

    num_local_experts, local_expert_indices, config: as Megatron passes them (config, Megatron's
    TransformerConfig, is kept as `self.config` and not read otherwise). moe_config: the moerail.Config of the
    layer (its ep_size = the size of `group`, the expert-parallel group)."""

    def __init__(self, num_local_experts: int, local_expert_indices, config=None, *, moe_config: Config,
                 group=None, transport: str = "auto", sms: int = 0, static_shapes: bool = False,
                 device: torch.device | str | None = None):
        if num_local_experts != moe_config.local_experts:
            raise ValueError(f"MoerailTokenDispatcher: num_local_experts = {num_local_experts} but moe_config has "
                             f"{moe_config.local_experts} local experts")
        self.config = config
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.moe_config = moe_config
        self.static_shapes = static_shapes
        # static shapes hand the experts the whole receive buffer: its rows past the segments are zeroed
        self.dispatcher = TokenDispatcher(moe_config, group, device=device, transport=transport, sms=sms,
                                          zero_unused_rows=static_shapes)

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, self.hidden_shape[-1])
        self.topk_idx, self.topk_probs = routing_map_to_topk(routing_map.reshape(hidden.shape[0], -1),
                                                             probs.reshape(hidden.shape[0], -1),
                                                             self.moe_config.topk)
        return hidden, self.topk_probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        recv, recv_probs, self.tokens_per_expert, self.handle = self.dispatcher.dispatch(hidden_states, self.topk_idx,
                                                                                         probs)
        return recv, recv_probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        tpe = self.tokens_per_expert
        self.capacity_rows = hidden_states.shape[0]
        if not self.static_shapes:
            used = int(tpe.sum())  # one host read, as Megatron's own all-to-all dispatcher makes
            hidden_states, probs = hidden_states[:used], probs[:used]
        if self.moe_config.prob_mode == "in-combine":
            probs = torch.ones_like(probs)
        return hidden_states, tpe, probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        missing = self.capacity_rows - hidden_states.shape[0]
        if missing > 0:
            hidden_states = torch.cat([hidden_states, hidden_states.new_zeros((missing, hidden_states.shape[1]))])
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # the layout of this microbatch's dispatch; autograd keeps it for the backward passes
        handle, self.handle = self.handle, None
        return self.dispatcher.combine(hidden_states, handle, self.topk_probs)

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.view(self.hidden_shape)
