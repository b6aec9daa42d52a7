"""moerail for PyTorch: autograd functions, the MoE layer as an nn.Module, and the Megatron-LM adapter.

    router(logits, cfg, expert_bias)                 -> topk_idx, topk_probs, losses
    TokenDispatcher(cfg, group).dispatch(x, idx, p)  -> recv, recv_probs, rows_per_expert, handle
                               .combine(y, handle, p) -> out  (any number of handles in flight)
    grouped_mlp(recv, recv_probs, rows_per_expert, w1, w2, cfg)   (recipe="fp8-blockwise": with Fp8Weights)
    quantize_fp8(x, cfg, recipe, rows_per_expert)    -> codes (float8_e4m3fn), scales: grouped_mlp's x_fp8
    MoELayer(cfg, group)                             the whole layer (one fused C++ node on CUDA)
    megatron.MoerailTokenDispatcher                  Megatron-LM's token dispatcher interface
    testing.torch_moe_layer                          the plain PyTorch layer the tests compare against

CUDA tensors run on moerail's kernels on the current stream without host synchronization (graph-capturable);
CPU tensors run on the CPU reference, one rank. Process groups: an existing torch.distributed group (NCCL
unique id broadcast through it); cfg.ep_size must equal its size.
"""
from .functional import DispatchHandle, Fp8Weights, TokenDispatcher, grouped_mlp, quantize_fp8, router
from .layer import MoELayer
from ._common import communicator

__all__ = ["router", "TokenDispatcher", "DispatchHandle", "grouped_mlp", "quantize_fp8", "Fp8Weights", "MoELayer",
           "communicator"]
