"""The MoE families and Qwen3: config parsing, checkpoint names (the random real-config
checkpoints load in transformers and in the engine), the router's rules and clear errors.
Greedy parity with transformers is in test_parity.py, TP in test_tensor_parallel.py."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.models import build_model, check_checkpoint, family_for, load_model_config
from engine.models.config import ModelConfigError
from engine.models.moe import SparseMoE, qwen_dense_layers
from engine.models.parallel import TensorParallel
from engine.ops import KernelOps
from weights.checkpoint import open_checkpoint
from weights.random_checkpoint import REAL_CONFIGS, write_random_checkpoint

# Small sizes, the real configs' structure (experts, top-k, shared expert, q/k norms, head_dim).
SHRINK = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=64,
              num_attention_heads=4, vocab_size=512, max_position_embeddings=256)
REAL = ["mixtral-8x7b", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "qwen3-8b"]


def shrunk(name: str) -> dict:
    config = {**REAL_CONFIGS[name], **{k: v for k, v in SHRINK.items() if k in REAL_CONFIGS[name]}}
    config["num_key_value_heads"] = min(config["num_key_value_heads"], 4)
    if "head_dim" in config:
        config["head_dim"] = 32                          # not hidden / heads, as in Qwen3
    if config["bos_token_id"] >= 256:                    # Qwen's special ids, moved into the small vocabulary
        config["bos_token_id"] -= 151643 - 500
        config["eos_token_id"] -= 151643 - 500
    return config


@pytest.mark.parametrize("name", REAL)
def test_real_config_checkpoints_load_in_transformers_and_the_engine(name, tmp_path):
    path = write_random_checkpoint(tmp_path / name, shrunk(name), dtype="float32", num_layers=2)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, dtype=torch.float32)
    assert {key: list(value) for key, value in info.items()} == {
        "missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    config = load_model_config(path)
    assert config.num_layers == 2 and type(model).__name__ == config.architecture
    with open_checkpoint(path) as checkpoint:
        check_checkpoint(checkpoint, config)
        ours = build_model(config, KernelOps.create("torch"), torch.float32, "cpu", 64, TensorParallel())
        ours.load_weights(checkpoint)


def test_the_real_configs_parse_to_their_routing_rules():
    def parse(name):
        raw = REAL_CONFIGS[name]
        return family_for(raw["architectures"][0]).parse_config(raw)

    mixtral, qwen2, qwen3 = parse("mixtral-8x7b"), parse("qwen1.5-moe-a2.7b"), parse("qwen3-30b-a3b")
    assert (mixtral.num_experts, mixtral.top_k, mixtral.norm_topk_prob) == (8, 2, True)
    assert mixtral.moe_intermediate_size == 14336 and not mixtral.round_router_weights
    assert (qwen2.num_experts, qwen2.top_k, qwen2.norm_topk_prob) == (60, 4, False)
    assert qwen2.shared_expert_intermediate_size == 5632 and qwen2.round_router_weights
    assert qwen2.qkv_bias and qwen2.sliding_window is None and qwen2.dense_layers == ()
    assert (qwen3.num_experts, qwen3.top_k, qwen3.norm_topk_prob) == (128, 8, True)
    assert qwen3.qk_norm and qwen3.head_dim == 128
    assert parse("qwen3-8b").head_dim == 128


def test_dense_layers_follow_mlp_only_layers_and_the_sparse_step():
    assert qwen_dense_layers({"num_hidden_layers": 4, "decoder_sparse_step": 1, "mlp_only_layers": [0, 3]}) == (0, 3)
    assert qwen_dense_layers({"num_hidden_layers": 4, "decoder_sparse_step": 2}) == (0, 2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_router_takes_the_top_k_of_the_softmax_renormalised_or_not(renormalize, backend):
    router = torch.eye(5)
    block = SparseMoE(router, torch.zeros(5, 2, 5), torch.zeros(5, 5, 1), 2, renormalize, False, TensorParallel())
    probs = torch.tensor([[0.1, 0.3, 0.2, 0.15, 0.25]])
    weights, ids = block.route(KernelOps.create(backend), probs.log())
    assert ids.tolist() == [[1, 4]]
    top = [[0.3, 0.25]] if not renormalize else [[0.3 / 0.55, 0.25 / 0.55]]
    torch.testing.assert_close(weights, torch.tensor(top))


def test_bad_moe_configs_are_refused_clearly(tmp_path):
    raw = {**REAL_CONFIGS["mixtral-8x7b"], "num_experts_per_tok": 9}
    with pytest.raises(ModelConfigError, match="num_experts_per_tok=9 must be between 1 and num_local_experts=8"):
        family_for("MixtralForCausalLM").parse_config(raw)
    raw = {**REAL_CONFIGS["qwen3-30b-a3b"], "hidden_act": "gelu"}
    with pytest.raises(ModelConfigError, match="hidden_act='gelu' is not supported"):
        family_for("Qwen3MoeForCausalLM").parse_config(raw)
    with pytest.raises(ValueError, match="num_layers must be in 1..48, got 49"):
        write_random_checkpoint(tmp_path, "qwen3-30b-a3b", num_layers=49)


@pytest.mark.parametrize("name,active,total", [("mixtral-8x7b", 12.9, 46.7), ("qwen1.5-moe-a2.7b", 2.7, 14.3),
                                               ("qwen3-30b-a3b", 3.3, 30.5)])
def test_the_bench_floor_counts_the_published_active_parameters(name, active, total):
    """bench.moe_bench's floor reads the chosen experts only: with the embedding counted as the
    model cards count it, the active and total parameters are the published ones (billions)."""
    from bench.moe_bench import active_weight_bytes

    raw = REAL_CONFIGS[name]
    config = family_for(raw["architectures"][0]).parse_config(raw)
    ours_active, ours_total = active_weight_bytes(config, element_bytes=1)
    embedding = config.vocab_size * config.hidden_size
    assert (ours_active + embedding) / 1e9 == pytest.approx(active, rel=0.03)
    assert ours_total / 1e9 == pytest.approx(total, abs=0.05)


def test_the_bench_routing_ab_routes_by_torch_then_by_the_kernels(tmp_path, monkeypatch):
    """``bench.moe_bench --routing-ab``: each engine adds one change to the one before (the Triton
    kernels, under the interpreter here): routing by torch's ops, then by the routing kernel, then
    the one-token path, then the shared expert inside it (none in Qwen3-MoE), then the q/k norms
    inside the rotary kernel."""
    from bench import moe_bench
    from bench.workloads import Workload
    from kernels import fused_moe, moe_route
    from tests.tiny_models import save_tiny_model

    from kernels import rotary

    calls = []
    for module, name in ((moe_route, "moe_route"), (moe_route, "moe_route_ref"), (fused_moe, "_fused_moe_one_token"),
                         (moe_bench, "_variant"), (rotary, "rotary_store_kv")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: calls.append((_n, a)) or _f(*a, **k))
    path = save_tiny_model("qwen3_moe", tmp_path / "qwen3_moe")
    rates = moe_bench.routing_ab(str(path), rounds=1, workload=Workload("tiny", [[5, 9, 13]], 2),
                                 kernel_backend="triton")
    assert list(rates) == list(moe_bench.ROUTING_VARIANTS) and all(len(r) == 1 and r[0] > 0 for r in rates.values())
    by_variant = {}
    for name, args in calls:
        if name == "_variant":
            current = by_variant.setdefault(args[0], set())
        else:       # the rotary kernel: with or without the q/k head norms
            current.add(name if name != "rotary_store_kv" else f"norms in rotary: {args[-1] is not None}")
    before, routing, one_token, shared, today = moe_bench.ROUTING_VARIANTS
    assert by_variant == {before: {"moe_route_ref", "norms in rotary: False"},
                          routing: {"moe_route", "norms in rotary: False"},
                          one_token: {"moe_route", "_fused_moe_one_token", "norms in rotary: False"},
                          shared: {"moe_route", "_fused_moe_one_token", "norms in rotary: False"},
                          today: {"moe_route", "_fused_moe_one_token", "norms in rotary: True"}}


def test_the_moe_bench_command_line_parses(capsys):
    from bench import moe_bench

    with pytest.raises(SystemExit) as exit_info:
        moe_bench.main(["--help"])
    assert exit_info.value.code == 0 and "--routing-ab" in capsys.readouterr().out
