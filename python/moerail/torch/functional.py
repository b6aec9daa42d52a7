"""moerail's ops as PyTorch autograd functions: router, dispatch/combine (TokenDispatcher), grouped_mlp.

CUDA tensors run on moerail's GPU kernels on torch's current stream, with no host synchronization (the token
count travels as a device tensor; outputs have static shapes), so they work under torch.cuda.graphs. CPU tensors
run on the CPU reference (double precision inside, rounded to the tensors' dtype), one rank only: the reference
backend, for tests and for machines without a GPU.

Shapes use the letters of the C++ core: T tokens, H hidden, E experts, K top-k, L local experts, F expert FFN
size, F1 = 2F for GLU activations (else F), C the receive capacity (cfg.rows_per_rank).
"""
from __future__ import annotations

import torch

from .. import _C
from .. import Config
from ._common import (PER_TENSOR_RECIPES, capturing, check_recipe, check_tensor, communicator, device_bytes,
                      expert_main_grads, main_grad_placeholder, num_tokens_tensor, resolve_device, rows, stream_handle,
                      token_count, torch_allocator)

__all__ = ["router", "TokenDispatcher", "DispatchHandle", "grouped_mlp", "quantize_fp8", "Fp8Weights"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# ---- router ---------------------------------------------------------------------------------------------------

class _Router(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, expert_bias, cfg, num_tokens):
        logits = logits.detach()
        T, E, K = logits.shape[0], cfg.num_experts, cfg.topk
        device_count = num_tokens is not None  # T on the device: [T_max] rows in and out, unrouted past T
        dev = logits.device
        idx = torch.empty((T, K), dtype=torch.int32, device=dev)
        probs = torch.empty((T, K), dtype=torch.float32, device=dev)
        losses = torch.zeros(2, dtype=torch.float32, device=dev)
        has_aux = cfg.aux_loss_coeff > 0
        tpe = None
        if dev.type == "cuda":
            Tm = cfg.max_tokens  # the kernels take [T_max, ...] buffers and read T from the device
            logits = rows(logits, Tm)
            if device_count:
                idx = torch.full((Tm, K), -1, dtype=torch.int32, device=dev)
                probs = torch.zeros((Tm, K), dtype=torch.float32, device=dev)
                nt, T = num_tokens, Tm
            else:
                idx = torch.empty((Tm, K), dtype=torch.int32, device=dev)
                probs = torch.empty((Tm, K), dtype=torch.float32, device=dev)
                nt = num_tokens_tensor(T, dev)
            tpe = torch.empty(E, dtype=torch.int32, device=dev) if has_aux else None
            ws_bytes = _C.router_workspace_bytes(cfg)
            ws = torch.empty(ws_bytes, dtype=torch.uint8, device=dev) if ws_bytes else None
            need_losses = has_aux or cfg.z_loss_coeff > 0
            _C.router_forward(cfg, logits, expert_bias, nt, idx, probs, losses if need_losses else None, tpe, ws,
                              stream_handle(dev))
            ctx.save_for_backward(logits, idx, nt, tpe if has_aux else None)
            idx, probs = idx[:T], probs[:T]
        else:
            aux, z, _ = _C.ref_router_forward(cfg, logits, expert_bias, idx, probs, -1)
            losses[0], losses[1] = aux, z
            ctx.save_for_backward(logits, idx, expert_bias)
        ctx.cfg, ctx.T, ctx.device_count = cfg, T, device_count
        ctx.mark_non_differentiable(idx)
        return idx, probs, losses

    @staticmethod
    def backward(ctx, _d_idx, d_probs, d_losses):
        cfg = ctx.cfg
        T = ctx.T
        if d_probs is None:
            d_probs = torch.zeros((T, cfg.topk), dtype=torch.float32, device=ctx.saved_tensors[0].device)
        d_probs = d_probs.float().contiguous()
        d_losses = (torch.zeros(2) if d_losses is None else d_losses).float().contiguous()
        logits = ctx.saved_tensors[0]
        if logits.device.type == "cuda":
            _, idx, nt, tpe = ctx.saved_tensors
            make = torch.zeros if ctx.device_count else torch.empty  # rows past a device T: zero
            d_logits = make(logits.shape, dtype=torch.float32, device=logits.device)
            _C.router_backward(cfg, logits, nt, idx, rows(d_probs, cfg.max_tokens), tpe, d_losses.to(logits.device),
                               d_logits, stream_handle(logits.device))
            d_logits = d_logits[:T]
        else:
            _, idx, bias = ctx.saved_tensors
            d_logits = torch.empty(logits.shape, dtype=torch.float64)
            _C.ref_router_backward(cfg, logits, bias, idx, d_probs, float(d_losses[0]), float(d_losses[1]), -1,
                                   d_logits)
        return d_logits.to(logits.dtype), None, None, None


def router(logits: torch.Tensor, cfg: Config, expert_bias: torch.Tensor | None = None,
           num_tokens: torch.Tensor | None = None):
    """The router (TransformerEngine's fused router semantics, cfg's score function, grouping, bias, scaling).

    logits [T, E] (float32/bfloat16/float16); expert_bias [E] float32 iff cfg.use_expert_bias.
    Returns (topk_idx [T, K] int32, topk_probs [T, K] float32, losses [2] float32 = (aux loss, z-loss));
    gradients flow from topk_probs and losses into logits. num_tokens (CUDA): a [1] int32 device tensor holding T;
    logits then has cfg.max_tokens rows, and the outputs too (rows t >= T unrouted: id -1, prob 0; their logits'
    gradient 0)."""
    op = "moerail.torch.router"
    check_tensor(op, "logits", logits, ndim=2, dtypes=_FLOATS)
    if logits.shape[1] != cfg.num_experts:
        raise ValueError(f"{op}: logits has {logits.shape[1]} columns, cfg.num_experts = {cfg.num_experts}")
    if cfg.use_expert_bias != (expert_bias is not None):
        raise ValueError(f"{op}: expert_bias must be given exactly when cfg.use_expert_bias "
                         f"(= {cfg.use_expert_bias})")
    if expert_bias is not None:
        check_tensor(op, "expert_bias", expert_bias, ndim=1, dtypes=(torch.float32,), device=logits.device)
        expert_bias = expert_bias.detach().contiguous()
    if num_tokens is not None:
        token_count(op, logits, num_tokens, cfg.max_tokens)
    return _Router.apply(logits.contiguous(), expert_bias, cfg, num_tokens)


# ---- dispatch and combine ---------------------------------------------------------------------------------------

class DispatchHandle:
    """What one dispatch leaves for its combine and both backward passes: its layout (plan, counts, row maps) in
    device memory from PyTorch's allocator (CUDA), or the reference's plan (CPU), and its token count. Returned by
    TokenDispatcher.dispatch; pass it to TokenDispatcher.combine. Autograd keeps it for the backward passes, so any
    number of dispatches of one TokenDispatcher may be in flight (microbatches of a pipeline schedule)."""

    __slots__ = ("dispatcher", "T", "num_tokens", "dtype", "capacity", "_core", "_plan")

    def __init__(self, dispatcher: "TokenDispatcher", T, num_tokens, dtype):
        self.dispatcher = dispatcher
        self.T = T                    # tokens (host int), or None when the count lives on the device
        self.num_tokens = num_tokens  # [1] int32 device tensor (CUDA)
        self.dtype = dtype
        self.capacity = dispatcher.capacity  # rows of its row-side buffers (recv, y and their gradients)
        self._core = None             # moerail._C.DispatchHandle (CUDA), which keeps its memory alive
        self._plan = None             # moerail.RefPlan (CPU)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """A token-side result [T_max, ...] cut to the caller's T rows (all of them when T is on the device)."""
        return t if self.T is None else t[: self.T]


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_probs, topk_idx, h: DispatchHandle):
        x, topk_probs = x.detach(), topk_probs.detach()
        recv, recv_probs, seg = h.dispatcher._dispatch(h, x, topk_idx, topk_probs)
        ctx.h = h
        ctx.mark_non_differentiable(seg)
        return recv, recv_probs, seg

    @staticmethod
    def backward(ctx, d_recv, d_recv_probs, _d_seg):
        h = ctx.h
        dx, d_probs = h.dispatcher._dispatch_backward(h, d_recv, d_recv_probs)
        return dx, d_probs, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, topk_probs, h: DispatchHandle):
        y, topk_probs = y.detach(), topk_probs.detach()
        out = h.dispatcher._combine(h, y, topk_probs)
        ctx.h = h
        # y enters the backward only when combine applies the probs (their gradient); else it is not kept
        ctx.in_combine = h.dispatcher.cfg.prob_mode == "in-combine"
        ctx.y_meta = (y.shape, y.dtype)
        ctx.save_for_backward(y if ctx.in_combine else None, topk_probs)
        return out

    @staticmethod
    def backward(ctx, d_out):
        h = ctx.h
        y, topk_probs = ctx.saved_tensors
        d_y, d_probs = h.dispatcher._combine_backward(h, d_out, y, topk_probs, ctx.y_meta)
        return d_y, d_probs, None


class TokenDispatcher:
    """Dispatch of tokens to the ranks holding their experts (fused with permutation and per-expert alignment
    padding) and combine (fused with unpermutation and the prob-weighted sum), with autograd.

    On CUDA: moerail's expert-parallel Dispatcher over the ranks of `group` (NVLink kernels or NCCL send/recv,
    `transport` = "auto" | "nvlink" | "host"; `sms` blocks for the data kernels, 0 = default; `ranks_per_node` on
    the host transport: the ranks grouped into nodes of that many, rows crossing between nodes once per token and
    node, docs/multinode.md, 0 = flat, -1 = each GPU's NVLink domain); cfg.ep_size must be the group's size (1 without torch.distributed). Its device memory comes from PyTorch's caching allocator (but the
    NVLink transport's NCCL window: `window_bytes`). On the CPU: the reference, one rank.

    Each dispatch returns a DispatchHandle with its layout; its combine takes it, and autograd keeps it for both
    backward passes: any number of microbatches may be in flight, their combines and backward passes in any order.
    The ops of one TokenDispatcher run on one stream at a time and, being collective, in the same order on every
    rank. check=True reads the device status word after each eager dispatch (one host synchronization; never under
    graph capture) and raises on capacity overflow or bad routing. zero_unused_rows=True writes zeros to the rows of
    recv and recv_probs past the last segment (a pass over them), for experts that read the whole buffer; by default
    only the routed and pad rows are written.

    Row-side buffers (recv, the experts' output y, their gradients) have `capacity` rows by default: the most a rank
    can receive under cfg, with nothing read on the host (capturable). exact_rows=True sizes them to the rows each
    dispatch actually brings (handle.capacity, at least 1): the dispatch plans first and reads that count on the host
    (one synchronization per dispatch, as a dropless all-to-all makes), so memory follows the routing rather than
    the worst case; not capturable."""

    def __init__(self, cfg: Config, group=None, *, device: torch.device | str | None = None,
                 transport: str = "auto", sms: int = 0, check: bool = True, zero_unused_rows: bool = False,
                 exact_rows: bool = False, ranks_per_node: int = 0):
        cfg.validate()
        self.cfg = cfg.copy()
        self.device = resolve_device(device)
        self.check = check
        self.zero_unused_rows = zero_unused_rows
        self.exact_rows = exact_rows
        self._impl = None
        if self.device.type == "cuda":
            comm = communicator(group, self.device)
            if comm.size != cfg.ep_size:
                raise ValueError(f"moerail.torch.TokenDispatcher: cfg.ep_size = {cfg.ep_size} but the process group "
                                 f"has {comm.size} ranks")
            with torch.cuda.device(self.device):
                self._impl = _C.Dispatcher(self.cfg, comm, transport, sms, allocator=torch_allocator(self.device),
                                           ranks_per_node=ranks_per_node)
            self.capacity = self._impl.capacity
        else:
            if cfg.ep_size != 1:
                raise ValueError("moerail.torch.TokenDispatcher: the CPU reference backend runs one rank "
                                 f"(cfg.ep_size = {cfg.ep_size})")
            if ranks_per_node not in (-1, 0, 1):
                raise ValueError(f"moerail.torch.TokenDispatcher: ranks_per_node = {ranks_per_node} on one rank "
                                 "(expected -1, 0 or 1)")
            self.capacity = cfg.rows_per_rank

    @property
    def window_bytes(self) -> int:
        """Device bytes of the NCCL window (the NVLink transport's staging area), which PyTorch's allocator does
        not hold; 0 otherwise."""
        return self._impl.window_bytes if self._impl is not None else 0

    # The public, differentiable ops.
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_probs: torch.Tensor,
                 num_tokens: torch.Tensor | None = None):
        """x [T, H], topk_idx [T, K] int32 (-1 = unrouted), topk_probs [T, K] float32 ->
        (recv [C, H], recv_probs [C] float32, rows_per_expert [L] int32, handle): rows expert-major, each expert's
        segment padded with zero rows to a multiple of cfg.align; rows past the last segment are not written (but
        with zero_unused_rows). C = handle.capacity: self.capacity, or under exact_rows the rows this dispatch brings.
        Gradients flow into x and topk_probs; pass `handle` to combine.

        num_tokens (CUDA): a [1] int32 device tensor holding T; x, topk_idx and topk_probs then have
        cfg.max_tokens rows (rows t >= T are not read), and the token-side results of combine and of the backward
        passes have cfg.max_tokens rows, zero past T: one captured graph replays with any T."""
        op = "moerail.torch.TokenDispatcher.dispatch"
        check_tensor(op, "x", x, ndim=2, dtypes=_FLOATS, device=self.device)
        check_tensor(op, "topk_idx", topk_idx, ndim=2, dtypes=(torch.int32,), device=self.device)
        check_tensor(op, "topk_probs", topk_probs, ndim=2, dtypes=(torch.float32,), device=self.device)
        if x.shape[1] != self.cfg.hidden or topk_idx.shape != (x.shape[0], self.cfg.topk) \
                or topk_probs.shape != topk_idx.shape:
            raise ValueError(f"{op}: shapes x {tuple(x.shape)}, topk_idx {tuple(topk_idx.shape)}, topk_probs "
                             f"{tuple(topk_probs.shape)} do not match [T, {self.cfg.hidden}], [T, {self.cfg.topk}]")
        T, nt = token_count(op, x, num_tokens, self.cfg.max_tokens)
        h = DispatchHandle(self, T, nt, x.dtype)
        recv, recv_probs, seg = _Dispatch.apply(x, topk_probs, topk_idx, h)
        return recv, recv_probs, seg, h

    def combine(self, y: torch.Tensor, handle: DispatchHandle, topk_probs: torch.Tensor | None = None) -> torch.Tensor:
        """y [C, H] (the experts' output over the layout of `handle`'s dispatch, C = handle.capacity) -> out [T, H]:
        every token's K rows summed in fp32 in k order (times topk_probs when cfg.prob_mode = "in-combine"; then
        topk_probs, the ones given to that dispatch, is required and receives its gradient)."""
        op = "moerail.torch.TokenDispatcher.combine"
        if not isinstance(handle, DispatchHandle) or handle.dispatcher is not self:
            raise ValueError(f"{op}: handle must be the DispatchHandle that this TokenDispatcher's dispatch returned")
        check_tensor(op, "y", y, ndim=2, dtypes=_FLOATS, device=self.device)
        if tuple(y.shape) != (handle.capacity, self.cfg.hidden):
            raise ValueError(f"{op}: y has shape {tuple(y.shape)}, expected ({handle.capacity}, {self.cfg.hidden}): "
                             "the rows of its dispatch's recv")
        if self.cfg.prob_mode == "in-combine" and topk_probs is None:
            raise ValueError(f"{op}: cfg.prob_mode = in-combine needs topk_probs")
        if topk_probs is None:
            rows = self.cfg.max_tokens if handle.T is None else handle.T
            topk_probs = torch.zeros((rows, self.cfg.topk), dtype=torch.float32, device=self.device)
        return _Combine.apply(y, topk_probs, handle)

    # The work, per backend.
    def _token_buffer(self, h: DispatchHandle, cols: int, dtype) -> torch.Tensor:
        """A token-side output [T_max, cols]: zero past T when T is on the device (the kernels write rows t < T)."""
        make = torch.zeros if h.T is None else torch.empty
        return make((self.cfg.max_tokens, cols), dtype=dtype, device=self.device)

    def _dispatch(self, h: DispatchHandle, x, topk_idx, topk_probs):
        cfg, C = self.cfg, self.capacity
        if self.exact_rows and capturing():
            raise RuntimeError("moerail.torch.TokenDispatcher: exact_rows reads each dispatch's row count on the host "
                               "and cannot be captured in a CUDA graph (use exact_rows=False: static buffers)")
        if self._impl is not None:
            s = stream_handle(x.device)
            Tm = cfg.max_tokens
            h._core = self._impl.make_handle(device_bytes(self._impl.handle_bytes, x.device))
            idx, probs = rows(topk_idx, Tm), rows(topk_probs, Tm)
            planned = None
            if self.exact_rows:
                planned = self._impl.plan(idx, probs, h.num_tokens, s, h._core)
                C = h.capacity = max(1, planned)
            recv = torch.empty((C, cfg.hidden), dtype=x.dtype, device=x.device)  # pad rows written by the kernel
            recv_probs = torch.empty(C, dtype=torch.float32, device=x.device)
            self._impl.dispatch(rows(x, Tm), idx, probs, h.num_tokens, recv, recv_probs, s, h._core)
            if self.zero_unused_rows:
                if planned is None:
                    self._impl.zero_unused_rows(recv, recv_probs, s, h._core)
                elif planned < C:  # no rows landed: the one row of the buffer is not the kernels'
                    recv[planned:].zero_()
                    recv_probs[planned:].zero_()
            seg = torch.empty(cfg.local_experts, dtype=torch.int32, device=x.device)
            self._impl.segment_rows(seg, s, h._core)
            if self.check and not capturing():
                self._impl.check(s)
            return recv, recv_probs, seg
        h._plan = _C.RefPlan(cfg, topk_idx.contiguous(), C)
        if self.exact_rows:  # the same layout in a buffer of its rows
            C = h.capacity = max(1, h._plan.rows_used)
            h._plan = _C.RefPlan(cfg, topk_idx.contiguous(), C)
        recv = torch.zeros((C, cfg.hidden), dtype=x.dtype)
        recv_probs = torch.zeros(C, dtype=torch.float32)
        h._plan.dispatch(x.contiguous(), topk_probs.contiguous(), recv, recv_probs)
        return recv, recv_probs, torch.tensor(h._plan.segment_rows, dtype=torch.int32)

    def _dispatch_backward(self, h: DispatchHandle, d_recv, d_recv_probs):
        cfg = self.cfg
        d_recv = (torch.zeros((h.capacity, cfg.hidden), dtype=h.dtype, device=self.device)
                  if d_recv is None else d_recv.contiguous())
        d_recv_probs = (torch.zeros(h.capacity, dtype=torch.float32, device=self.device)
                        if d_recv_probs is None else d_recv_probs.float().contiguous())
        if self._impl is not None:
            dx = self._token_buffer(h, cfg.hidden, d_recv.dtype)
            d_probs = self._token_buffer(h, cfg.topk, torch.float32)
            self._impl.dispatch_backward(d_recv, d_recv_probs, dx, d_probs, stream_handle(self.device), h._core)
            return h.rows(dx), h.rows(d_probs)
        dx = torch.empty((h.T, cfg.hidden), dtype=d_recv.dtype)
        d_probs = torch.empty((h.T, cfg.topk), dtype=torch.float32)
        h._plan.dispatch_backward(d_recv, d_recv_probs, dx, d_probs)
        return dx, d_probs

    def _combine(self, h: DispatchHandle, y, topk_probs):
        cfg = self.cfg
        if self._impl is not None:
            out = self._token_buffer(h, cfg.hidden, y.dtype)
            self._impl.combine(cfg.prob_mode, y.contiguous(), out, stream_handle(self.device), h._core)
            return h.rows(out)
        out = torch.empty((h.T, cfg.hidden), dtype=y.dtype)
        h._plan.combine(y.contiguous(), topk_probs.contiguous(), out)
        return out

    def _combine_backward(self, h: DispatchHandle, d_out, y, topk_probs, y_meta):
        """y: the combine's input when cfg.prob_mode is in-combine, else None (y_meta: its shape and dtype)."""
        cfg = self.cfg
        shape, dtype = y_meta
        if self._impl is not None:
            d_y = torch.empty(shape, dtype=dtype, device=self.device)
            d_probs = self._token_buffer(h, cfg.topk, torch.float32)
            self._impl.combine_backward(cfg.prob_mode, rows(d_out.to(dtype), cfg.max_tokens),
                                        None if y is None else y.contiguous(), d_y, d_probs,
                                        stream_handle(self.device), h._core)
            return d_y, h.rows(d_probs)
        d_y = torch.empty(shape, dtype=dtype)
        d_probs = torch.empty((h.T, cfg.topk), dtype=torch.float32)
        y = torch.zeros(shape, dtype=dtype) if y is None else y.contiguous()  # (the reference reads it; p = 1)
        h._plan.combine_backward(d_out.to(dtype).contiguous(), y, topk_probs.contiguous(), d_y, d_probs)
        return d_y, d_probs


# ---- grouped expert MLP -----------------------------------------------------------------------------------------

_mlps: dict = {}


def _grouped_mlp_impl(cfg: Config, device: torch.device) -> "_C.GroupedMlp":
    key = (cfg.summary(), cfg.glu_block, cfg.fc1_bias, cfg.fc2_bias, device.index)
    mlp = _mlps.get(key)
    if mlp is None:
        with torch.cuda.device(device):
            mlp = _mlps[key] = _C.GroupedMlp(cfg, allocator=torch_allocator(device))
    return mlp


def _workspace(nbytes: int, dx: torch.Tensor) -> torch.Tensor:
    """The backward's scratch: dx's memory when it is large enough (the core's contract allows it: the scratch is
    dead before FC1's dgrad writes dx), else new memory."""
    if dx.numel() * dx.element_size() >= nbytes:
        return dx.view(-1).view(torch.uint8)[:nbytes]
    return torch.empty(nbytes, dtype=torch.uint8, device=dx.device)


class _GroupedMlp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probs, counts, w1, w2, b1, b2, cfg, fused, recipe, fp8_weight_grads):
        x, probs, w1, w2 = x.detach(), probs.detach(), w1.detach(), w2.detach()
        b1, b2 = (None if b is None else b.detach() for b in (b1, b2))
        R, H, F, F1 = x.shape[0], cfg.hidden, cfg.ffn_hidden, cfg.fc1_out
        dev = x.device
        in_act = cfg.prob_mode == "in-activation"
        if dev.type == "cuda":
            y = torch.empty((R, H), dtype=x.dtype, device=dev)  # rows past the last segment are not written
            h1 = torch.empty((R, F1), dtype=x.dtype, device=dev)
            act = torch.empty((R, F), dtype=x.dtype, device=dev)
            _grouped_mlp_impl(cfg, dev).forward(x, probs if in_act else None, counts, w1, b1, w2, b2, y, h1, act,
                                                stream_handle(dev))
            ctx.save_for_backward(x, probs, counts, w1, w2, b1, b2, act)
            # h1 (FC1's output) is read by the data backward only: held on ctx, not saved, so that the backward can
            # free it before the weight gradients are allocated (the step's peak). (Saved-tensor hooks do not see it.)
            ctx.h1 = h1
        else:
            y = torch.zeros((R, H), dtype=x.dtype, device=dev)
            ctx.rows = [int(c) for c in counts.tolist()]
            _C.ref_experts_forward(cfg, x, probs if in_act else None, ctx.rows, w1, b1, w2, b2, y, recipe=recipe)
            ctx.recipe = recipe
            ctx.fp8_weight_grads = fp8_weight_grads
            ctx.save_for_backward(x, probs, counts, w1, w2, b1, b2)
        ctx.cfg = cfg
        ctx.fused = fused  # (weights, main_grads) by name under fuse_wgrad_accumulation, else None
        return y

    @staticmethod
    def backward(ctx, dy):
        cfg = ctx.cfg
        in_act = cfg.prob_mode == "in-activation"
        dy = dy.contiguous()
        x, probs, counts, w1, w2, b1, b2 = ctx.saved_tensors[:7]
        dev = x.device
        make = torch.empty if dev.type == "cuda" else torch.zeros  # the kernels write the segments' rows
        dx = make(x.shape, dtype=x.dtype, device=dev)
        d_probs = make(x.shape[0], dtype=torch.float32, device=dev)
        main_grads = ctx.fused[1] if ctx.fused else {}

        def grad_out(name, t):  # main_grad under fuse_wgrad_accumulation, else a new tensor
            if t is None:
                return None
            return main_grads[name] if name in main_grads else torch.empty_like(t)

        if dev.type == "cuda":
            act, h1 = ctx.saved_tensors[7], ctx.h1
            if h1 is None:
                raise RuntimeError("moerail.torch.grouped_mlp: a second backward through the same forward "
                                   "(retain_graph) is not supported: its FC1 output is freed by the first")
            ctx.h1 = None
            mlp = _grouped_mlp_impl(cfg, dev)
            s = stream_handle(dev)
            p = probs if in_act else None
            d_h1 = torch.empty_like(h1)
            ws = _workspace(mlp.backward_workspace_bytes(x.shape[0]), dx)
            # the data gradients, then (h1 freed) the weight gradients: the same kernels as one backward() call
            mlp.backward(x, p, counts, w1, b1, w2, b2, h1, act, dy, dx, d_probs, d_h1, ws, None, None, None, None, s)
            del h1
            dw1, dw2, db1, db2 = grad_out("w1", w1), grad_out("w2", w2), grad_out("b1", b1), grad_out("b2", b2)
            mlp.backward_dw(x, p, counts, act, dy, d_h1, dw1, db1, dw2, db2, s, accumulate=bool(main_grads))
            if main_grads:  # the gradients went into main_grad
                weights = ctx.fused[0]
                dw1, dw2, db1, db2 = (None if weights[n] is None else main_grad_placeholder(weights[n])
                                      for n in ("w1", "w2", "b1", "b2"))
        else:
            dw1, dw2, db1, db2 = grad_out("w1", w1), grad_out("w2", w2), grad_out("b1", b1), grad_out("b2", b2)
            _C.ref_experts_backward(cfg, x, probs if in_act else None, ctx.rows, w1, b1, w2, b2, dy, dx, d_probs,
                                    dw1, db1, dw2, db2, recipe=ctx.recipe, fp8_weight_grads=ctx.fp8_weight_grads)
        return dx, (d_probs if in_act else None), None, dw1, dw2, db1, db2, None, None, None, None


# ---- the FP8 grouped MLP on CUDA (recipes fp8-blockwise, fp8-tensor, fp8-tensor-hybrid) --------------------------

_fp8_mlps: dict = {}


def _fp8_mlp_impl(cfg: Config, device: torch.device, weight_grads: str, recipe: str) -> "_C.Fp8GroupedMlp":
    key = (cfg.summary(), cfg.glu_block, weight_grads, recipe, device.index)
    mlp = _fp8_mlps.get(key)
    if mlp is None:
        with torch.cuda.device(device):
            mlp = _fp8_mlps[key] = _C.Fp8GroupedMlp(cfg, weight_grads, allocator=torch_allocator(device),
                                                    recipe=recipe)
    return mlp


class Fp8Weights:
    """The FP8 weights of one grouped expert MLP (CUDA): w1 [L, F1, H] and w2 [L, H, F] quantized to e4m3 as
    `recipe` scales them (fp8-blockwise: 128x128 blocks; the per-tensor recipes: one scale per expert matrix), with the
    transposed copies the data gradients read, in one device buffer. Weights are quantized once per optimizer step,
    not once per microbatch: call refresh(w1, w2) after every update of the bf16 weights (an optimizer step, a load),
    then pass the object to each grouped_mlp(..., fp8_weights=) of that step (whose recipe must be the same). The
    layout follows L, H, F and F1 (the activation's FC1 width) of cfg: grouped_mlp checks them."""

    def __init__(self, cfg: Config, device: torch.device | str | None = None, recipe: str = "fp8-blockwise"):
        self.device = resolve_device(device)
        if self.device.type != "cuda":
            raise ValueError("moerail.torch.Fp8Weights: the FP8 weights live on a CUDA device (the CPU runs the "
                             "reference recipe over the bf16 weights)")
        if recipe not in ("fp8-blockwise",) + PER_TENSOR_RECIPES:
            raise ValueError(f"moerail.torch.Fp8Weights: recipe = {recipe!r} (expected 'fp8-blockwise', "
                             "'fp8-tensor' or 'fp8-tensor-hybrid')")
        self.cfg = cfg.copy()
        self.recipe = recipe
        with torch.cuda.device(self.device):
            nbytes = _C.fp8_mlp_weights_bytes(self.cfg, recipe)
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.ready = False

    @torch.no_grad()
    def refresh(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        """Quantizes w1 and w2 (bf16, on this device) into the buffer, on the current stream."""
        L, H, F, F1 = self.cfg.local_experts, self.cfg.hidden, self.cfg.ffn_hidden, self.cfg.fc1_out
        op = "moerail.torch.Fp8Weights.refresh"
        for name, t, shape in (("w1", w1, (L, F1, H)), ("w2", w2, (L, H, F))):
            check_tensor(op, name, t, dtypes=(torch.bfloat16,), device=self.device)
            if tuple(t.shape) != shape:
                raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, expected {shape}")
        with torch.cuda.device(self.device):
            _C.quantize_mlp_weights_fp8(self.cfg, w1.detach().contiguous(), w2.detach().contiguous(), self.buffer,
                                        stream_handle(self.device), self.recipe)
        self.ready = True

    def matches(self, cfg: Config) -> bool:
        """Whether these weights have cfg's layout (L, H, F, F1)."""
        a, b = self.cfg, cfg
        return (a.local_experts, a.hidden, a.ffn_hidden, a.fc1_out) == (b.local_experts, b.hidden, b.ffn_hidden, b.fc1_out)


class _Fp8GroupedMlp(torch.autograd.Function):
    """The FP8 step of the routed experts (moerail/experts_fp8.h): x quantized (1x128 in one pass, or one scale per
    expert: an amax pass, then the codes), the GEMMs in FP8 over the step's quantized weights, every gradient in one
    backward call."""

    @staticmethod
    def forward(ctx, x, probs, counts, w1, w2, cfg, fp8_weights, weight_grads, fused, recipe, x_fp8):
        dev, R = x.device, x.shape[0]
        H, F, F1 = cfg.hidden, cfg.ffn_hidden, cfg.fc1_out
        in_act = cfg.prob_mode == "in-activation"
        s = stream_handle(dev)
        if fp8_weights is None:  # quantized for this call alone
            fp8_weights = Fp8Weights(cfg, dev, recipe)
            fp8_weights.refresh(w1, w2)
        wq = fp8_weights.buffer
        if x_fp8 is not None:  # the caller's codes and scales (checked by grouped_mlp)
            xq, xs = x_fp8[0].view(torch.uint8), x_fp8[1]
        else:
            xq, xs = _quantize_x(x.detach(), counts, cfg, recipe, s)
        mlp = _fp8_mlp_impl(cfg, dev, weight_grads, recipe)
        y = torch.empty((R, H), dtype=x.dtype, device=dev)  # rows past the last segment are not written
        h1 = torch.empty((R, F1), dtype=x.dtype, device=dev)
        act = torch.empty((R, F), dtype=x.dtype, device=dev)
        ws = torch.empty(mlp.forward_workspace_bytes(R), dtype=torch.uint8, device=dev)
        mlp.forward(cfg, xq, xs, probs.detach() if in_act else None, counts, wq, y, h1, act, ws, s)
        ctx.save_for_backward(xq, xs, probs, counts, act, wq)
        ctx.h1 = h1  # read by the backward's data call only: freed before the weight gradients' memory is taken
        ctx.cfg, ctx.weight_grads, ctx.recipe, ctx.w_shapes = cfg, weight_grads, recipe, (w1.shape, w2.shape)
        ctx.fused = fused  # (weights, main_grads) by name under fuse_wgrad_accumulation, else None
        return y

    @staticmethod
    def backward(ctx, dy):
        cfg = ctx.cfg
        in_act = cfg.prob_mode == "in-activation"
        xq, xs, probs, counts, act, wq = ctx.saved_tensors
        h1, ctx.h1 = ctx.h1, None
        if h1 is None:
            raise RuntimeError("moerail.torch.grouped_mlp: a second backward through the same forward "
                               "(retain_graph) is not supported: its FC1 output is freed by the first")
        dev, R = xq.device, xq.shape[0]
        s = stream_handle(dev)
        mlp = _fp8_mlp_impl(cfg, dev, ctx.weight_grads, ctx.recipe)
        dy, p = dy.contiguous(), (probs if in_act else None)
        dx = torch.empty((R, cfg.hidden), dtype=dy.dtype, device=dev)
        d_probs = torch.empty(R, dtype=torch.float32, device=dev) if in_act else None
        d_h1 = torch.empty_like(h1)
        ws = torch.empty(mlp.backward_workspace_bytes(R), dtype=torch.uint8, device=dev)
        # the data gradients, staging the weight gradients' quantized copies of dy and d_h1 in ws; h1 freed; then
        # the weight gradients over them (the step's peak holds no h1)
        mlp.backward(cfg, xq, xs, p, counts, wq, h1, act, dy, dx, d_probs, d_h1, None, None, ws, s,
                     wgrad_operands="stage")
        del h1
        if ctx.fused:  # added into the fp32 main_grad buffers; autograd gets Megatron's placeholders
            weights, main_grads = ctx.fused
            mlp.backward(cfg, xq, xs, p, counts, wq, None, act, dy, None, None, d_h1, main_grads["w1"],
                         main_grads["w2"], ws, s, wgrad_operands="staged", accumulate=True)
            dw1, dw2 = main_grad_placeholder(weights["w1"]), main_grad_placeholder(weights["w2"])
        else:
            dw1 = torch.empty(ctx.w_shapes[0], dtype=dy.dtype, device=dev)
            dw2 = torch.empty(ctx.w_shapes[1], dtype=dy.dtype, device=dev)
            mlp.backward(cfg, xq, xs, p, counts, wq, None, act, dy, None, None, d_h1, dw1, dw2, ws, s,
                         wgrad_operands="staged")
        return dx, d_probs, None, dw1, dw2, None, None, None, None, None, None


def _quantize_x(x: torch.Tensor, counts: torch.Tensor, cfg: Config, recipe: str, s: int, zero_tail: bool = False):
    """x [R, H] bf16 on CUDA -> (codes as uint8 [R, H], scales) as `recipe` quantizes the experts' input; per tensor
    the rows past the segments are not written (zero_tail: code 0)."""
    dev, R, H = x.device, x.shape[0], x.shape[1]
    if recipe in PER_TENSOR_RECIPES:  # x e4m3 in both (the hybrid recipe's e5m2 is the gradients')
        xq = (torch.zeros if zero_tail else torch.empty)((R, H), dtype=torch.uint8, device=dev)
        xs = torch.empty(cfg.local_experts, dtype=torch.float32, device=dev)
        _C.quantize_fp8_experts(x, counts, xq, xs, s)
    else:
        xq = torch.empty((R, H), dtype=torch.uint8, device=dev)
        xs = torch.empty((R, H // 128), dtype=torch.float32, device=dev)
        _C.quantize_fp8_1x128(x, torch.full((1,), R, dtype=torch.int32, device=dev), xq, xs, s)
    return xq, xs


def quantize_fp8(x: torch.Tensor, cfg: Config, recipe: str = "fp8-blockwise",
                 rows_per_expert: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [C, H] bfloat16 on CUDA, quantized as the FP8 `recipe` quantizes the experts' input (moerail/quant.h):
    returns (codes [C, H] torch.float8_e4m3fn, scales float32). "fp8-blockwise": DeepSeek-V3's 1x128 blocks, scales
    [C, H / 128] (amax / 448 of each block); "fp8-tensor" and "fp8-tensor-hybrid": one scale per expert's segment of
    rows, scales [cfg.local_experts] (rows_per_expert [L] int32/int64 on x's device, read there; rows past the last
    segment get code 0). Bit for bit what grouped_mlp does when it quantizes x itself; grouped_mlp(..., x_fp8=) takes
    the pair, as it takes one a caller made in its own FP8 dispatch."""
    op = "moerail.torch.quantize_fp8"
    check_tensor(op, "x", x, ndim=2, dtypes=(torch.bfloat16,))
    if x.device.type != "cuda":
        raise ValueError(f"{op}: x is on {x.device}; the FP8 quantizers run on CUDA")
    if recipe not in ("fp8-blockwise",) + PER_TENSOR_RECIPES:
        raise ValueError(f"{op}: recipe = {recipe!r} (expected 'fp8-blockwise', 'fp8-tensor' or 'fp8-tensor-hybrid')")
    if x.shape[1] != cfg.hidden or cfg.hidden % 128:
        raise ValueError(f"{op}: x has shape {tuple(x.shape)}, expected [C, cfg.hidden = {cfg.hidden}] with "
                         "cfg.hidden a multiple of 128")
    if recipe in PER_TENSOR_RECIPES:
        if rows_per_expert is None:
            raise ValueError(f"{op}: recipe {recipe!r} needs rows_per_expert (one scale per expert's rows)")
        check_tensor(op, "rows_per_expert", rows_per_expert, ndim=1, dtypes=(torch.int32, torch.int64),
                     device=x.device)
        if rows_per_expert.shape[0] != cfg.local_experts:
            raise ValueError(f"{op}: rows_per_expert has shape {tuple(rows_per_expert.shape)}, expected "
                             f"[{cfg.local_experts}]")
    with torch.cuda.device(x.device):
        xq, xs = _quantize_x(x.contiguous(), None if rows_per_expert is None else rows_per_expert.contiguous(), cfg,
                             recipe, stream_handle(x.device), zero_tail=True)
    return xq.view(torch.float8_e4m3fn), xs


def _check_x_fp8(op: str, x_fp8, x: torch.Tensor, cfg: Config, recipe: str) -> None:
    """x_fp8 = (codes, scales) of x as quantize_fp8 gives them for `recipe`; raises ValueError (TypeError for a part
    that is not a tensor) naming the part."""
    if not (isinstance(x_fp8, (tuple, list)) and len(x_fp8) == 2):
        raise ValueError(f"{op}: x_fp8 must be a pair (codes, scales), as quantize_fp8 returns")
    codes, scales = x_fp8
    check_tensor(op, "x_fp8[0] (codes)", codes, ndim=2, dtypes=(torch.float8_e4m3fn,), device=x.device)
    check_tensor(op, "x_fp8[1] (scales)", scales, dtypes=(torch.float32,), device=x.device)
    want = (cfg.local_experts,) if recipe in PER_TENSOR_RECIPES else (x.shape[0], cfg.hidden // 128)
    if tuple(codes.shape) != tuple(x.shape) or tuple(scales.shape) != want:
        raise ValueError(f"{op}: x_fp8 has codes {tuple(codes.shape)} and scales {tuple(scales.shape)}; recipe "
                         f"{recipe!r} with x {tuple(x.shape)} expects codes {tuple(x.shape)} and scales {want}")
    if not (codes.is_contiguous() and scales.is_contiguous()):
        raise ValueError(f"{op}: x_fp8's codes and scales must be contiguous")


def grouped_mlp(x: torch.Tensor, probs: torch.Tensor, rows_per_expert: torch.Tensor, w1: torch.Tensor,
                w2: torch.Tensor, cfg: Config, b1: torch.Tensor | None = None,
                b2: torch.Tensor | None = None, fuse_wgrad_accumulation: bool = False,
                recipe: str = "bf16", fp8_weight_grads: str = "fp8",
                fp8_weights: Fp8Weights | None = None,
                x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The grouped expert MLP over the expert-major layout of dispatch:
    y[r] = p[r] * (act(x[r] W1[e]^T + b1[e]) W2[e]^T + b2[e]) for the rows r of expert e's segment (p = 1 when
    cfg.prob_mode = "in-combine"). x [C, H], probs [C] float32, rows_per_expert [L] int32/int64 (on x's device:
    read there, never on the host, on CUDA), w1 [L, F1, H], w2 [L, H, F], b1 [L, F1], b2 [L, H]. On CUDA every
    tensor is bfloat16 but probs and rows_per_expert. Rows past the last segment are not written on CUDA (zeros on
    the CPU), nor are their gradients: nothing reads them. Gradients flow into
    x, probs and the weights. fuse_wgrad_accumulation (CUDA): the kernels add the weights' gradients into each
    weight's `main_grad` instead, as moerail.torch.MoELayer's option of that name (Megatron-LM's convention).
    recipe: "bf16", "fp8-blockwise", "fp8-tensor" or "fp8-tensor-hybrid"; the per-tensor recipes are current
    scaling with one scale per expert tensor, the hybrid one with e5m2 gradients (moerail/recipe.h). The FP8
    recipes: on CUDA the FP8 step (x quantized 1x128 in one pass, or per expert; every GEMM in FP8,
    moerail/experts_fp8.h; H and F multiples of 128, no biases; fuse_wgrad_accumulation with float32 main_grad
    only; the per-tensor recipes with fp8_weight_grads "fp8" only), on the CPU the
    reference recipe (every GEMM operand quantized and dequantized where the FP8 step quantizes it,
    moerail/reference/experts.h). fp8_weight_grads: the FP8 recipe's weight gradients, "fp8" (the recipe's) or
    "bf16" (over the bf16 dy, act and d_h1 and x's FP8 value dequantized, without the recipe's quantized copies;
    moerail/recipe.h). fp8_weights (CUDA, an FP8 recipe): the step's quantized weights (Fp8Weights of the same
    recipe, refreshed after each update of w1 and w2); without it every call quantizes w1 and w2 first. x_fp8 (CUDA,
    an FP8 recipe): x already quantized, (codes float8_e4m3fn [C, H], scales) as quantize_fp8 returns them for the
    recipe (e.g. rows a caller's own FP8 dispatch delivered): the FP8 GEMMs read these codes and x is not
    quantized; x stays the tensor its gradient flows to (bf16 [C, H]; its values are not read)."""
    op = "moerail.torch.grouped_mlp"
    L, H, F, F1 = cfg.local_experts, cfg.hidden, cfg.ffn_hidden, cfg.fc1_out
    check_tensor(op, "x", x, ndim=2, dtypes=_FLOATS)
    dev = x.device
    check_tensor(op, "probs", probs, ndim=1, dtypes=(torch.float32,), device=dev)
    check_tensor(op, "rows_per_expert", rows_per_expert, ndim=1, dtypes=(torch.int32, torch.int64), device=dev)
    for name, t, shape in (("w1", w1, (L, F1, H)), ("w2", w2, (L, H, F)), ("b1", b1, (L, F1)), ("b2", b2, (L, H))):
        if t is None:
            continue
        check_tensor(op, name, t, dtypes=(x.dtype,), device=dev)
        if tuple(t.shape) != shape:
            raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, expected {shape}")
    if (b1 is not None) != cfg.fc1_bias or (b2 is not None) != cfg.fc2_bias:
        raise ValueError(f"{op}: b1/b2 must be given exactly when cfg.fc1_bias/fc2_bias "
                         f"(= {cfg.fc1_bias}/{cfg.fc2_bias})")
    if x.shape[1] != H or probs.shape[0] != x.shape[0] or rows_per_expert.shape[0] != L:
        raise ValueError(f"{op}: x {tuple(x.shape)}, probs {tuple(probs.shape)}, rows_per_expert "
                         f"{tuple(rows_per_expert.shape)} do not match [C, {H}], [C], [{L}]")
    check_recipe(op, recipe, dev)
    if fp8_weight_grads not in ("fp8", "bf16"):
        raise ValueError(f"{op}: fp8_weight_grads = {fp8_weight_grads!r} (expected 'fp8' or 'bf16')")
    if recipe != "bf16" and dev.type == "cuda":
        fused = None
        if fuse_wgrad_accumulation:
            weights = {"w1": w1, "w2": w2}
            main_grads = expert_main_grads(op, weights)
            if main_grads["w1"].dtype != torch.float32:
                raise ValueError(f"{op}: fuse_wgrad_accumulation with recipe {recipe!r} adds into float32 "
                                 f"main_grad buffers, got {main_grads['w1'].dtype}")
            fused = (weights, main_grads)
        if b1 is not None or b2 is not None:
            raise ValueError(f"{op}: recipe {recipe!r} has no expert biases")
        if x.dtype != torch.bfloat16:
            raise ValueError(f"{op}: recipe {recipe!r} on CUDA takes bfloat16 x and weights, got {x.dtype}")
        if H % 128 or F % 128:
            raise ValueError(f"{op}: recipe {recipe!r} needs H and F multiples of 128 (H = {H}, F = {F})")
        if fp8_weights is not None and fp8_weights.recipe != recipe:
            raise ValueError(f"{op}: fp8_weights were made for recipe {fp8_weights.recipe!r}, the call runs "
                             f"{recipe!r}")
        if fp8_weights is not None and (fp8_weights.device != dev or not fp8_weights.ready):
            raise ValueError(f"{op}: fp8_weights must be refreshed on {dev} before use")
        if recipe in PER_TENSOR_RECIPES and fp8_weight_grads != "fp8":
            raise ValueError(f"{op}: fp8_weight_grads = {fp8_weight_grads!r} with recipe {recipe!r} (bf16 weight "
                             "gradients run with 'fp8-blockwise' only)")
        if fp8_weights is not None and not fp8_weights.matches(cfg):
            raise ValueError(f"{op}: fp8_weights were made for L, H, F, F1 = {fp8_weights.cfg.local_experts}, "
                             f"{fp8_weights.cfg.hidden}, {fp8_weights.cfg.ffn_hidden}, {fp8_weights.cfg.fc1_out}; "
                             f"cfg has {L}, {H}, {F}, {F1}")
        if x_fp8 is not None:
            _check_x_fp8(op, x_fp8, x, cfg, recipe)
        return _Fp8GroupedMlp.apply(x.contiguous(), probs.contiguous(), rows_per_expert.contiguous(), w1.contiguous(),
                                    w2.contiguous(), cfg, fp8_weights, fp8_weight_grads, fused, recipe, x_fp8)
    if fp8_weights is not None and recipe == "bf16":
        raise ValueError(f"{op}: fp8_weights with recipe 'bf16'")
    if x_fp8 is not None:
        raise ValueError(f"{op}: x_fp8 is for an FP8 recipe on CUDA tensors (recipe {recipe!r} on {dev})")
    fused = None
    if fuse_wgrad_accumulation:
        if dev.type != "cuda":
            raise ValueError(f"{op}: fuse_wgrad_accumulation needs CUDA tensors (the reference backend's gradients "
                             "go through autograd)")
        weights = {"w1": w1, "w2": w2, "b1": b1, "b2": b2}
        fused = (weights, expert_main_grads(op, weights))
    c = lambda t: None if t is None else t.contiguous()  # noqa: E731
    return _GroupedMlp.apply(x.contiguous(), probs.contiguous(), rows_per_expert.contiguous(), w1.contiguous(),
                             w2.contiguous(), c(b1), c(b2), cfg, fused, recipe, fp8_weight_grads)
