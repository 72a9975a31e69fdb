"""Shared fixtures: fresh random inputs every run (the seed is printed so a failure can be replayed
with TILEATTN_TEST_SEED=<seed>), and the `gpu` marker, skipped without a CUDA device."""

import os

import pytest
import torch

import tileattn
from build_support import head_dim_not_built


def _gpu_available() -> bool:
    return torch.cuda.is_available() and tileattn.cuda_available()


def pytest_collection_modifyitems(config, items):
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device and a CUDA build of tileattn")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A call refused because this build lacks the head dim's bucket is reported as a skip."""
    outcome = yield
    report = outcome.get_result()
    if call.when == "call" and call.excinfo is not None and head_dim_not_built(call.excinfo.value):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {call.excinfo.value}")


@pytest.fixture(autouse=True)
def fresh_seed(request):
    seed = int(os.environ.get("TILEATTN_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    torch.manual_seed(seed)
    print(f"{request.node.nodeid}: TILEATTN_TEST_SEED={seed}")
    return seed


@pytest.fixture
def cuda():
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def precision():
    """Restores PyTorch's fp32 matmul switch (which selects tileattn's fp32 fast mode) after a test."""
    saved = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cuda.matmul.allow_tf32 = saved[1]
