"""When the kernels launch with programmatic dependent launch (kernels/_pdl.py)."""
import pytest
import torch

from kernels._pdl import ENV_SWITCH, launch_options, use_pdl


def expected_on(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def test_pdl_follows_the_device_and_the_switch(device, monkeypatch):
    t = torch.zeros(1, device=device)
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    assert use_pdl(t) is expected_on(device)
    assert launch_options(t) == {"PDL": expected_on(device), "launch_pdl": expected_on(device)}
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert use_pdl(t) is False
    assert launch_options(t) == {"PDL": False, "launch_pdl": False}


def test_pdl_is_off_on_the_cpu(monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "1")
    assert use_pdl(torch.zeros(1)) is False


def test_a_bad_switch_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "off")
    with pytest.raises(ValueError, match=r"ENGINE_PDL='off' is not understood; set it to 1 .* or 0 \(off\)"):
        use_pdl(torch.zeros(1))
