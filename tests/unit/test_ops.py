"""engine.ops: each backend's ops are plain methods that reach their kernel or its reference."""
import inspect

import pytest
import torch

from engine.ops import KernelOps, TorchOps, TritonOps, default_backend
from engine.worker.kv_cache import KVCache, KVLayer
from kernels import rmsnorm

OPS = ("rmsnorm", "add_rmsnorm", "rotary_store_kv", "prefill_attention", "decode_attention", "silu_and_mul",
       "apply_penalties", "linear", "act_and_mul")


@pytest.mark.parametrize("cls", [TritonOps, TorchOps])
def test_every_op_is_a_plain_method_of_the_class(cls):
    for name in OPS:
        assert inspect.isfunction(cls.__dict__[name]), f"{cls.__name__}.{name}"


def test_create_picks_the_backend_and_refuses_an_unknown_one():
    assert isinstance(KernelOps.create("triton"), TritonOps) and KernelOps.create("triton").backend == "triton"
    assert isinstance(KernelOps.create("torch"), TorchOps) and KernelOps.create("torch").backend == "torch"
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'; choose one of triton, torch"):
        KernelOps.create("cuda")
    assert default_backend(torch.device("cpu")) == "triton"      # the tests run under TRITON_INTERPRET=1


def test_each_backend_runs_its_own_implementation(monkeypatch):
    calls = []
    monkeypatch.setattr(rmsnorm, "rmsnorm", lambda *a: calls.append("kernel"))
    monkeypatch.setattr(rmsnorm, "rmsnorm_ref", lambda *a: calls.append("reference"))
    x, w = torch.randn(3, 8), torch.randn(8)
    TritonOps().rmsnorm(x, w, 1e-5)
    TorchOps().rmsnorm(x, w, 1e-5)
    assert calls == ["kernel", "reference"]


def test_the_kv_cache_hands_out_one_value_per_layer_and_the_ops_write_through_it():
    cache = KVCache(num_layers=2, num_slots=6, kv_heads=1, head_dim=4, max_requests=2, max_seq_len=8,
                    dtype=torch.float32, device="cpu")
    layer = cache.layer(1)
    assert isinstance(layer, KVLayer) and layer is cache.layer(1)           # made once: CUDA graphs keep it
    assert layer.data.data_ptr() == cache.kv_buffer[1].data_ptr()
    q, k, v = torch.randn(1, 1, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 4)
    table = torch.tensor([[1.0, 1.0, 0.0, 0.0]])           # position 0: cos 1, sin 0 (no rotation)
    TorchOps().rotary_store_kv(q, k, v, torch.tensor([0]), table, layer, torch.tensor([3]))
    assert torch.equal(cache.kv_buffer[1, 3], torch.cat([k[0], v[0]]))
