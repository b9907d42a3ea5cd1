"""Quantized models through the launched server: greedy tokens equal transformers' on the dequantized model.

A GPTQ act-order checkpoint on two shards (gloo: packed columns and whole groups sliced by the real
launcher), an AWQ checkpoint (its ``quantization_config`` read by the launcher and the shard), a
compressed-tensors FP8 checkpoint (per-channel weight scales) on two shards, and a float checkpoint served
with ``--quantize fp8``. FP8's reference: the per-channel FP8 weights dequantized, activations rounded to
FP8 per token as the FP8 GEMM does (on two shards each shard's columns of a row-parallel layer's input
on their own, as each shard's GEMM does).
"""
import pytest
import transformers

from tests.e2e.server import LaunchedServer, assert_server_greedy_equals, free_port
from tests.quant_models import fake_quantize_activations, save_quantized_pair
from tests.tiny_models import load_hf

PROMPTS = ["hello world", "def main(): return 0"]
NEW_TOKENS = 12
CASES = {   # name: (format written, served directory, launcher flags)
    "gptq_two_shards": ("gptq_act_order", "quantized", ["--num-shard", "2", "--master-port", "PORT"]),
    "quantize_fp8": ("fp8_channel", "float", ["--quantize", "fp8"]),
    "awq": ("awq_g32", "quantized", []),
    "fp8_channel_two_shards": ("fp8_channel", "quantized", ["--num-shard", "2", "--master-port", "PORT"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_server_answers_with_transformers_greedy_tokens_on_the_dequantized_model(case, tmp_path):
    fmt, served, flags = CASES[case]
    quantized, twin = save_quantized_pair(fmt, tmp_path, tokenizer=True)
    path = quantized if served == "quantized" else tmp_path / "float"
    hf = load_hf(twin)
    if fmt.startswith("fp8"):
        fake_quantize_activations(hf, int(flags[flags.index("--num-shard") + 1]) if "--num-shard" in flags else 1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    args = [str(free_port()) if a == "PORT" else a for a in flags]
    srv = LaunchedServer(path, *args, "--dtype", "float32", "--max-total-tokens", "128", "--max-input-tokens", "64")
    try:
        srv.wait_healthy()
        assert_server_greedy_equals(srv.url, tokenizer, hf, PROMPTS, NEW_TOKENS, case)
    finally:
        assert srv.stop() == 0, srv.output()


def test_launcher_refuses_a_quantize_flag_that_does_not_match_the_checkpoint(tmp_path):
    quantized, _ = save_quantized_pair("awq_g16", tmp_path, tokenizer=True)
    srv = LaunchedServer(quantized, "--quantize", "gptq")
    try:
        assert srv.process.wait(timeout=120) != 0
        assert "--quantize gptq does not match a awq checkpoint" in srv.output()
    finally:
        srv.stop()
