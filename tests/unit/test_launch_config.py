import pytest

from engine.launch_config import DEMO_MODEL, LaunchError, build_parser, cuda_graph_sizes, parse_args, resolve_limits
from weights.hub import ModelNotFoundError, resolve_model


def test_defaults_are_tgis():
    c = parse_args([], {})
    assert (c.model_id, c.port, c.hostname, c.max_concurrent_requests, c.max_best_of, c.max_stop_sequences,
            c.max_top_n_tokens, c.waiting_served_ratio, c.max_waiting_tokens, c.payload_limit, c.master_addr,
            c.master_port) == (DEMO_MODEL, 3000, "0.0.0.0", 128, 2, 4, 5, 0.3, 20, 2_000_000, "localhost", 29500)


def test_environment_variables_set_flags_and_the_command_line_wins():
    env = {"MAX_TOTAL_TOKENS": "512", "PORT": "8080", "MODEL_ID": "/x", "SHARDED": "false", "HF_TOKEN": "t",
           "LOG_LEVEL": "DEBUG", "MAX_CONCURRENT_REQUESTS": "7"}
    c = parse_args(["--port", "9000"], env)
    assert (c.max_total_tokens, c.port, c.model_id, c.sharded, c.hf_token, c.log_level,
            c.max_concurrent_requests) == (512, 9000, "/x", False, "t", "DEBUG", 7)
    assert parse_args([], {"HUGGING_FACE_HUB_TOKEN": "old"}).hf_token == "old"


@pytest.mark.parametrize("argv,message", [
    (["--max-input-tokens", "5", "--max-input-length", "5"], "not both"),
    (["--num-shard", "0"], "--num-shard must be >= 1"),
    (["--sharded", "false", "--num-shard", "2"], "--sharded false contradicts"),
    (["--sharded", "true", "--num-shard", "1"], "--sharded true contradicts"),
    (["--max-best-of", "0"], "--max-best-of must be positive"),
    (["--trust-remote-code"], "not supported"),
    (["--quantize", "gptq"], "--quantize is not supported yet"),
    (["--port", "abc"], "invalid int value"),
    (["--dtype", "int8"], "invalid choice"),
    (["--cuda-memory-fraction", "2"], "must be in (0, 1]"),
])
def test_bad_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, {})
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_bad_environment_value_names_the_variable(capsys):
    with pytest.raises(SystemExit):
        parse_args([], {"MAX_TOTAL_TOKENS": "lots"})
    assert "MAX_TOTAL_TOKENS='lots'" in capsys.readouterr().err


def test_help_explains_every_flag_and_its_variable():
    text = " ".join(build_parser().format_help().split())
    for flag in ["--model-id", "--num-shard", "--max-total-tokens", "--api-key", "--payload-limit", "--json-output",
                 "--max-batch-prefill-tokens", "--waiting-served-ratio", "--huggingface-hub-cache", "--master-port"]:
        assert flag in text
    assert "[env: MAX_TOTAL_TOKENS]" in text and "[env: HF_TOKEN]" in text


def test_limits_follow_tgis_rules():
    limits = resolve_limits(parse_args([], {}), 4096, None)
    assert (limits.max_total_tokens, limits.max_input_tokens, limits.max_batch_prefill_tokens) == (4096, 4095, 4145)
    limits = resolve_limits(parse_args(["--max-total-tokens", "256", "--max-input-length", "100"], {}), 4096, None)
    assert (limits.max_total_tokens, limits.max_input_tokens, limits.max_batch_prefill_tokens) == (256, 100, 4096)
    checks = [
        (["--max-total-tokens", "100", "--max-input-tokens", "100"], "`max_input_tokens` must be < `max_total_tokens`"),
        (["--max-total-tokens", "9000"], "must be <= the model's context length (4096)"),
        (["--max-input-tokens", "500", "--max-total-tokens", "1000", "--max-batch-prefill-tokens", "400"],
         "`max_batch_prefill_tokens` must be >= `max_input_tokens`"),
        (["--max-total-tokens", "1000", "--max-batch-total-tokens", "500"], "`max_batch_total_tokens` must be >="),
    ]
    for argv, message in checks:
        with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace(")", r"\)")):
            resolve_limits(parse_args(argv, {}), 4096, None)


def test_cuda_graph_sizes():
    assert cuda_graph_sizes(parse_args([], {})) is None
    assert cuda_graph_sizes(parse_args(["--cuda-graphs", "0"], {})) == ()
    assert cuda_graph_sizes(parse_args(["--cuda-graphs", "1,2,8"], {})) == (1, 2, 8)


def test_model_resolution_errors_are_one_clear_line(tmp_path, monkeypatch):
    with pytest.raises(ModelNotFoundError, match="no such directory"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ModelNotFoundError, match="without config.json"):
        resolve_model(str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError, match="not in the hub cache"):
        resolve_model("some-org/some-model-that-is-not-cached", cache_dir=str(tmp_path / "cache"))


def test_a_cached_hub_model_resolves_offline(tmp_path, monkeypatch):
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").write_bytes(b"")
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("abc123")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert resolve_model("org/tiny", cache_dir=str(tmp_path)) == snapshot
