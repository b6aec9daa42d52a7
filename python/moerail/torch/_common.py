"""Helpers shared by moerail.torch: streams, row padding, the communicator of a process group."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _C


def stream_handle(device: torch.device) -> int:
    """The cudaStream_t of torch's current stream on `device`, as an int for the C++ core."""
    return torch.cuda.current_stream(device).cuda_stream


def resolve_device(device) -> torch.device:
    """torch.device of `device`, a CUDA device with its index (the current one when not given); None = the current
    CUDA device when there is one, else the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def capturing() -> bool:
    """True inside torch.cuda.graph capture on the current stream (no host reads then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """`t` as a contiguous tensor of exactly n rows: itself when it has n, else a new one whose first rows are t's
    (the rest left unwritten: the core reads only the rows below the token count it is given)."""
    t = t.contiguous()
    if t.shape[0] == n:
        return t
    if t.shape[0] > n:
        raise ValueError(f"moerail: {t.shape[0]} rows given, at most {n} (cfg.max_tokens) supported")
    out = t.new_empty((n,) + tuple(t.shape[1:]))
    out[: t.shape[0]].copy_(t)
    return out


def num_tokens_tensor(t: int, device: torch.device) -> torch.Tensor:
    """The token count as the [1] int32 device tensor the core reads (a fill kernel: graph-safe)."""
    return torch.full((1,), t, dtype=torch.int32, device=device)


def check_tensor(op: str, name: str, t: torch.Tensor, *, ndim: int | None = None, dtypes=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, expected {ndim} dimensions")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{op}: {name} has dtype {t.dtype}, expected one of {', '.join(map(str, dtypes))}")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device}, expected {device}")


_allocators: dict = {}


def torch_allocator(device: torch.device) -> "_C.Allocator":
    """moerail's device memory on `device` from PyTorch's caching allocator (uint8 tensors), so that
    torch.cuda.memory_allocated and max_memory_allocated count it and freed memory returns to PyTorch's pool.
    One per device, shared by the objects on it."""
    a = _allocators.get(device.index)
    if a is None:
        a = _allocators[device.index] = _C.Allocator(
            lambda n: torch.empty(int(n), dtype=torch.uint8, device=device))
    return a


def device_bytes(n: int, device: torch.device) -> torch.Tensor:
    """n bytes of device memory from PyTorch's allocator (a uint8 tensor, 512-byte aligned): the memory of a
    DispatchHandle or a MoeSaved."""
    return torch.empty(int(n), dtype=torch.uint8, device=device)


def token_count(op: str, x: torch.Tensor, num_tokens, max_tokens: int):
    """(T as a host int or None, the [1] int32 device tensor the core reads) for x [rows, ...] and the caller's
    num_tokens: None (T = x's rows, at most max_tokens) or a [1] int32 tensor on x's device holding T (then x has
    exactly max_tokens rows and T stays on the device: one captured graph replays with any T)."""
    if num_tokens is None:
        if x.shape[0] > max_tokens:
            raise ValueError(f"{op}: {x.shape[0]} tokens, cfg.max_tokens = {max_tokens}")
        return x.shape[0], (num_tokens_tensor(x.shape[0], x.device) if x.device.type == "cuda" else None)
    check_tensor(op, "num_tokens", num_tokens, dtypes=(torch.int32,), device=x.device)
    if x.device.type != "cuda":
        raise ValueError(f"{op}: num_tokens (a device token count) needs CUDA tensors")
    if tuple(num_tokens.shape) != (1,):
        raise ValueError(f"{op}: num_tokens has shape {tuple(num_tokens.shape)}, expected (1,)")
    if x.shape[0] != max_tokens:
        raise ValueError(f"{op}: with num_tokens on the device, x must have cfg.max_tokens = {max_tokens} rows "
                         f"(it has {x.shape[0]})")
    return None, num_tokens.contiguous()


_communicators: dict = {}


def communicator(group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> "_C.Communicator":
    """moerail's NCCL communicator over the ranks of `group` (the default group when None; a single rank when
    torch.distributed is not initialized), on `device` (the current CUDA device when None). Collective on first
    use for a group: rank 0 makes the NCCL unique id and broadcasts it through the group. Cached per group."""
    if not _C.with_nccl:
        raise RuntimeError("moerail was built without NCCL: no multi-GPU ops")
    device = resolve_device("cuda" if device is None else device)
    if dist.is_available() and dist.is_initialized():
        group = group if group is not None else dist.group.WORLD
        rank, size = dist.get_rank(group), dist.get_world_size(group)
    else:
        group, rank, size = None, 0, 1
    key = (id(group), device.index)
    comm = _communicators.get(key)
    if comm is None:
        uid = [_C.new_unique_id() if rank == 0 else None]
        if size > 1:
            dist.broadcast_object_list(uid, src=dist.get_global_rank(group, 0), group=group)
        comm = _C.Communicator(rank, size, device.index, uid[0], device.index)
        _communicators[key] = comm
    return comm


# The experts' precision recipes (moerail/recipe.h), each on both backends.
RECIPES = ("bf16", "fp8-blockwise", "fp8-tensor", "fp8-tensor-hybrid")
PER_TENSOR_RECIPES = ("fp8-tensor", "fp8-tensor-hybrid")


def check_recipe(op: str, recipe: str, device: torch.device) -> None:
    """Raises ValueError naming `recipe` when it is not a recipe."""
    del device  # every recipe runs on both backends
    if recipe not in RECIPES:
        raise ValueError(f"{op}: recipe = {recipe!r} (expected one of {', '.join(map(repr, RECIPES))})")

def expert_main_grads(op: str, weights: dict) -> dict:
    """{name: main_grad} of the expert weights in `weights` ({name: tensor or None}), each checked for the kernels'
    accumulation into it (fuse_wgrad_accumulation): a contiguous tensor of the weight's shape and device, bfloat16
    or float32 (Megatron-LM's fp32 gradient buffers), the same dtype for every weight."""
    out = {}
    for name, param in weights.items():
        if param is None:
            continue
        mg = getattr(param, "main_grad", None)
        what = f"{op} (fuse_wgrad_accumulation): {name}.main_grad"
        if not isinstance(mg, torch.Tensor):
            raise ValueError(f"{what} is absent: give each expert weight a main_grad tensor, or leave "
                             "fuse_wgrad_accumulation off")
        if mg.dtype not in (torch.bfloat16, torch.float32) or mg.shape != param.shape or mg.device != param.device:
            raise ValueError(f"{what} is {mg.dtype} {tuple(mg.shape)} on {mg.device}, expected bfloat16 or float32 "
                             f"{tuple(param.shape)} on {param.device}")
        first = next(iter(out.items()), None)
        if first is not None and mg.dtype != first[1].dtype:
            raise ValueError(f"{what} is {mg.dtype} but {first[0]}.main_grad is {first[1].dtype}: the kernels add "
                             "into one dtype")
        if not mg.is_contiguous():
            raise ValueError(f"{what} is not contiguous")
        out[name] = mg
    return out


def main_grad_placeholder(param):
    """What autograd gets for a weight whose gradient the kernels added into param.main_grad, by Megatron-LM's
    convention (as TransformerEngine's): with the attribute grad_added_to_main_grad, it is set and autograd gets a
    placeholder of the weight's shape (zeros when param.zero_out_wgrad asks for them), which Megatron's gradient hook
    drops instead of adding it; without the attribute, no gradient (None)."""
    if not hasattr(param, "grad_added_to_main_grad"):
        return None
    param.grad_added_to_main_grad = True
    make = torch.zeros_like if getattr(param, "zero_out_wgrad", False) else torch.empty_like
    return make(param, memory_format=torch.contiguous_format)
