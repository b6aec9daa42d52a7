"""moerail: the token path of an expert-parallel Mixture-of-Experts layer on NVIDIA GPUs.

The C++ core (moerail._C) does the work; this package gives it a Python face:

    moerail.Config, moerail.make_config(...)   the shape and options of one MoE layer (C++ moerail::MoeConfig)
    moerail.torch                              PyTorch autograd functions, MoELayer, the Megatron-LM adapter
    moerail.RefPlan, moerail._C.ref_*          the CPU reference of every op (the backend of CPU tensors)

Every error of the core is a moerail.Error (a RuntimeError) whose message names the argument or the rank.
"""
from __future__ import annotations  # (X | None annotations on Python 3.9)

# PyTorch first, when it is installed: on the GPU machine (torch 2.11, its own NCCL), importing torch after the core
# had loaded libnccl aborted inside torch's import ("free(): invalid pointer"); in this order both load cleanly.
try:
    import torch as _torch  # noqa: F401
except ImportError:
    pass

from . import _C  # noqa: E402
from ._C import Config, Error, RefPlan, preset, preset_names  # noqa: E402

__version__: str = _C.__version__  # the file VERSION
__all__ = ["Config", "Error", "RefPlan", "make_config", "preset", "preset_names", "with_cuda", "with_nccl"]

with_cuda: bool = _C.with_cuda  # built with the GPU kernels (sm_90a)
with_nccl: bool = _C.with_nccl  # built with the multi-GPU ops (Communicator, Dispatcher, MoeLayer)


def make_config(preset_name: str | None = None, **fields) -> Config:
    """A validated Config: the named preset (or the defaults) with `fields` set on it.

    >>> cfg = moerail.make_config(hidden=1024, ffn_hidden=512, num_experts=8, topk=2, align=16)
    """
    cfg = preset(preset_name) if preset_name else Config()
    if fields.get("capacity_factor") is not None and fields.get("rank_capacity_factor") is not None:
        raise ValueError("moerail.make_config: capacity_factor (per expert) and rank_capacity_factor (per rank) "
                         "are two capacity policies; give one")
    for name, value in fields.items():
        if name.startswith("_") or not hasattr(cfg, name):
            known = ", ".join(n for n in dir(cfg) if not n.startswith("_") and not callable(getattr(cfg, n)))
            raise ValueError(f"moerail.make_config: unknown field '{name}' (fields: {known})")
        setattr(cfg, name, value)
    cfg.validate()
    return cfg
