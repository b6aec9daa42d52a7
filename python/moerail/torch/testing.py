"""The plain PyTorch MoE layer moerail is tested and benchmarked against: torch ops, autograd, and
torch.distributed.all_to_all_single for expert parallelism, the way Megatron-LM's all-to-all token dispatcher
does it (permute by a stable sort, exchange counts, all-to-all, per-expert GEMMs, the reverse, index_add_).

Same math as moerail's layer (moerail/reference/layer.h), in float32 from the layer's bfloat16 weights:
    logits = x W_router^T; (idx, w), aux, z = router(logits); y_e = p * (act(x W1_e^T + b1) W2_e^T + b2) on
    the expert's rank (p = w under cfg.prob_mode "in-activation", else 1 and combine multiplies);
    out = sum_k y (+ shared expert).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import Config
from .layer import activation

__all__ = ["torch_router", "torch_moe_layer"]


def torch_router(cfg: Config, logits: torch.Tensor, expert_bias: torch.Tensor | None = None,
                 topk_idx: torch.Tensor | None = None):
    """Router in float32 with autograd: (topk_idx [T, K] int64, weights [T, K], aux loss, z-loss). topk_idx, when
    given, replaces the selection (the weights are still computed here, with their gradient)."""
    x = logits.float()
    T, E, K = x.shape[0], cfg.num_experts, cfg.topk
    sig = cfg.score_function != "softmax"
    if sig:
        s = torch.sigmoid(x) if cfg.score_function == "sigmoid" else torch.sqrt(F.softplus(x))
        sel = s + (expert_bias.float() if expert_bias is not None else 0)
    else:
        s = torch.softmax(x, dim=-1) if cfg.pre_softmax else x
        sel = s
    if topk_idx is None:
        sel = sel.detach().double()
        if cfg.num_groups > 1:
            G, gt = cfg.num_groups, cfg.group_topk
            grouped = sel.view(T, G, E // G)
            gscore = grouped.topk(K // gt, dim=-1).values.sum(-1)
            keep = torch.zeros(T, G, dtype=torch.bool, device=x.device)
            keep.scatter_(1, gscore.topk(gt, dim=-1).indices, True)
            sel = sel.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
        topk_idx = sel.topk(K, dim=-1).indices
    topk_idx = topk_idx.long()
    w = torch.gather(s, 1, topk_idx)
    if not sig and not cfg.pre_softmax:
        w = torch.softmax(w, dim=-1)
    elif sig and K > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * cfg.scaling_factor
    aux = x.new_zeros(())
    if cfg.aux_loss_coeff > 0 and T > 0:
        a = torch.softmax(x, -1) if not sig else s / (s.sum(-1, keepdim=True) + 1e-20)
        tpe = torch.zeros(E, device=x.device).scatter_add_(
            0, a.detach().topk(K, dim=-1).indices.flatten(), torch.ones(T * K, device=x.device))
        aux = E * cfg.aux_loss_coeff / (K * T * T) * (a.sum(0) * tpe).sum()
    z = x.new_zeros(())
    if cfg.z_loss_coeff > 0 and T > 0:
        z = cfg.z_loss_coeff * torch.logsumexp(x, -1).square().mean()
    return topk_idx, w, aux, z


def torch_moe_layer(cfg: Config, x: torch.Tensor, router_weight: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                    b1=None, b2=None, shared_w1=None, shared_w2=None, expert_bias=None, group=None,
                    topk_idx: torch.Tensor | None = None):
    """The layer forward with autograd: returns (out [T, H] float32, aux loss, z-loss). Expert parallel over
    `group` (all_to_all_single) when torch.distributed is initialized and cfg.ep_size > 1; w1/w2/b1/b2 are this
    rank's L experts. topk_idx, when given, fixes the selection (see torch_router)."""
    xf = x.float()
    T, H, K, L = xf.shape[0], cfg.hidden, cfg.topk, cfg.local_experts
    R = cfg.ep_size
    logits = F.linear(x, router_weight)  # in x's dtype, as the layer's gate GEMM
    idx, w, aux, z = torch_router(cfg, logits, expert_bias, topk_idx)
    in_act = cfg.prob_mode == "in-activation"

    # Permute: slots sorted by expert (stable: token, then k, order inside an expert).
    flat_e = idx.flatten()
    order = torch.sort(flat_e, stable=True).indices
    tok = order // K
    perm_x = xf[tok]
    perm_w = w.flatten()[order]
    counts = torch.bincount(flat_e, minlength=cfg.num_experts)
    if R > 1:
        send_splits = counts.view(R, L).sum(1).tolist()
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
        recv_counts = recv_counts.view(R, L)  # [s, e]: rows source rank s sends to local expert e
        recv_splits = recv_counts.sum(1).tolist()
        perm_x = _all_to_all(perm_x, send_splits, recv_splits, group)
        perm_w = _all_to_all(perm_w.unsqueeze(1), send_splits, recv_splits, group).squeeze(1)
        # rows arrive source-major; regroup expert-major (inside an expert: by source rank, token, k)
        src_expert = torch.cat([torch.arange(L, device=x.device).repeat_interleave(recv_counts[s])
                                for s in range(R)])
        regroup = torch.sort(src_expert, stable=True).indices
        perm_x, perm_w = perm_x[regroup], perm_w[regroup]
        local_counts = recv_counts.sum(0)
    else:
        local_counts = counts
    ys, start = [], 0
    for e, n in enumerate(local_counts.tolist()):
        xe = perm_x[start:start + n]
        h = F.linear(xe, w1[e].float(), None if b1 is None else b1[e].float())
        ye = F.linear(activation(cfg, h), w2[e].float(), None if b2 is None else b2[e].float())
        ys.append(ye * perm_w[start:start + n, None] if in_act else ye)
        start += n
    y = torch.cat(ys) if ys else perm_x[:0]
    if R > 1:
        y = _all_to_all(y[torch.argsort(regroup)], recv_splits, send_splits, group)
    out = torch.zeros(T, H, device=x.device, dtype=torch.float32)
    if not in_act:
        y = y * w.flatten()[order][:, None]
    out = out.index_add(0, tok, y)
    if shared_w1 is not None:
        out = out + F.linear(activation(cfg, F.linear(xf, shared_w1.float())), shared_w2.float())
    return out, aux, z


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, d):
        out = d.new_empty((sum(ctx.send),) + tuple(d.shape[1:]))
        dist.all_to_all_single(out, d.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def _all_to_all(x, send, recv, group):
    return _AllToAll.apply(x, send, recv, group)
