"""The launcher's configuration: TGI's flags, their environment variables, their checks.

``LaunchConfig`` is the one frozen dataclass; ``build_parser`` derives every flag from
its fields (name, type, default, help), and ``parse_args`` is the one place that reads
the environment: each flag can be set through its upper-snake-case variable
(``--max-total-tokens`` <-> ``MAX_TOTAL_TOKENS``), and the command line wins.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Mapping

DEMO_MODEL = str(Path(__file__).resolve().parents[1] / "weights" / "demo")


class LaunchError(ValueError):
    """A flag, or a combination of flags, that cannot work; the message says which and why."""


def _flag(help_text: str, default=None, choices=None, env: str | None = None):
    return field(default=default, metadata={"help": help_text, "choices": choices, "env": env})


@dataclass(frozen=True)
class LaunchConfig:
    model_id: str = _flag("Hugging Face hub id (downloaded with huggingface_hub) or a local directory with "
                          "config.json, tokenizer and *.safetensors; default: the bundled demo model", DEMO_MODEL)
    revision: str | None = _flag("hub revision (branch, tag or commit) of --model-id")
    num_shard: int | None = _flag("tensor-parallel shards, one process and GPU each; default: every visible "
                                  "GPU (1 on a CPU)")
    sharded: bool | None = _flag("true requires at least 2 shards, false forbids them (as TGI)")
    dtype: str | None = _flag("activation and weight dtype; default: the checkpoint's half precision on a GPU "
                              "(float32 checkpoints run in bfloat16), float32 on a CPU",
                              choices=("float16", "bfloat16"))
    max_concurrent_requests: int = _flag("requests served at once; more are answered 429 'Model is overloaded'", 128)
    max_best_of: int = _flag("largest `best_of` a request may ask for", 2)
    max_stop_sequences: int = _flag("most `stop` sequences a request may give", 4)
    max_top_n_tokens: int = _flag("largest `top_n_tokens` a request may ask for", 5)
    max_input_tokens: int | None = _flag("longest prompt in tokens; default: max_total_tokens - 1")
    max_input_length: int | None = _flag("legacy name of --max-input-tokens (set one of them)")
    max_total_tokens: int | None = _flag("prompt + max_new_tokens of one request; default: the model's context "
                                         "length (capped by the KV memory)")
    waiting_served_ratio: float = _flag("admit waiting requests into a running batch once waiting >= ratio x "
                                        "running (or after --max-waiting-tokens steps)", 0.3)
    max_batch_prefill_tokens: int | None = _flag("prompt tokens prefilled per step (longer prompts go in chunks); "
                                                 "default: max(max_input_tokens + 50, 4096)")
    max_batch_total_tokens: int | None = _flag("KV cache capacity in tokens; default: what the memory left after "
                                               "the weights and a max-size warm-up holds")
    max_waiting_tokens: int = _flag("decode steps after which waiting requests are admitted regardless of "
                                    "--waiting-served-ratio", 20)
    max_batch_size: int | None = _flag("largest running batch (default: --max-concurrent-requests x --max-best-of)")
    max_client_batch_size: int = _flag("most prompts in one /v1/completions request", 4)
    cuda_graphs: str | None = _flag("comma-separated decode batch sizes to capture as CUDA graphs; 0 disables "
                                    "them; default: 1,2,4,8,16,24,32,48,64,... up to the batch size")
    cuda_memory_fraction: float = _flag("fraction of the GPU memory this server may use", 1.0)
    admission: str = _flag("KV admission rule: peak (LightLLM's peak future usage) or reserve (TGI-style sum of "
                           "maxima, for comparison)", "peak", choices=("peak", "reserve"))
    hostname: str = _flag("address the HTTP server listens on (env HOSTNAME, as TGI; shells often set it: "
                          "prefer the flag)", "0.0.0.0")
    port: int = _flag("HTTP port", 3000)
    master_addr: str = _flag("torch.distributed rendezvous address of the shards", "localhost")
    master_port: int = _flag("torch.distributed rendezvous port of the shards", 29500)
    huggingface_hub_cache: str | None = _flag("hub cache directory (default: huggingface_hub's, HF_HOME)")
    api_key: str | None = _flag("require `Authorization: Bearer <key>` on the generation routes")
    payload_limit: int = _flag("largest request body in bytes (413 beyond)", 2_000_000)
    validation_workers: int = _flag("tokenizer threads of the front end", 2)
    disable_grammar_support: bool = _flag("refuse `grammar` in requests", False)
    enable_prefill_logprobs: bool = _flag("accepted for TGI compatibility: prompt logprobs are always "
                                          "available here (`decoder_input_details`)", False)
    json_output: bool = _flag("log as JSON lines", False)
    log_level: str = _flag("logging level", "INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), env="LOG_LEVEL")
    trust_remote_code: bool = _flag("not supported: this engine runs its own model code", False)
    quantize: str | None = _flag("not supported yet (weights run in --dtype)")
    speculate: int | None = _flag("not supported yet")
    hf_token: str | None = _flag("token for gated or private hub models", env="HF_TOKEN")

    def __post_init__(self):
        _check(self)


_UNSUPPORTED = {"trust_remote_code": "--trust-remote-code is not supported: this engine runs its own model code",
                "quantize": "--quantize is not supported yet: the weights run in --dtype",
                "speculate": "--speculate is not supported yet"}


def _check(c: LaunchConfig) -> None:
    for name, message in _UNSUPPORTED.items():
        if getattr(c, name):
            raise LaunchError(message)
    if c.max_input_tokens is not None and c.max_input_length is not None:
        raise LaunchError("set either --max-input-tokens or its legacy name --max-input-length, not both")
    positive = ["max_concurrent_requests", "max_best_of", "max_top_n_tokens", "validation_workers", "port",
                "payload_limit", "max_client_batch_size"]
    for name in positive:
        if getattr(c, name) < (0 if name == "max_top_n_tokens" else 1):
            raise LaunchError(f"--{name.replace('_', '-')} must be positive, got {getattr(c, name)}")
    if c.num_shard is not None and c.num_shard < 1:
        raise LaunchError(f"--num-shard must be >= 1, got {c.num_shard}")
    if c.sharded is False and (c.num_shard or 1) > 1:
        raise LaunchError(f"--sharded false contradicts --num-shard {c.num_shard}")
    if c.sharded and c.num_shard == 1:
        raise LaunchError("--sharded true contradicts --num-shard 1")
    if not 0 < c.cuda_memory_fraction <= 1:
        raise LaunchError(f"--cuda-memory-fraction must be in (0, 1], got {c.cuda_memory_fraction}")
    if c.waiting_served_ratio < 0:
        raise LaunchError(f"--waiting-served-ratio must be >= 0, got {c.waiting_served_ratio}")


@dataclass(frozen=True)
class Limits:
    """The token limits after defaults are derived from the model (TGI's rules)."""
    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int | None


def resolve_limits(config: LaunchConfig, max_position_embeddings: int, max_allocatable: int | None) -> Limits:
    context = min(max_position_embeddings, max_allocatable or max_position_embeddings)
    total = config.max_total_tokens or context
    given_input = config.max_input_tokens if config.max_input_tokens is not None else config.max_input_length
    max_input = given_input if given_input is not None else total - 1
    prefill = config.max_batch_prefill_tokens or max(max_input + 50, 4096)
    limits = Limits(max_input, total, prefill, config.max_batch_total_tokens)
    problems = [
        (total > max_position_embeddings,
         f"`max_total_tokens` ({total}) must be <= the model's context length ({max_position_embeddings})"),
        (max_input < 1, f"`max_input_tokens` must be >= 1, got {max_input}"),
        (max_input >= total, f"`max_input_tokens` must be < `max_total_tokens`. Given: {max_input} and {total}"),
        (prefill < max_input,
         f"`max_batch_prefill_tokens` must be >= `max_input_tokens`. Given: {prefill} and {max_input}"),
        (config.max_batch_total_tokens is not None and config.max_batch_total_tokens < total,
         f"`max_batch_total_tokens` must be >= `max_total_tokens`. Given: {config.max_batch_total_tokens} "
         f"and {total}"),
        (config.max_batch_total_tokens is not None and prefill > config.max_batch_total_tokens,
         f"`max_batch_prefill_tokens` must be <= `max_batch_total_tokens`. Given: {prefill} and "
         f"{config.max_batch_total_tokens}"),
    ]
    for bad, message in problems:
        if bad:
            raise LaunchError(message)
    return limits


def cuda_graph_sizes(config: LaunchConfig) -> tuple[int, ...] | None:
    """None: the engine's default buckets; (): graphs off."""
    if config.cuda_graphs is None:
        return None
    try:
        sizes = tuple(int(x) for x in config.cuda_graphs.split(",") if x.strip())
    except ValueError:
        raise LaunchError(f"--cuda-graphs takes comma-separated batch sizes, got {config.cuda_graphs!r}") from None
    return () if sizes in ((), (0,)) else sizes


# ---- command line and environment ----------------------------------------------------------

def _env_name(f) -> str:
    return f.metadata.get("env") or f.name.upper()


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _converter(f):
    kind = str(f.type)
    if "bool" in kind:
        return _parse_bool
    if "int" in kind:
        return int
    if "float" in kind:
        return float
    return str


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launcher.py", description="Serve a Hugging Face model with TGI's HTTP API. Every flag can also be "
        "set through the environment variable named after it (e.g. --max-total-tokens <-> MAX_TOTAL_TOKENS); "
        "the command line wins.")
    for f in fields(LaunchConfig):
        default = f.default
        shown = "" if default is None else f" (default: {default})"
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=_converter(f),
                            choices=f.metadata.get("choices"), default=None, metavar=f.name.upper(),
                            nargs="?" if "bool" in str(f.type) else None,
                            const=True if "bool" in str(f.type) else None,
                            help=f"{f.metadata['help']}{shown} [env: {_env_name(f)}]")
    parser.add_argument("-p", dest="port", type=int, default=None, help="short for --port")
    return parser


def parse_args(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """Command line over environment over defaults; exits with a usage error on bad values."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    environ = os.environ if environ is None else environ
    values = {}
    for f in fields(LaunchConfig):
        if args.get(f.name) is not None:
            values[f.name] = args[f.name]
        elif environ.get(_env_name(f)) not in (None, "") and not _skip_env(f.name, environ):
            try:
                values[f.name] = _converter(f)(environ[_env_name(f)])
            except (ValueError, argparse.ArgumentTypeError) as e:
                parser.error(f"environment variable {_env_name(f)}={environ[_env_name(f)]!r}: {e}")
    if "hf_token" not in values and environ.get("HUGGING_FACE_HUB_TOKEN"):
        values["hf_token"] = environ["HUGGING_FACE_HUB_TOKEN"]
    try:
        return LaunchConfig(**values)
    except LaunchError as e:
        parser.error(str(e))


def _skip_env(name: str, environ: Mapping[str, str]) -> bool:
    """HOSTNAME is set by most shells to the machine's name, not an address to listen on."""
    return name == "hostname" and environ.get("HOSTNAME") == os.uname().nodename


__all__ = ["LaunchConfig", "LaunchError", "Limits", "build_parser", "parse_args", "resolve_limits",
           "cuda_graph_sizes", "replace", "DEMO_MODEL"]
