import dataclasses
import os
from pathlib import Path

import pytest

from tgi_compat.launch_config import DEMO_MODEL, NOT_APPLIED, LaunchConfig, LaunchError, build_parser, env_name, parse_args, resolve_limits, resolve_num_shard

FIELDS = [f.name for f in dataclasses.fields(LaunchConfig)]

# field -> (text in its environment variable, the value parsed); one entry per field, each
# different from the default, so that a field added without a test fails test_every_field_is_sampled.
SAMPLES = {
    "model_id": ("/models/x", "/models/x"), "revision": ("refs/pr/2", "refs/pr/2"), "dtype": ("bfloat16", "bfloat16"),
    "rope_scaling": ("dynamic", "dynamic"), "rope_factor": ("2.5", 2.5),
    "tokenizer_config_path": ("/t.json", "/t.json"), "huggingface_hub_cache": ("/cache", "/cache"),
    "hf_token": ("hf_abc", "hf_abc"), "hf_hub_offline": ("1", True), "num_shard": ("2", 2),
    "sharded": ("true", True), "master_addr": ("10.0.0.1", "10.0.0.1"), "master_port": ("29600", 29600),
    "cuda_memory_fraction": ("0.5", 0.5), "cuda_graphs": ("1,2,8", (1, 2, 8)),
    "disable_custom_kernels": ("true", True), "max_concurrent_requests": ("7", 7), "max_best_of": ("3", 3),
    "max_stop_sequences": ("6", 6), "max_top_n_tokens": ("0", 0), "max_input_tokens": ("100", 100),
    "max_input_length": ("100", 100), "max_total_tokens": ("512", 512), "max_client_batch_size": ("8", 8),
    "payload_limit": ("1000", 1000), "waiting_served_ratio": ("1.2", 1.2), "max_batch_prefill_tokens": ("2048", 2048),
    "max_batch_total_tokens": ("10000", 10000), "max_waiting_tokens": ("0", 0), "max_batch_size": ("16", 16),
    "kv_cache_dtype": ("int8", "int8"), "admission": ("reserve", "reserve"), "step_timeout": ("2.5", 2.5), "prefix_caching": ("0", False),
    "speculate": ("2", 2), "hostname": ("127.0.0.1", "127.0.0.1"), "port": ("8080", 8080),
    "api_key": ("secret", "secret"), "validation_workers": ("4", 4), "disable_grammar_support": ("yes", True),
    "frontend_processes": ("3", 3),
    "enable_prefill_logprobs": ("on", True), "cors_allow_origin": ("https://a.b, https://c.d",
                                                                   ("https://a.b", "https://c.d")),
    "prometheus_port": ("9001", 9001), "watermark_gamma": ("0.5", 0.5), "watermark_delta": ("2", 2.0),
    "graceful_termination_timeout": ("10", 10), "json_output": ("true", True), "log_level": ("debug", "DEBUG"),
    "shard_uds_path": ("/tmp/s", "/tmp/s"), "ngrok": ("true", True), "ngrok_authtoken": ("tok", "tok"),
    "ngrok_edge": ("edge", "edge"), "usage_stats": ("off", "off"),
    "otlp_endpoint": ("http://otel:4317", "http://otel:4317"), "otlp_service_name": ("svc", "svc"),
}
# Fields that are errors whenever set, with what the error says.
UNSUPPORTED = {"trust_remote_code": ("true", "--trust-remote-code is not supported"),
               "quantize": ("eetq", "--quantize eetq is not supported; supported: gptq and awq"),
               "lora_adapters": ("org/adapter", "--lora-adapters is not supported yet"),
               "weights_cache_override": ("/w", "--weights-cache-override is not supported")}
NO_ENV_FIELDS = {"env"}


def _usage_error(argv, environ, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, environ)
    assert exit_info.value.code == 2
    return " ".join(capsys.readouterr().err.split())


def test_every_field_is_sampled():
    assert set(FIELDS) == set(SAMPLES) | set(UNSUPPORTED) | NO_ENV_FIELDS


def test_defaults_are_tgis():
    """TGI's defaults, but for --waiting-served-ratio (0: see its --help)."""
    c = parse_args([], {})
    assert c.model_id == DEMO_MODEL and DEMO_MODEL.endswith(os.path.join("weights", "demo"))
    assert os.path.isfile(os.path.join(DEMO_MODEL, "config.json"))
    expected = dict(
        revision=None, num_shard=None, sharded=None, dtype=None, max_concurrent_requests=128, max_best_of=2,
        max_stop_sequences=4, max_top_n_tokens=5, max_input_tokens=None, max_input_length=None,
        max_total_tokens=None, waiting_served_ratio=0.0, max_batch_prefill_tokens=None, max_batch_total_tokens=None,
        max_waiting_tokens=20, max_batch_size=None, max_client_batch_size=4, hostname="0.0.0.0", port=3000,
        master_addr="localhost", master_port=29500, huggingface_hub_cache=None, api_key=None,
        payload_limit=2_000_000, json_output=False, cuda_graphs=None, cuda_memory_fraction=1.0,
        validation_workers=2, frontend_processes=None, disable_grammar_support=False, enable_prefill_logprobs=False,
        trust_remote_code=False, quantize=None, speculate=None, kv_cache_dtype=None, rope_scaling=None,
        rope_factor=None, prometheus_port=9000, shard_uds_path="/tmp/text-generation-server",
        otlp_service_name="text-generation-inference.router", usage_stats="on", graceful_termination_timeout=90,
        ngrok=False, disable_custom_kernels=False, log_level="INFO", hf_token=None, hf_hub_offline=False)
    assert {name: getattr(c, name) for name in expected} == expected
    assert c == LaunchConfig() and c.notices == () and c.rope is None


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_environment_variable_sets_its_flag(name):
    text, value = SAMPLES[name]
    assert getattr(LaunchConfig(), name) != value
    environ = {env_name(name): text}
    if name == "max_input_length":      # both input names set is an error: the sample only sets one
        assert env_name(name) == "MAX_INPUT_LENGTH"
    if name == "sharded":               # sharded=true needs shards
        environ["NUM_SHARD"] = "2"
    assert getattr(parse_args([], environ), name) == value


def test_environment_variable_names_are_tgis():
    assert env_name("max_total_tokens") == "MAX_TOTAL_TOKENS" and env_name("model_id") == "MODEL_ID"
    assert env_name("port") == "PORT" and env_name("hostname") == "HOSTNAME"
    assert env_name("huggingface_hub_cache") == "HUGGINGFACE_HUB_CACHE"
    assert env_name("hf_token") == "HF_TOKEN" and env_name("hf_hub_offline") == "HF_HUB_OFFLINE"
    assert env_name("log_level") == "LOG_LEVEL" and env_name("env") is None
    assert parse_args([], {"ENV": "true"}).env is False     # POSIX shells use ENV for their own purpose
    assert parse_args(["-e"], {}).env is True


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_the_command_line_beats_the_environment(name):
    text, value = SAMPLES[name]
    default = getattr(LaunchConfig(), name)
    flag = f"--{name.replace('_', '-')}"
    extra = ["--num-shard", "2"] if name == "sharded" else []
    from_cli = parse_args([flag, text] + extra, {env_name(name): "garbage-that-would-not-parse"})
    assert getattr(from_cli, name) == value != default


def test_short_flags_and_switches():
    c = parse_args(["-p", "81", "-g", "5", "--json-output", "--trust-remote-code=false", "--sharded", "false"], {})
    assert (c.port, c.graceful_termination_timeout, c.json_output, c.trust_remote_code, c.sharded) == \
        (81, 5, True, False, False)


def test_hf_token_falls_back_to_the_legacy_variable_and_stays_out_of_the_repr():
    assert parse_args([], {"HUGGING_FACE_HUB_TOKEN": "old"}).hf_token == "old"
    assert parse_args([], {"HUGGING_FACE_HUB_TOKEN": "old", "HF_TOKEN": "new"}).hf_token == "new"
    c = parse_args(["--api-key", "key123"], {"HF_TOKEN": "hf_secret", "NGROK_AUTHTOKEN": "ngrok_secret"})
    assert "hf_secret" not in repr(c) and "key123" not in repr(c) and "ngrok_secret" not in repr(c)


def test_a_shell_hostname_is_not_an_address():
    assert parse_args([], {"HOSTNAME": os.uname().nodename}).hostname == "0.0.0.0"
    assert parse_args([], {"HOSTNAME": "127.0.0.1"}).hostname == "127.0.0.1"


def test_empty_environment_variables_count_as_unset():
    assert parse_args([], {"PORT": "", "MAX_TOTAL_TOKENS": ""}) == LaunchConfig()


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_flags_are_clear_errors(name, capsys):
    text, message = UNSUPPORTED[name]
    assert message in _usage_error([f"--{name.replace('_', '-')}", text], {}, capsys)
    assert message in _usage_error([], {env_name(name): text}, capsys)
    with pytest.raises(LaunchError, match=message):
        LaunchConfig(**{name: SAMPLES.get(name, (None, True if name == "trust_remote_code" else
                                                 text))[1]})


def test_speculate_reaches_the_scheduler():
    from engine.assembly import plan_engine
    from tgi_compat.launch_plan import engine_config

    demo = str(Path(__file__).resolve().parents[2] / "weights" / "demo")
    assert parse_args(["--speculate", "0"], {}).speculate == 0
    for argv, environ, expected in [([], {}, 0), (["--speculate", "3"], {}, 3), ([], {"SPECULATE": "2"}, 2)]:
        config = parse_args(argv, environ)
        plan = plan_engine(engine_config(config, resolve_limits(config, 2048), demo))
        assert plan.scheduler.speculate == expected
    with pytest.raises(SystemExit):
        parse_args(["--speculate", "-1"], {})


def test_the_servers_router_waits_for_prompt_steps_while_requests_arrive():
    """The launcher's engine gets the arrival window (engine.router.router), but not with --speculate; the
    in-process engine keeps 0."""
    from engine.assembly import EngineConfig, build_router, plan_engine
    from tgi_compat.launch_config import ARRIVAL_WINDOW_S
    from tgi_compat.launch_plan import engine_config

    demo = str(Path(__file__).resolve().parents[2] / "weights" / "demo")
    config = parse_args([], {})
    plan = plan_engine(engine_config(config, resolve_limits(config, 2048), demo))
    assert plan.config.arrival_window_s == ARRIVAL_WINDOW_S > 0
    assert build_router(plan, shards=None, capacity=64).arrival_window_s == ARRIVAL_WINDOW_S
    assert EngineConfig(model_dir=demo).arrival_window_s == 0
    speculating = parse_args(["--speculate", "2"], {})
    assert engine_config(speculating, resolve_limits(speculating, 2048), demo).arrival_window_s == 0
    for bad in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="arrival_window_s must be >= 0 seconds"):
            plan_engine(EngineConfig(model_dir=demo, arrival_window_s=bad))


def test_speculate_past_its_bound_is_refused_with_the_bound(capsys):
    """A huge --speculate would size the warm-up (and the KV cache) for max_requests x (1 + N) positions."""
    from tgi_compat.launch_config import MAX_SPECULATE

    assert parse_args(["--speculate", str(MAX_SPECULATE)], {}).speculate == MAX_SPECULATE
    with pytest.raises(SystemExit):
        parse_args(["--speculate", str(MAX_SPECULATE + 1)], {})
    assert f"must be <= {MAX_SPECULATE}" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--max-input-tokens", "5", "--max-input-length", "5"],
     "Both `max_input_tokens` (5) and `max_input_length` (5) are set"),
    (["--num-shard", "0"], "`num_shard` cannot be < 1"),
    (["--sharded", "false", "--num-shard", "2"], "`sharded` is false but `num_shard` is 2 (--sharded false contradicts --num-shard 2)"),
    (["--sharded", "true", "--num-shard", "1"], "`sharded` is true but `num_shard` <= 1"),
    (["--max-best-of", "0"], "`max_best_of` must be >= 1"),
    (["--validation-workers", "0"], "`validation_workers` must be > 0"),
    (["--frontend-processes", "0"], "--frontend-processes: must be >= 1, got 0"),
    (["--frontend-processes", "65"], "--frontend-processes: must be <= 64, got 65"),
    (["--max-concurrent-requests", "-3"], "--max-concurrent-requests: must be >= 1, got -3"),
    (["--max-stop-sequences", "-1"], "--max-stop-sequences: must be >= 0, got -1"),
    (["--port", "70000"], "--port: must be <= 65535, got 70000"),
    (["--max-batch-size", "70000"], "--max-batch-size: must be <= 65535, got 70000"),
    (["--port", "abc"], "argument -p/--port: expected an integer, got 'abc'"),
    (["--waiting-served-ratio", "x"], "expected a number, got 'x'"),
    (["--dtype", "int8"], "argument --dtype: expected one of float16, bfloat16, float32, got 'int8'"),
    (["--sharded", "maybe"], "expected true or false, got 'maybe'"),
    (["--cuda-memory-fraction", "2"], "--cuda-memory-fraction must be in (0, 1], got 2.0"),
    (["--cuda-memory-fraction", "0"], "--cuda-memory-fraction: must be > 0.0, got 0.0"),
    (["--rope-factor", "-1"], "--rope-factor: must be > 0.0, got -1.0"),
    (["--cuda-graphs", "1,x"], "expected comma-separated batch sizes like 1,2,4,8 (0 disables), got '1,x'"),
    (["--cuda-graphs", "0,4"], "expected batch sizes >= 1, or 0 alone to disable"),
    (["--max-input-tokens", "100", "--max-total-tokens", "100"],
     "`max_input_tokens` must be < `max_total_tokens`. Given: 100 and 100"),
    (["--max-total-tokens", "1000", "--max-batch-total-tokens", "500"],
     "`max_total_tokens` must be <= `max_batch_total_tokens`. Given: 1000 and 500"),
    (["--max-batch-prefill-tokens", "1000", "--max-batch-total-tokens", "500"],
     "`max_batch_prefill_tokens` must be <= `max_batch_total_tokens`. Given: 1000 and 500"),
    (["--max-input-tokens"], "expected one argument"),
    (["--max-input"], "unrecognized arguments: --max-input"),     # no abbreviations, as TGI
])
def test_bad_flags_are_usage_errors(argv, message, capsys):
    assert message in _usage_error(argv, {}, capsys)


def test_a_bad_environment_value_names_the_variable(capsys):
    assert "environment variable MAX_TOTAL_TOKENS='lots': expected an integer, got 'lots'" in \
        _usage_error([], {"MAX_TOTAL_TOKENS": "lots"}, capsys)
    assert "environment variable DTYPE='fp32': expected one of float16, bfloat16" in \
        _usage_error([], {"DTYPE": "fp32"}, capsys)
    assert "environment variable MAX_BEST_OF='0': `max_best_of` must be >= 1" in \
        _usage_error([], {"MAX_BEST_OF": "0"}, capsys)
    assert "`max_input_tokens` must be < `max_total_tokens`" in \
        _usage_error([], {"MAX_INPUT_TOKENS": "9", "MAX_TOTAL_TOKENS": "9"}, capsys)


def test_direct_construction_runs_the_same_checks():
    with pytest.raises(LaunchError, match="`validation_workers` must be > 0"):
        LaunchConfig(validation_workers=0)
    with pytest.raises(LaunchError, match="--dtype must be one of float16, bfloat16, float32"):
        LaunchConfig(dtype="float64")
    with pytest.raises(LaunchError, match="--max-waiting-tokens must be >= 0"):
        LaunchConfig(max_waiting_tokens=-1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        LaunchConfig().port = 1


def test_help_explains_every_flag_its_default_and_its_variable(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100000")     # argparse wraps help at hyphens otherwise
    parser = build_parser()
    text = " ".join(parser.format_help().split())
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    assert set(actions) == set(FIELDS)
    for name in FIELDS:
        flag, help_text = f"--{name.replace('_', '-')}", " ".join(actions[name].help.split())
        assert flag in text and flag in actions[name].option_strings
        assert "default" in help_text, name
        variable = env_name(name)
        assert (f"[env: {variable}]" if variable else "[no environment variable]") in help_text, name
        assert help_text in text, name
    assert "(default: 3000) [env: PORT]" in text and "(default: 128) [env: MAX_CONCURRENT_REQUESTS]" in text
    assert "a HOSTNAME equal to this machine's name is ignored" in text
    assert "Supported architectures (config.json `architectures`): LlamaForCausalLM, MistralForCausalLM" in text
    assert "BloomForCausalLM (ALiBi, no max_position_embeddings in config.json) serves a 4096-token context" in text
    assert "Quantized checkpoints (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, " in text
    assert "Phi3ForCausalLM, Starcoder2ForCausalLM): GPTQ" in text and "MixtralForCausalLM):" not in text
    assert "--quantize fp8 quantizes" in text


def test_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"], {})
    assert exit_info.value.code == 0 and "--max-batch-total-tokens" in capsys.readouterr().out


def test_flags_accepted_but_not_applied_are_listed():
    c = parse_args(["--ngrok", "--prometheus-port", "9000", "--cors-allow-origin", "https://a.b"], {})
    assert c.notices == ("--ngrok is accepted for TGI compatibility but not applied: no tunnel is opened; expose "
                         "--port yourself",)
    assert set(NOT_APPLIED) <= set(FIELDS)


def test_applied_flags_do_not_say_not_applied():
    """The flags this engine applies (issue 13): their help makes no 'not applied' claim, none is a notice."""
    applied = ("cors_allow_origin", "env", "hf_hub_offline", "graceful_termination_timeout", "json_output",
               "disable_custom_kernels", "rope_scaling", "tokenizer_config_path")
    help_of = {f.name: f.metadata["help"] for f in dataclasses.fields(LaunchConfig)}
    for name in applied:
        assert "not applied" not in help_of[name] and name not in NOT_APPLIED, name


def test_otlp_flags_reach_the_front_end_settings():
    config = parse_args(["--otlp-endpoint", "http://otel:4317", "--otlp-service-name", "svc"], {})
    assert (config.otlp_endpoint, config.otlp_service_name) == ("http://otel:4317", "svc")
    assert parse_args([], {"OTLP_ENDPOINT": "http://otel:4317"}).otlp_endpoint == "http://otel:4317"


def test_rope_flags_follow_tgi():
    assert parse_args(["--rope-factor", "2"], {}).rope == ("linear", 2.0)
    assert parse_args(["--rope-scaling", "dynamic"], {}).rope == ("dynamic", 1.0)
    assert parse_args(["--rope-scaling", "linear", "--rope-factor", "4"], {}).rope == ("linear", 4.0)


def test_derived_limits_follow_tgi_but_the_step_budget_is_ours():
    limits = resolve_limits(parse_args([], {}), 4096, None)
    assert (limits.max_total_tokens, limits.max_input_tokens, limits.max_batch_prefill_tokens,
            limits.max_batch_total_tokens) == (4096, 4095, 4096, None)
    limits = resolve_limits(parse_args([], {}), 32768, 20000)     # the memory holds less than the context
    assert (limits.max_total_tokens, limits.max_input_tokens, limits.max_batch_prefill_tokens,
            limits.max_batch_total_tokens) == (20000, 19999, 4096, 20000)
    limits = resolve_limits(parse_args(["--max-total-tokens", "256", "--max-input-length", "100"], {}), 4096, None)
    assert (limits.max_total_tokens, limits.max_input_tokens, limits.max_batch_prefill_tokens) == (256, 100, 4096)
    limits = resolve_limits(parse_args(["--max-batch-total-tokens", "1500"], {}), 1024, 99999)
    assert (limits.max_batch_prefill_tokens, limits.max_batch_total_tokens) == (1500, 1500)   # capped by the KV
    limits = resolve_limits(parse_args(["--max-input-tokens", "3000", "--max-batch-prefill-tokens", "512"], {}),
                            4096, None)                           # prompts longer than a step are chunked
    assert (limits.max_input_tokens, limits.max_batch_prefill_tokens) == (3000, 512)


@pytest.mark.parametrize("argv,max_allocatable,message", [
    (["--max-input-tokens", "5000"], None, "`max_input_tokens` must be < `max_total_tokens`. Given: 5000 and 4096"),
    (["--max-total-tokens", "9000"], None, "`max_total_tokens` (9000) must be <= the model's context length (4096)"),
    (["--max-total-tokens", "4000"], 3000, "`max_total_tokens` (4000) is more than the KV memory holds (3000 tokens)"),
    (["--max-batch-total-tokens", "4000"], None,
     "`max_total_tokens` must be <= `max_batch_total_tokens`. Given: 4096 and 4000"),
])
def test_limit_checks_that_need_the_model(argv, max_allocatable, message):
    config = parse_args(argv, {})
    with pytest.raises(LaunchError) as error:
        resolve_limits(config, 4096, max_allocatable)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_shard_count_follows_tgi():
    assert resolve_num_shard(parse_args([], {}), 0) == 1
    assert resolve_num_shard(parse_args([], {}), 4) == 4
    assert resolve_num_shard(parse_args(["--num-shard", "2"], {}), 8) == 2
    assert resolve_num_shard(parse_args(["--sharded", "false"], {}), 8) == 1
    assert resolve_num_shard(parse_args(["--sharded", "true"], {}), 2) == 2
    with pytest.raises(LaunchError, match="`sharded` is true but only found 1 CUDA devices"):
        resolve_num_shard(parse_args(["--sharded", "true"], {}), 1)


def test_cuda_graph_sizes():
    assert parse_args([], {}).cuda_graphs is None
    assert parse_args(["--cuda-graphs", "0"], {}).cuda_graphs == ()
    assert parse_args(["--cuda-graphs", "1,2,8"], {}).cuda_graphs == (1, 2, 8)


def test_a_bad_engine_pdl_switch_is_a_usage_error(capsys):
    message = _usage_error([], {"ENGINE_PDL": "off"}, capsys)
    assert "environment variable ENGINE_PDL='off': expected 1" in message and "or 0 (off)" in message
    for value in ("0", "1", ""):
        assert parse_args([], {"ENGINE_PDL": value}).model_id == DEMO_MODEL


def _blocked_network(monkeypatch):
    """Any connection attempt fails at once; huggingface_hub itself believes it is online."""
    import socket

    from huggingface_hub import constants

    def refuse(*args, **kwargs):
        raise OSError("network blocked by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


@pytest.mark.parametrize("flag", [True, False])
def test_hf_hub_offline_reaches_the_hub_code(flag, tmp_path, monkeypatch):
    """With --hf-hub-offline a model missing from the cache fails with the offline error and never
    touches the network; without it the same launch tries the network (and fails otherwise)."""
    from tgi_compat.launch_plan import plan_server

    _blocked_network(monkeypatch)
    argv = ["--model-id", "some-org/not-cached", "--huggingface-hub-cache", str(tmp_path), "--hostname",
            "127.0.0.1", "--port", "1"] + (["--hf-hub-offline"] if flag else [])
    with pytest.raises(ValueError) as error:
        plan_server(parse_args(argv, {}))
    offline = "is not in the hub cache and the hub is offline" in str(error.value)
    assert offline == flag, str(error.value)
