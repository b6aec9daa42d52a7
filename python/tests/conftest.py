import pytest
import torch

import moerail


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (Hopper) and a CUDA build of moerail")
    config.addinivalue_line("markers", "multigpu: needs two CUDA GPUs")


def pytest_collection_modifyitems(config, items):
    has_gpu = moerail.with_cuda and torch.cuda.is_available()
    gpus = torch.cuda.device_count() if has_gpu else 0
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="no CUDA GPU"))
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="fewer than two CUDA GPUs"))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
