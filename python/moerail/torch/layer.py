"""moerail.torch.MoELayer: the whole MoE layer as a torch.nn.Module.

On CUDA the layer is moerail's C++ MoeLayer (router gate, router, dispatch, grouped experts, combine, optional
shared expert on a side stream; backward with the expert weight gradients last), one
autograd node, on torch's current stream, with no host synchronization when check=False (graph-capturable with
torch.cuda.graph). On the CPU it is the same math composed from moerail.torch.functional's ops on the reference
backend, one rank.

Parameters of this rank: router_weight [E, H], w1 [L, F1, H], w2 [L, H, F] (b1 [L, F1], b2 [L, H] when
cfg.fc1_bias/fc2_bias), shared_w1 [F1s, H], shared_w2 [H, Fs] when cfg.shared_expert_ffn > 0; buffer expert_bias
[E] float32 when cfg.use_expert_bias. The experts are this rank's; the router and shared expert are replicated
over the group and each rank's gradient is its own tokens' share (sum them in the data-parallel all-reduce, as for
any replicated weight).

The router losses: aux loss and z-loss (cfg.aux_loss_coeff, cfg.z_loss_coeff, already scaled by them) enter the
backward with weight `loss_grad_scale` (1 by default; set it as Megatron's MoEAuxLossAutoScaler is set, e.g. to
1 / number of microbatches); after each forward, `aux_loss` and `z_loss` hold their values (detached) to log.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import Config
from .. import _C
from . import functional as MF
from ._common import (capturing, check_recipe, check_tensor, communicator, device_bytes, expert_main_grads,
                      main_grad_placeholder, resolve_device, rows, stream_handle, token_count, torch_allocator)

__all__ = ["MoELayer", "activation"]


def activation(cfg: Config, h: torch.Tensor) -> torch.Tensor:
    """cfg's activation on FC1 outputs h [..., F1] (plain torch ops; GLU halves concatenated)."""
    a = cfg.activation
    if a in ("swiglu", "geglu", "quick-geglu"):
        g, lin = h.chunk(2, dim=-1)
        if a == "swiglu":
            return F.silu(g) * lin
        if a == "geglu":
            return F.gelu(g, approximate="tanh") * lin
        lim = cfg.quick_geglu_limit
        g = g.clamp(max=lim)
        return g * torch.sigmoid(cfg.quick_geglu_alpha * g) * (lin.clamp(-lim, lim) + cfg.quick_geglu_offset)
    if a == "relu2":
        return F.relu(h).square()
    return F.gelu(h, approximate="tanh")


class _AttachLosses(torch.autograd.Function):
    """Identity on `out` whose backward also sends `scale` as the gradient of the losses (Megatron's way of adding
    the router losses to the training loss without the caller adding them)."""

    @staticmethod
    def forward(ctx, out, losses, scale):
        ctx.save_for_backward(scale)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, d_out):
        (scale,) = ctx.saved_tensors
        return d_out, scale.expand(2).contiguous(), None


class _LayerFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, nt, T, module: "MoELayer", *params):
        cfg, dev = module.cfg, x.device
        x, params = x.detach(), [t.detach() for t in params]
        p = module._param_dict(params)
        Tm = cfg.max_tokens
        x_full = rows(x, Tm)
        # T on the device (T is None): rows past it are zero in out and dx, as a caller's padding expects
        out = (torch.zeros if T is None else torch.empty)((Tm, cfg.hidden), dtype=x.dtype, device=dev)
        s = stream_handle(dev)
        # what this forward keeps for its backward, in memory from PyTorch's allocator: any number of forwards may
        # precede their backwards (pipeline schedules)
        saved = module._impl.make_saved(device_bytes(module._impl.saved_bytes, dev))
        module._impl.forward(x_full, nt, out, p["router_weight"], module._bias(), p["w1"], p.get("b1"), p["w2"],
                             p.get("b2"), p.get("shared_w1"), p.get("shared_w2"), s, saved)
        ctx.module, ctx.T, ctx.saved_state = module, T, saved
        ctx.save_for_backward(x_full, nt, *params)
        losses = torch.empty(2, dtype=torch.float32, device=dev)
        module._router_out = (torch.empty((Tm, cfg.topk), dtype=torch.int32, device=dev),
                              torch.empty((Tm, cfg.topk), dtype=torch.float32, device=dev))
        module._impl.router_outputs(*module._router_out, losses, s)
        if module.check and not capturing():
            module._impl.check(s)
        return (out if T is None else out[:T]), losses

    @staticmethod
    def backward(ctx, d_out, d_losses):
        m: MoELayer = ctx.module
        cfg, dev = m.cfg, d_out.device
        x_full, nt, *params = ctx.saved_tensors
        p = m._param_dict(params)
        fused = m._expert_main_grads() if m.fuse_wgrad_accumulation else {}
        grads = {name: fused[name] if name in fused else torch.empty_like(t) for name, t in p.items()}
        dx = torch.zeros_like(x_full) if ctx.T is None else torch.empty_like(x_full)
        d_losses = torch.zeros(2, dtype=torch.float32, device=dev) if d_losses is None else d_losses.float()
        m._impl.backward(rows(d_out.to(x_full.dtype), cfg.max_tokens), dx, d_losses.contiguous(),
                         grads["router_weight"], grads["w1"], grads.get("b1"), grads["w2"], grads.get("b2"),
                         grads.get("shared_w1"), grads.get("shared_w2"), stream_handle(dev),
                         accumulate_experts=bool(fused), saved=ctx.saved_state)
        ctx.saved_state = None  # its memory goes back to PyTorch's pool
        for name in fused:  # what autograd gets for a weight whose gradient went into main_grad
            grads[name] = main_grad_placeholder(getattr(m, name))
        return (dx if ctx.T is None else dx[: ctx.T], None, None, None, *(grads[name] for name in m._param_names))



class MoELayer(torch.nn.Module):
    """A Mixture-of-Experts layer: router -> dispatch -> experts -> combine (+ shared expert).

    cfg: moerail.Config (bf16 on CUDA); cfg.ep_size must equal the size of `group` (the default process group
    when torch.distributed is initialized, else a single rank). The local experts of this rank are experts
    [rank * L, (rank + 1) * L). x: [T, H] or [S, B, H] with T = S * B <= cfg.max_tokens; returns the same shape.

    device: "cuda" (the current device) or "cpu" (the reference backend). transport / sms: of the expert-parallel
    communication ("auto" | "nvlink" | "host"; 0 = default SMs). chunks: split each step's tokens into this many
    chunks (dividing cfg.max_tokens) whose dispatch and combine run beside the other chunks' expert GEMMs; the
    outputs and data gradients are the same bits for any value (unless a chunk overflows its capacity), the expert
    weight gradients sum the chunks in order (the reference backend ignores it). check: after each eager forward,
    read the status word (one host synchronization) and raise on capacity overflow or bad routing; never read under
    graph capture.

    Microbatches in flight: each forward keeps what its backward needs (saved_bytes, from PyTorch's allocator) in its
    autograd node, so any number of forwards may precede their backwards, in any order (pipeline-parallel
    schedules); each gives the bits it gives alone. The layer's own buffers (workspace_bytes) come from PyTorch's
    allocator too, but the NVLink transport's NCCL window (window_bytes), so torch.cuda.memory_allocated counts them.
    The capacity policy is cfg's: capacity_factor (per expert, Megatron's moe_expert_capacity_factor),
    rank_capacity_factor (per rank), or neither (worst case, never drops).

    fuse_wgrad_accumulation (CUDA): the expert weights' gradients (w1, w2, b1, b2) are added by the weight-gradient
    kernels into each weight's `main_grad` (a contiguous tensor of its shape on its device: Megatron-LM's gradient
    buffer), with no pass of its own. bfloat16: each element becomes bf16(main_grad + g), as `main_grad += g` would
    give. float32 (Megatron-LM's default under bf16 training): main_grad + g in fp32, g being the GEMMs' fp32 sum
    (not rounded to bf16); under an FP8 recipe float32 only. Every expert weight's main_grad has the same
    dtype. As in Megatron-LM and TransformerEngine, a weight with the attribute `grad_added_to_main_grad` gets it set
    to True and autograd gets a placeholder gradient (zeros if `zero_out_wgrad` is set) that Megatron's hook
    drops; without the attribute autograd gets no gradient for it (hooks on its gradient do not run). The router and
    shared-expert gradients go through autograd as usual.

    recipe: "bf16" (the default), "fp8-blockwise", "fp8-tensor" or "fp8-tensor-hybrid". "fp8-blockwise" is
    DeepSeek-V3's FP8 training recipe for the routed experts: x is quantized to e4m3 with 1x128 scales inside the
    dispatch (FP8 crosses the links), the expert GEMMs run in FP8
    (weights in 128x128 blocks), everything else stays bf16 (moerail/layer.h); on the CPU the reference backend
    quantizes and dequantizes at the same points (moerail/reference/experts.h). On CUDA the FP8 weights are made
    once per optimizer step: a forward whose w1 or w2 changed since the last quantization quantizes them first. A
    change is seen when PyTorch counts it on the parameter (an optimizer step, load_state_dict, any in-place op on
    the parameter itself); writes through `.data` or by a collective into the storage are not counted: after those,
    call refresh_fp8_weights(), or let refresh_fp8_weights_after(optimizer) call it after every optimizer step. It
    must also be called before the replays of a captured graph once the weights have changed. Needs
    hidden and ffn_hidden multiples of 128 (and on CUDA: no expert biases, chunks = 1; fuse_wgrad_accumulation into
    float32 main_grad only).
    "fp8-tensor" and "fp8-tensor-hybrid": per-tensor current scaling, each expert's GEMM operands with one scale
    each (from their own amax), e4m3, or e5m2 gradients under the hybrid one (moerail/recipe.h); on CUDA they
    dispatch bf16 rows and quantize each expert's rows after the dispatch, as fp8-blockwise otherwise (weights
    refreshed the same way, fp8_weight_grads "fp8" only); on the CPU reference backend hidden and ffn_hidden
    multiples of 16 suffice.
    fp8_weight_grads: where an FP8 recipe's expert weight gradients run: "fp8" (the default, the recipe's FP8 GEMMs
    over quantized copies of their operands) or "bf16" (bf16 GEMMs over the step's bf16 tensors: no quantized
    copies; faster at DeepSeek-V3's shape on H200s, docs/fp8.md); not read under recipe "bf16".
    """

    def __init__(self, cfg: Config, group=None, *, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.bfloat16, transport: str = "auto", sms: int = 0, chunks: int = 1,
                 check: bool = True, init_std: float | None = None, fuse_wgrad_accumulation: bool = False,
                 recipe: str = "bf16", fp8_weight_grads: str = "fp8"):
        super().__init__()
        cfg.validate()
        if not 1 <= chunks <= _C.max_chunks or cfg.max_tokens % chunks != 0:
            raise ValueError(f"moerail.torch.MoELayer: chunks = {chunks} must be in 1..{_C.max_chunks} and divide "
                             f"cfg.max_tokens = {cfg.max_tokens}")
        self.cfg = cfg.copy()
        device = resolve_device(device)
        self.check = check
        self.loss_grad_scale = 1.0
        if fuse_wgrad_accumulation and device.type != "cuda":
            raise ValueError("moerail.torch.MoELayer: fuse_wgrad_accumulation needs the CUDA backend (the reference "
                             "backend's gradients go through autograd)")
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        check_recipe("moerail.torch.MoELayer", recipe, device)
        if fp8_weight_grads not in ("fp8", "bf16"):
            raise ValueError(f"moerail.torch.MoELayer: fp8_weight_grads = {fp8_weight_grads!r} (expected 'fp8' or "
                             "'bf16')")
        self.recipe = recipe
        self.fp8_weight_grads = fp8_weight_grads
        self._fp8_versions = None  # _weight_versions() when the FP8 weights were made
        E, H, L, F_, F1 = cfg.num_experts, cfg.hidden, cfg.local_experts, cfg.ffn_hidden, cfg.fc1_out

        def param(*shape, fan_in):
            std = init_std if init_std is not None else 1.0 / math.sqrt(fan_in)
            return torch.nn.Parameter(torch.randn(*shape, device=device, dtype=torch.float32).mul_(std).to(dtype))

        self.router_weight = param(E, H, fan_in=H)
        self.w1 = param(L, F1, H, fan_in=H)
        self.w2 = param(L, H, F_, fan_in=F_)
        self.b1 = torch.nn.Parameter(torch.zeros(L, F1, device=device, dtype=dtype)) if cfg.fc1_bias else None
        self.b2 = torch.nn.Parameter(torch.zeros(L, H, device=device, dtype=dtype)) if cfg.fc2_bias else None
        self.shared_w1 = self.shared_w2 = None
        if cfg.shared_expert_ffn > 0:
            scfg = cfg.shared_expert_config()
            self.shared_w1 = param(scfg.fc1_out, H, fan_in=H)
            self.shared_w2 = param(H, scfg.ffn_hidden, fan_in=scfg.ffn_hidden)
        self.register_buffer("expert_bias", torch.zeros(E, device=device) if cfg.use_expert_bias else None)
        self._param_names = [n for n in ("router_weight", "w1", "w2", "b1", "b2", "shared_w1", "shared_w2")
                             if getattr(self, n) is not None]
        self.aux_loss = self.z_loss = None
        self._impl = None
        if device.type == "cuda":
            if dtype != torch.bfloat16:
                raise ValueError("moerail.torch.MoELayer: CUDA layers are bfloat16")
            comm = communicator(group, device)
            if comm.size != cfg.ep_size:
                raise ValueError(f"moerail.torch.MoELayer: cfg.ep_size = {cfg.ep_size} but the process group has "
                                 f"{comm.size} ranks")
            with torch.cuda.device(device):
                self._impl = _C.MoeLayer(self.cfg, comm, transport, sms, chunks,
                                         allocator=torch_allocator(device), recipe=recipe,
                                         fp8_weight_grads=fp8_weight_grads)
        else:
            self._dispatcher = MF.TokenDispatcher(self.cfg, device="cpu")

    def refresh_fp8_weights(self) -> None:
        """An FP8 recipe: quantizes w1 and w2 into the layer's FP8 weights now (on the current stream)."""
        if self.recipe == "bf16":
            raise RuntimeError("moerail.torch.MoELayer.refresh_fp8_weights: the layer's recipe is bf16")
        if self._impl is None:
            return  # the reference backend quantizes the weights in every call
        dev = self.w1.device
        with torch.cuda.device(dev):
            self._impl.refresh_fp8_weights(self.w1.detach(), self.w2.detach(), stream_handle(dev))
        self._fp8_versions = self._weight_versions()

    def refresh_fp8_weights_after(self, optimizer: torch.optim.Optimizer):
        """Quantizes the FP8 weights after every step of `optimizer` (a step post-hook); returns the hook's handle
        (its .remove() undoes it)."""
        if self.recipe == "bf16":
            raise RuntimeError("moerail.torch.MoELayer.refresh_fp8_weights_after: the layer's recipe is bf16")
        return optimizer.register_step_post_hook(lambda opt, args, kwargs: self.refresh_fp8_weights())

    def _weight_versions(self):
        """What identifies the values of w1 and w2: their storage and PyTorch's count of in-place changes."""
        return tuple((w.data_ptr(), w._version) for w in (self.w1, self.w2))

    def _expert_main_grads(self):
        """{name: main_grad} of the expert weights, each checked (fuse_wgrad_accumulation)."""
        op = "moerail.torch.MoELayer"
        out = expert_main_grads(op, {n: getattr(self, n) for n in ("w1", "w2", "b1", "b2")})
        if self.recipe != "bf16" and out["w1"].dtype != torch.float32:
            raise ValueError(f"{op} (fuse_wgrad_accumulation): w1.main_grad is {out['w1'].dtype}; recipe "
                             f"{self.recipe!r} adds the expert weight gradients into float32 main_grad only")
        return out

    def _bias(self):
        return None if self.expert_bias is None else self.expert_bias.detach().float().contiguous()

    def _param_dict(self, params):
        return dict(zip(self._param_names, params))

    @property
    def capacity(self) -> int:
        """Rows of this rank's receive buffer."""
        return self._impl.capacity if self._impl is not None else self.cfg.rows_per_rank

    @property
    def saved_bytes(self) -> int:
        """Device bytes one forward keeps for its backward (from PyTorch's allocator; CUDA), per microbatch in
        flight: the router's outputs, the dispatch layout, the received rows, FC1's output and the activation."""
        return self._impl.saved_bytes if self._impl is not None else 0

    @property
    def workspace_bytes(self) -> int:
        """Device bytes the layer holds for its lifetime (CUDA), of which window_bytes from NCCL and the rest from
        PyTorch's allocator."""
        return self._impl.workspace_bytes if self._impl is not None else 0

    @property
    def window_bytes(self) -> int:
        """Device bytes of the NCCL window of the NVLink transport, which PyTorch's statistics do not see."""
        return self._impl.window_bytes if self._impl is not None else 0

    def routing(self):
        """(topk_idx [T, K] int32, topk_probs [T, K] float32) of the last forward (device tensors, no sync; with a
        device token count, [T_max, K])."""
        idx, probs = self._router_out
        return (idx, probs) if self._T is None else (idx[: self._T], probs[: self._T])

    def forward(self, x: torch.Tensor, num_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] or [S, B, H] -> the same shape. num_tokens (CUDA): a [1] int32 device tensor holding T; x then
        has cfg.max_tokens tokens, of which the first T are real (a packed batch's padding after them), and the
        output and x's gradient are zero past T: one captured graph replays with any T."""
        op = "moerail.torch.MoELayer"
        check_tensor(op, "x", x, dtypes=(self.router_weight.dtype,), device=self.router_weight.device)
        shape = x.shape
        if shape[-1] != self.cfg.hidden:
            raise ValueError(f"{op}: x has shape {tuple(shape)}, expected [..., {self.cfg.hidden}]")
        x2 = x.reshape(-1, self.cfg.hidden)
        if num_tokens is not None and self._impl is None:
            raise ValueError(f"{op}: num_tokens (a device token count) needs the CUDA backend")
        T, nt = token_count(op, x2, num_tokens, self.cfg.max_tokens)
        self._T = T
        params = [getattr(self, n) for n in self._param_names]
        if self._impl is not None and self.recipe != "bf16" and not capturing() and \
                self._fp8_versions != self._weight_versions():
            self.refresh_fp8_weights()
        if self._impl is not None:
            out, losses = _LayerFn.apply(x2, nt, T, self, *params)
        else:
            out, losses = self._forward_reference(x2)
        self.aux_loss, self.z_loss = losses.detach()[0], losses.detach()[1]
        scale = torch.full((1,), float(self.loss_grad_scale), dtype=torch.float32, device=x.device)
        out = _AttachLosses.apply(out, losses, scale)
        return out.reshape(shape)

    def _forward_reference(self, x):
        cfg = self.cfg
        logits = F.linear(x, self.router_weight)
        idx, probs, losses = MF.router(logits, cfg, self._bias())
        self._router_out = (idx, probs)
        recv, recv_probs, seg, handle = self._dispatcher.dispatch(x, idx, probs)
        y = MF.grouped_mlp(recv, recv_probs, seg, self.w1, self.w2, cfg, self.b1, self.b2, recipe=self.recipe,
                           fp8_weight_grads=self.fp8_weight_grads)
        out = self._dispatcher.combine(y, handle, probs)
        if self.shared_w1 is not None:
            out = out + F.linear(activation(cfg, F.linear(x, self.shared_w1)), self.shared_w2)
        return out, losses
