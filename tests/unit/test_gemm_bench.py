"""bench.gemm_bench's shapes: Llama-2-7B's projections by name, any other model's as NxK."""
import pytest

from bench.gemm_bench import LLAMA2_7B, main, shape_of


def test_shapes_by_name_or_n_by_k():
    assert shape_of("qkv") == LLAMA2_7B["qkv"] == (12288, 4096)
    assert shape_of("5120x2048") == (5120, 2048)
    for bad in ("5120x", "x2048", "0x2048", "qkv2", "5120*2048"):
        with pytest.raises(ValueError, match="unknown shape"):
            shape_of(bad)


def test_bad_shapes_are_refused_before_any_device_work(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit, match="unknown shape 'qkvx'"):
        main(["--shapes", "qkv,qkvx", "--rows", "1"])
