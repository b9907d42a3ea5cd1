"""Fixtures of the kernel tests (helpers live in ``kernel_inputs.py``)."""
import pytest
import torch
from kernel_inputs import DEVICE


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
