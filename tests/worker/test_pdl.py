"""When the decode kernels launch with programmatic dependent launch (nanoserve_kernels/pdl.py): never
off CUDA or under Triton's interpreter (which cannot run the wait), and never with NANOSERVE_PDL=0,
which A/B measurements rely on. Whether it keeps the logits is tests/gpu/test_worker_gpu.py's."""
import pytest
import torch

from nanoserve_kernels import pdl


@pytest.fixture(autouse=True)
def fresh_answers():
    pdl.pdl_on.cache_clear()
    yield
    pdl.pdl_on.cache_clear()


def test_off_the_gpu_kernels_launch_plainly():
    assert not pdl.pdl_on(torch.device("cpu"))
    assert pdl.pdl_launch(torch.device("cpu")) == {"PDL": False}


@pytest.mark.parametrize("variable, value", [("NANOSERVE_PDL", "0"), ("TRITON_INTERPRET", "1")])
def test_switched_off_before_the_device_is_asked(monkeypatch, variable, value):
    """Decided from the environment alone: the device's capability is never queried (no GPU here)."""
    monkeypatch.setenv(variable, value)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: pytest.fail("asked the device"))
    assert not pdl.pdl_on(torch.device("cuda", 0))
    assert pdl.pdl_launch(torch.device("cuda", 0)) == {"PDL": False}


@pytest.mark.parametrize("capability, on", [((8, 0), False), ((9, 0), True), ((10, 0), True)])
def test_on_from_hopper(monkeypatch, capability, on):
    monkeypatch.delenv("NANOSERVE_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert pdl.pdl_on(torch.device("cuda", 0)) == on
    assert pdl.pdl_launch(torch.device("cuda", 0)) == ({"PDL": True, "launch_pdl": True} if on else {"PDL": False})
