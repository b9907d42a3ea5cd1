"""bench.attention_bench on the CPU: its quantized inputs and its flags (the sweeps themselves need a GPU)."""
import pytest
import torch

from bench import attention_bench
from kernels._kv_quant import gather_kv_ref


@pytest.mark.parametrize("kv_dtype,tolerance", [("int8", 0.02), ("fp8_e4m3fn", 0.07), ("fp8_e5m2", 0.13)])
def test_the_quantized_cache_is_what_the_cache_would_store(kv_dtype, tolerance):
    q, kv_layer, table, rows, lens, scale = attention_bench.make_inputs(2, 10, 4, 2, 16, torch.float32, "cpu")
    data, scales = attention_bench.quantize_cache(kv_layer, kv_dtype)
    assert data.dtype == attention_bench.KV_CACHE_DTYPES[kv_dtype] and data.shape == kv_layer.shape
    assert scales.shape == ((kv_layer.shape[0], 4) if kv_dtype == "int8" else (2,))
    slots = torch.arange(20)
    k, v = gather_kv_ref(data, scales, slots)
    original = kv_layer[slots]
    assert (torch.cat([k, v], dim=1) - original).abs().max() < tolerance * original.abs().max()
    assert attention_bench.quantize_cache(kv_layer, None) == (kv_layer, None)


@pytest.mark.parametrize("other", [["--shared-prefix", "64"], ["--verify-drafts", "2"]])
def test_a_quantized_cache_is_refused_where_the_sweep_would_ignore_it(other, capsys):
    with pytest.raises(SystemExit) as exit_info:
        attention_bench.main(["--kv-cache-dtype", "int8", *other])
    assert exit_info.value.code == 2
    assert "--kv-cache-dtype applies to the plain decode sweep only" in capsys.readouterr().err
