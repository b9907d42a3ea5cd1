"""The launcher's configuration: TGI's flags, their environment variables, their checks.

``LaunchConfig`` is the one frozen dataclass; ``build_parser`` derives every flag from
its fields (name, type, default, help), and ``parse_args`` is the one place that reads
the environment: each flag can be set through its upper-snake-case variable
(``--max-total-tokens`` <-> ``MAX_TOTAL_TOKENS``), and the command line wins.
``resolve_limits`` fills the token limits that depend on the model the way TGI does,
and ``resolve_num_shard`` the shard count that depends on the visible GPUs.

Flags of TGI that this engine does not implement are of two kinds: those that would
change what is served or that a user relies on (``--quantize`` other than gptq / awq / fp8 /
compressed-tensors, ``--trust-remote-code``,
``--lora-adapters``, ``--weights-cache-override``) are
errors when set; those that only concern TGI's plumbing
(``--shard-uds-path``, ``--ngrok``, ``--prometheus-port``, ...) are accepted, and
``LaunchConfig.notices`` lists the ones set to something that is not applied, for the
launcher to log.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Mapping, get_type_hints

from .frontend_group import MAX_FRONTEND_PROCESSES

DEMO_MODEL = str(Path(__file__).resolve().parents[1] / "weights" / "demo")

QUANTIZE_CHOICES = ("awq", "compressed-tensors", "eetq", "exl2", "gptq", "marlin", "bitsandbytes",
                    "bitsandbytes-nf4", "bitsandbytes-fp4", "fp8")
QUANTIZE_SUPPORTED = ("gptq", "awq", "fp8", "compressed-tensors")   # weights.quant_formats.QUANTIZE_FLAGS
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
NO_ENV = ""     # ``env=NO_ENV``: a flag that no environment variable sets


class LaunchError(ValueError):
    """A flag, or a combination of flags, that cannot work; the message says which and why."""


def _flag(help_text: str, default=None, *, choices=None, env: str | None = None, short: str | None = None,
          minimum=None, above=None, maximum=None, too_small: str | None = None, shown: str | None = None,
          secret=False):
    """A field with what its flag needs: ``minimum``/``above``/``maximum`` bound numbers
    (``too_small`` is TGI's message when there is one), ``shown`` is the default as the help
    prints it, ``secret`` keeps the value out of the repr (and so out of logs)."""
    meta = {"help": help_text, "choices": choices, "env": env, "short": short, "minimum": minimum,
            "above": above, "maximum": maximum, "too_small": too_small, "shown": shown}
    return field(default=default, metadata=meta, repr=not secret)


MAX_SPECULATE = 32    # drafts per verify row: past this a row costs more than an n-gram draft can return


@dataclass(frozen=True)
class LaunchConfig:
    # ---- the model ----
    model_id: str = _flag("Hugging Face hub id (downloaded with huggingface_hub into its cache) or a local "
                          "directory with config.json, the tokenizer and *.safetensors", DEMO_MODEL,
                          shown="weights/demo, the bundled demo model")
    revision: str | None = _flag("hub revision of --model-id: a branch, tag or commit (e.g. refs/pr/2); "
                                 "default: main")
    dtype: str | None = _flag("weight and activation dtype; default: the checkpoint's half precision on a GPU "
                              "(float32 checkpoints run in bfloat16), float32 on a CPU. float32 is our "
                              "extension (TGI has only the half precisions): full precision on a GPU too",
                              choices=("float16", "bfloat16", "float32"))
    trust_remote_code: bool = _flag("not supported: this engine runs its own model code, never the hub's", False)
    quantize: str | None = _flag("quantized linear layers. A checkpoint's quantization_config (GPTQ or AWQ 4-bit, "
                                 "FP8 or compressed-tensors float8) is read without this flag; fp8 quantizes a "
                                 "float16/bfloat16 checkpoint at load (per-channel weight scales, per-token "
                                 "activation scales); gptq, awq and compressed-tensors must match the checkpoint. "
                                 "Default: the checkpoint's", choices=QUANTIZE_CHOICES)
    speculate: int | None = _flag("draft tokens verified per request and step (speculative decoding): drafts come "
                                  "from n-gram lookup in the request's own prompt and output, or from the Medusa "
                                  "heads when --model-id is a Medusa repository (medusa_num_heads and "
                                  "base_model_name_or_path in its config.json: the base model is served); the "
                                  "output is exactly that of --speculate 0 (greedy: the same tokens; sampling: the "
                                  "same distribution, the same tokens per seed; penalties and grammars included). "
                                  f"Default: 0 (off), or the Medusa heads' count; at most {MAX_SPECULATE} (each "
                                  "verify row computes 1 + N positions, and its warm-up sizes the KV cache for them)",
                                  minimum=0, maximum=MAX_SPECULATE)
    kv_cache_dtype: str | None = _flag("KV cache dtype: fp8_e4m3fn or fp8_e5m2 (per-tensor scales from the "
                                       "checkpoint's k_scale/v_scale or kv_scale, else 1.0) or int8 (our extension, "
                                       "LightLLM's: one scale per token and KV head); about twice the KV slots. "
                                       "Default: the model's dtype", choices=("fp8_e4m3fn", "fp8_e5m2", "int8"))
    lora_adapters: str | None = _flag("comma-separated LoRA adapter ids to load; not supported yet")
    rope_scaling: str | None = _flag("RoPE scaling to apply over the checkpoint's: linear or dynamic (factor "
                                     "--rope-factor, 1.0 if unset); default: the checkpoint's config",
                                     choices=("linear", "dynamic"))
    rope_factor: float | None = _flag("RoPE scaling factor; alone it means linear scaling; the context length "
                                      "grows by this factor; default: the checkpoint's config", above=0.0)
    tokenizer_config_path: str | None = _flag("alternative tokenizer_config.json: its chat_template, bos_token and "
                                              "eos_token replace the model's for chat requests; "
                                              "default: the model's")
    weights_cache_override: str | None = _flag("not supported: point --model-id at a local directory instead")
    huggingface_hub_cache: str | None = _flag("hub cache directory; default: huggingface_hub's "
                                              "(HF_HUB_CACHE, else HF_HOME/hub)")
    hf_token: str | None = _flag("token for gated or private hub models (prefer the environment variable; "
                                 "HUGGING_FACE_HUB_TOKEN is read too); default: huggingface_hub's saved login",
                                 env="HF_TOKEN", secret=True)
    hf_hub_offline: bool = _flag("use the hub cache only, never the network (the hub code gets it as "
                                 "HF_HUB_OFFLINE=1 would give it)", False, env="HF_HUB_OFFLINE")
    # ---- sharding and the devices ----
    num_shard: int | None = _flag("tensor-parallel shards, one process and GPU each; default: every visible "
                                  "GPU (1 on a CPU)", minimum=1, too_small="`num_shard` cannot be < 1")
    sharded: bool | None = _flag("true requires at least 2 shards, false allows only 1 (as TGI); default: unset, "
                                 "--num-shard decides")
    master_addr: str = _flag("torch.distributed rendezvous address of the shards", "localhost")
    master_port: int = _flag("torch.distributed rendezvous port of the shards", 29500, minimum=1, maximum=65535)
    cuda_memory_fraction: float = _flag("fraction of the GPU memory this server may use (0 < x <= 1)", 1.0,
                                        above=0.0)
    cuda_graphs: tuple[int, ...] | None = _flag(
        "comma-separated decode batch sizes captured as CUDA graphs, 0 disables them (and the piecewise graphs "
        "of steps with prompt tokens); default: the engine's sizes (1,2,4,8,16,24,32,48,64,... up to the batch "
        "size)")
    disable_custom_kernels: bool = _flag("run the torch reference ops instead of the Triton kernels", False)
    # ---- request limits ----
    max_concurrent_requests: int = _flag("requests served at once; more are answered 429 'Model is overloaded'",
                                         128, minimum=1)
    max_best_of: int = _flag("largest `best_of` a request may ask for", 2, minimum=1,
                             too_small="`max_best_of` must be >= 1")
    max_stop_sequences: int = _flag("most `stop` sequences a request may give", 4, minimum=0)
    max_top_n_tokens: int = _flag("largest `top_n_tokens` a request may ask for", 5, minimum=0)
    max_input_tokens: int | None = _flag("longest prompt in tokens; default: --max-total-tokens - 1", minimum=1)
    max_input_length: int | None = _flag("legacy name of --max-input-tokens (set only one of them); "
                                         "default: unset", minimum=1)
    max_total_tokens: int | None = _flag("prompt + max_new_tokens of one request; default: the model's context "
                                         "length, capped by what the KV memory holds", minimum=2)
    max_client_batch_size: int = _flag("most prompts in one /v1/completions request", 4, minimum=1)
    payload_limit: int = _flag("largest request body in bytes (413 beyond)", 2_000_000, minimum=1)
    # ---- batching ----
    waiting_served_ratio: float = _flag("admit waiting requests into a running batch only once waiting >= ratio x "
                                        "running (or after --max-waiting-tokens steps). TGI's default is 0.3; ours "
                                        "is 0 because our steps carry prompt chunks beside the decode rows, so "
                                        "holding requests back saves no forward pass, only delays first tokens",
                                        0.0, minimum=0.0)
    max_batch_prefill_tokens: int | None = _flag(
        "tokens of one step: a row per decoding request first, prompt chunks in the rest (longer prompts are "
        "chunked, so it may be below --max-input-tokens). Default: 4096, capped by the KV capacity; with the "
        "default, while requests decode, the prompt chunks' cost is also capped at a few decode steps' time "
        "(their attention over a long context counted), so long prompts do not stall the streams; a value given "
        "here is a plain token budget", minimum=1)
    max_batch_total_tokens: int | None = _flag("KV cache capacity in tokens; default: what the memory left after "
                                               "the weights and a warm-up holds", minimum=1)
    max_waiting_tokens: int = _flag("decode steps after which waiting requests are admitted regardless of "
                                    "--waiting-served-ratio", 20, minimum=0)
    max_batch_size: int | None = _flag("largest running batch, at most 65535 (the prefill attention's grid); "
                                       "default: --max-concurrent-requests x --max-best-of, at most 1024",
                                       minimum=1, maximum=65535)
    step_timeout: float = _flag("seconds the shards may take for one step before the server reports itself "
                                "unhealthy (/health 503) and ends the requests in flight with an error; it is "
                                "healthy again when the shards answer (this engine's; TGI has none). 60 s is far "
                                "above any step we measured (a whole 100k-token prompt chunk, a first grammar "
                                "compile) and short enough for a health check to catch a hung GPU or collective",
                                60.0, above=0.0)
    admission: str = _flag("KV admission rule (this engine's): peak (LightLLM's peak future usage) or reserve "
                           "(TGI-style sum of maxima, for comparison)", "peak", choices=("peak", "reserve"))
    prefix_caching: bool = _flag("reuse the KV cache of prompt prefixes that earlier requests computed (a radix "
                                 "tree over token slots; shared system prompts and multi-turn chats prefill "
                                 "only what is new). On by default as in TGI 3; PREFIX_CACHING=0 or "
                                 "--prefix-caching false turns it off", True)
    # ---- the HTTP server ----
    hostname: str = _flag("address the HTTP server listens on. As TGI, the environment variable is HOSTNAME, "
                          "which shells and Docker set to the machine's name: a HOSTNAME equal to this "
                          "machine's name is ignored; prefer the flag", "0.0.0.0")
    port: int = _flag("HTTP port (TGI's Docker image sets PORT=80)", 3000, short="-p", minimum=1, maximum=65535)
    api_key: str | None = _flag("require `Authorization: Bearer <key>` on the generation routes; default: no "
                                "key", secret=True)
    validation_workers: int = _flag("tokenizer threads of the front end", 2, minimum=1,
                                    too_small="`validation_workers` must be > 0")
    frontend_processes: int | None = _flag(
        "HTTP front-end processes serving --port together (SO_REUSEPORT: the kernel spreads the connections): "
        "each parses, validates, tokenizes (--validation-workers threads) and streams its share, so a burst of "
        "requests is taken in that many times faster; they share --max-concurrent-requests and /metrics. "
        "Default: one per 4 usable cores, at most 4", minimum=1, maximum=MAX_FRONTEND_PROCESSES, shown="auto")
    disable_grammar_support: bool = _flag("refuse `grammar` in requests", False)
    enable_prefill_logprobs: bool = _flag("accepted for TGI compatibility: prompt logprobs are always available "
                                          "here (`decoder_input_details`)", False)
    cors_allow_origin: tuple[str, ...] | None = _flag("comma-separated origins a browser may call the API from "
                                                      "(CORS); default: any")
    prometheus_port: int = _flag("TGI's separate metrics port; not applied: /metrics is served on --port",
                                 9000, minimum=1, maximum=65535)
    watermark_gamma: float | None = _flag("fraction of the vocabulary in the green list of requests with "
                                          "`watermark: true` (Kirchenbauer et al.); default: 0.5", above=0.0)
    watermark_delta: float | None = _flag("bias added to the green logits of requests with `watermark: true`; "
                                          "default: 2.0", minimum=0.0)
    graceful_termination_timeout: int = _flag("on SIGTERM or Ctrl-C the server stops accepting requests at once "
                                              "and the running ones get this many seconds to finish; then every "
                                              "process stops", 90, short="-g", minimum=0)
    # ---- logs, tracing and TGI plumbing ----
    json_output: bool = _flag("every process (launcher, shards, router, front end) logs one JSON object per "
                              "line: {timestamp, level, fields: {message}, target, process}", False)
    log_level: str = _flag("logging level: debug, info, warning or error", "INFO", env="LOG_LEVEL",
                           choices=LOG_LEVELS)
    env: bool = _flag("log the runtime environment at start (versions of Python, torch, triton, transformers "
                      "and huggingface_hub, the devices), then serve", False, env=NO_ENV, short="-e")
    otlp_endpoint: str | None = _flag("OpenTelemetry collector to send each request's trace to (OTLP over gRPC, "
                                      "e.g. http://localhost:4317): a span per request with its validation, queue "
                                      "and inference phases; needs pip install 'lightserve[otlp]'; default: unset")
    otlp_service_name: str = _flag("the service.name of the traces sent to --otlp-endpoint",
                                   "text-generation-inference.router")
    shard_uds_path: str = _flag("TGI's router-to-shard gRPC socket; not applied: the shards talk over pipes",
                                "/tmp/text-generation-server")
    ngrok: bool = _flag("TGI's ngrok tunnel; not applied", False)
    ngrok_authtoken: str | None = _flag("ngrok token; not applied; default: unset", secret=True)
    ngrok_edge: str | None = _flag("ngrok edge; not applied; default: unset")
    usage_stats: str = _flag("TGI's usage telemetry: on, off or no-stack; this engine never sends any", "on",
                             choices=("on", "off", "no-stack"))

    def __post_init__(self):
        _check(self)

    @property
    def notices(self) -> tuple[str, ...]:
        """One line per flag set to a value this engine accepts but does not apply (for the log)."""
        return tuple(f"--{_dashed(name)} is accepted for TGI compatibility but not applied: {why}"
                     for name, why in NOT_APPLIED.items() if getattr(self, name) != _default(name))

    @property
    def rope(self) -> tuple[str, float] | None:
        """(scaling type, factor) asked on the command line, TGI's way; None: the checkpoint's."""
        if self.rope_scaling is None and self.rope_factor is None:
            return None
        return (self.rope_scaling or "linear", self.rope_factor if self.rope_factor is not None else 1.0)


_UNSUPPORTED = {
    "trust_remote_code": "--trust-remote-code is not supported: this engine runs its own model code",
    "lora_adapters": "--lora-adapters is not supported yet: merge the adapter into the weights",
    "weights_cache_override": "--weights-cache-override is not supported: point --model-id at a local directory",
}
NOT_APPLIED = {
    "prometheus_port": "/metrics is served on --port",
    "shard_uds_path": "the shards talk over pipes",
    "ngrok": "no tunnel is opened; expose --port yourself",
    "ngrok_authtoken": "no tunnel is opened",
    "ngrok_edge": "no tunnel is opened",
}


def _dashed(name: str) -> str:
    return name.replace("_", "-")


def _default(name: str):
    return _fields()[name].default


def _check(c: LaunchConfig) -> None:
    """The checks that need no model (TGI's launcher does them before starting anything)."""
    for name, message in _UNSUPPORTED.items():
        if getattr(c, name) not in (_default(name), None, False):
            raise LaunchError(message)
    if c.quantize is not None and c.quantize not in QUANTIZE_SUPPORTED:
        raise LaunchError(f"--quantize {c.quantize} is not supported; supported: gptq and awq (4-bit checkpoints), "
                          f"fp8 (an FP8 checkpoint, or a float16/bfloat16 one quantized at load), "
                          f"compressed-tensors (float8 checkpoints); a quantized checkpoint needs no flag")
    for f in fields(c):
        value = getattr(c, f.name)
        if value is not None and not isinstance(value, (bool, tuple, str)):
            problem = _out_of_range(f, value)
            if problem:
                raise LaunchError(problem)
        choices = f.metadata["choices"]
        if choices and value is not None and value not in choices:
            raise LaunchError(f"--{_dashed(f.name)} must be one of {', '.join(choices)}, got {value!r}")
    if c.max_input_tokens is not None and c.max_input_length is not None:
        raise LaunchError(f"Both `max_input_tokens` ({c.max_input_tokens}) and `max_input_length` "
                          f"({c.max_input_length}) are set: set only --max-input-tokens (--max-input-length is "
                          f"its deprecated name)")
    if c.sharded and c.num_shard is not None and c.num_shard <= 1:
        raise LaunchError("`sharded` is true but `num_shard` <= 1")
    if c.sharded is False and c.num_shard is not None and c.num_shard > 1:
        raise LaunchError(f"`sharded` is false but `num_shard` is {c.num_shard} (--sharded false contradicts "
                          f"--num-shard {c.num_shard}): drop one of the two flags")
    if c.otlp_endpoint is not None:
        _check_otlp(c.otlp_endpoint)
    if c.watermark_gamma is not None and c.watermark_gamma >= 1:
        raise LaunchError(f"--watermark-gamma must be in (0, 1), got {c.watermark_gamma}")
    if c.cuda_memory_fraction > 1:
        raise LaunchError(f"--cuda-memory-fraction must be in (0, 1], got {c.cuda_memory_fraction}")
    if c.cuda_graphs is not None and any(size < 1 for size in c.cuda_graphs):
        raise LaunchError(f"--cuda-graphs sizes must be >= 1 (or just 0 to disable), got {c.cuda_graphs}")
    _check_limits(_input_tokens(c), c.max_total_tokens, c.max_batch_prefill_tokens, c.max_batch_total_tokens)


def _out_of_range(f, value) -> str | None:
    """Why ``value`` is outside the field's bounds, or None."""
    low, above, high = f.metadata["minimum"], f.metadata["above"], f.metadata["maximum"]
    if (low is not None and value < low) or (above is not None and value <= above):
        bound = f">= {low}" if low is not None else f"> {above}"
        return f.metadata["too_small"] or f"--{_dashed(f.name)} must be {bound}, got {value}"
    if high is not None and value > high:
        return f"--{_dashed(f.name)} must be <= {high}, got {value}"
    return None


def _input_tokens(c: LaunchConfig) -> int | None:
    return c.max_input_tokens if c.max_input_tokens is not None else c.max_input_length


def _check_otlp(endpoint: str) -> None:
    from .tracing import check_available

    if not endpoint.startswith(("http://", "https://")) or "://" == endpoint[-3:]:
        raise LaunchError(f"--otlp-endpoint must be a collector URL such as http://localhost:4317, got {endpoint!r}")
    missing = check_available()
    if missing:
        raise LaunchError(missing)


def _check_limits(max_input: int | None, total: int | None, prefill: int | None, batch_total: int | None) -> None:
    """TGI's token-limit checks (launcher and router), on whichever of the values are known."""
    problems = [
        (max_input, total, lambda: max_input >= total,
         f"`max_input_tokens` must be < `max_total_tokens`. Given: {max_input} and {total}"),
        (total, batch_total, lambda: total > batch_total,
         f"`max_total_tokens` must be <= `max_batch_total_tokens`. Given: {total} and {batch_total}"),
        (prefill, batch_total, lambda: prefill > batch_total,
         f"`max_batch_prefill_tokens` must be <= `max_batch_total_tokens`. Given: {prefill} and {batch_total}"),
    ]
    for a, b, bad, message in problems:
        if a is not None and b is not None and bad():
            raise LaunchError(message)


# ---- limits that depend on the model and the memory ---------------------------------------------

@dataclass(frozen=True)
class Limits:
    """The token limits after defaults are derived from the model (TGI's rules).

    ``max_batch_total_tokens`` is None while the KV capacity is not known yet (before the
    engine measured its memory and no --max-batch-total-tokens was given)."""
    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int | None


STEP_TOKENS = 4096        # the default step budget (chunked prefill: prompts of any length fit)
ARRIVAL_WINDOW_S = 0.02   # a request came this recently: the router plans after a prompt step in flight, not beside
#                           it (engine.router.router), so arrivals during that step join the next one: a burst's
#                           first tokens come a step sooner (one H100: the prompt steps of a 256-request
#                           shared-prefix burst took 31-154 ms each). 20 ms, not 100: the router reads its pipes
#                           while a step runs, so a burst's arrivals are there when the step ends, and steps
#                           after the burst plan beside the one in flight again 20 ms after its last request (one
#                           H200, that burst's TTFT p50 over five bursts 517 -> 456 ms; the 512-request load
#                           8,608 -> 8,505 tokens/s, the mean of two runs each, within the 2-5% by which the
#                           second server of a run was slower either way). Not with --speculate: its verify rows
#                           keep the step order they were tested with (stop 35's note)
STALL_FREE_TOKENS = 192   # with the default budget, while requests decode, the prompt chunks' cost cap
STALL_FREE_ROW_TOKENS = 64  # (engine.router.scheduler) is 192 (times 1 + decode context / kv_weight_tokens), plus
#                           64 per decoding request. Stop 46, one H200 through HTTP, against a cap of 704 for every
#                           batch (stop 43's) in the same run: Llama-2-7B, 512 prompts of 64-512 tokens at once,
#                           5,754 -> 8,172 output tokens/s (TTFT p50 8.96 -> 2.06 s); Llama-3.1-8B, 64 prompts of 2k-16k
#                           tokens at once: TTFT p50 8.49 -> 8.51 s, ITL p99 52.9 -> 51.9 ms, 312 -> 281 tokens/s; a
#                           batch-1 stream beside a 100k-token prompt: ITL p50 21.1 -> 9.6 ms (idle 4.1 ms), p99 27.6 ->
#                           25.9 ms, the prompt's TTFT 13.0 -> 23.2 s (those runs also cut chunks to 32-token multiples,
#                           dropped since: in process, by the script that became bench.beside_steps, the prompt took
#                           26.0 s with it, 22.1 s without). The landed code, another run: the 512-request load 8,126
#                           output tokens/s.


def resolve_limits(config: LaunchConfig, context_length: int, max_allocatable: int | None = None) -> Limits:
    """Fill the limits the flags left unset, then check them all.

    | limit                    | default                                                   |
    | max_total_tokens         | min(max_allocatable, context length)                      |
    | max_input_tokens         | max_total_tokens - 1                                      |
    | max_batch_prefill_tokens | 4096, capped by the KV capacity (TGI: max_input_tokens + 50 or 4096; we chunk |
    |                          | every prompt, so a step's size bounds its time and activations, not a prompt) |
    | max_batch_total_tokens   | --max-batch-total-tokens, else max_allocatable            |

    ``context_length`` is the model's, with --rope-scaling/--rope-factor already applied
    (``engine.models.load_model_config``); ``max_allocatable`` is how many tokens the KV
    memory holds (None: not measured yet).
    """
    context = context_length
    capacity = config.max_batch_total_tokens if config.max_batch_total_tokens is not None else max_allocatable
    total = config.max_total_tokens or (min(context, max_allocatable) if max_allocatable else context)
    max_input = _input_tokens(config)
    max_input = max_input if max_input is not None else total - 1
    if total > context:
        raise LaunchError(f"`max_total_tokens` ({total}) must be <= the model's context length ({context}): "
                          f"lower --max-total-tokens (or extend the context with --rope-scaling/--rope-factor)")
    if capacity is not None and config.max_batch_total_tokens is None and total > capacity:
        raise LaunchError(f"`max_total_tokens` ({total}) is more than the KV memory holds ({capacity} tokens): "
                          f"lower --max-total-tokens or raise --cuda-memory-fraction")
    prefill = config.max_batch_prefill_tokens
    if prefill is None:
        prefill = STEP_TOKENS if capacity is None else min(STEP_TOKENS, capacity)
    _check_limits(max_input, total, prefill, capacity)
    if max_input < 1:
        raise LaunchError(f"`max_input_tokens` must be >= 1, got {max_input}")
    return Limits(max_input, total, prefill, capacity)


def resolve_num_shard(config: LaunchConfig, visible_gpus: int) -> int:
    """TGI's ``find_num_shards``: --num-shard, else every visible GPU (1 without any)."""
    if config.sharded and config.num_shard is None and visible_gpus <= 1:
        raise LaunchError(f"`sharded` is true but only found {visible_gpus} CUDA devices")
    if config.num_shard is not None:
        return config.num_shard
    return 1 if config.sharded is False else max(visible_gpus, 1)


# ---- command line and environment ---------------------------------------------------------------

@cache
def _fields() -> dict:
    return {f.name: f for f in fields(LaunchConfig)}


@cache
def _types() -> dict:
    return get_type_hints(LaunchConfig)


def env_name(name: str) -> str | None:
    """The environment variable that sets field ``name`` (None for ``--env``)."""
    given = _fields()[name].metadata["env"]
    return name.upper() if given is None else (given or None)


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parse_int(text: str) -> int:
    try:
        return int(text.strip().replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _parse_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _parse_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes like 1,2,4,8 (0 disables), "
                                         f"got {text!r}") from None
    if any(size < 0 for size in sizes) or (0 in sizes and len(sizes) > 1):
        raise argparse.ArgumentTypeError(f"expected batch sizes >= 1, or 0 alone to disable, got {text!r}")
    return () if sizes in ((), (0,)) else sizes


def _parse_names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _parse_log_level(text: str) -> str:
    level = text.strip().upper()
    return {"WARN": "WARNING", "TRACE": "DEBUG"}.get(level, level)


def _converter(name: str):
    """The parser of one field's text: its type, then its choices and bounds (an ArgumentTypeError)."""
    f, kind = _fields()[name], str(_types()[name])
    if name == "log_level":
        parse = _parse_log_level
    else:
        parse = next((p for key, p in (("bool", _parse_bool), ("tuple[int", _parse_sizes),
                                       ("tuple[str", _parse_names), ("int", _parse_int),
                                       ("float", _parse_float)) if key in kind), str)

    def convert(text: str):
        value = parse(text)
        choices = f.metadata["choices"]
        if choices and value not in choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, got {text!r}")
        problem = _out_of_range(f, value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        if problem:
            raise argparse.ArgumentTypeError(problem.removeprefix(f"--{_dashed(name)} "))
        return value
    return convert


def _help(f) -> str:
    default = f.metadata["shown"] or (None if f.default is None else f.default)
    if isinstance(default, bool):
        default = str(default).lower()
    text = f.metadata["help"]
    if default is not None:
        text += f" (default: {default})"
    elif "default" not in text:
        text += " (default: unset)"
    variable = env_name(f.name)
    text += f" [env: {variable}]" if variable else " [no environment variable]"
    return text.replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    """One flag per ``LaunchConfig`` field; every default is None so that parse_args can tell
    a flag given on the command line from one left to the environment or the dataclass."""
    parser = _Parser(
        prog="launcher.py", allow_abbrev=False, usage="%(prog)s [--model-id ID] [--num-shard N] [--port PORT] "
        "[FLAG ...]   (all flags: --help)",
        description="Serve a Hugging Face model with TGI's HTTP API. Every flag can also be set through the "
        "environment variable named after it in upper snake case (--max-total-tokens <-> MAX_TOTAL_TOKENS); "
        "the command line wins. HF_TOKEN (or HUGGING_FACE_HUB_TOKEN), HF_HUB_OFFLINE and LOG_LEVEL are read "
        "too, and ENGINE_PDL=0 turns off programmatic dependent launch of the GPU kernels (Hopper and newer; "
        "for measuring what it brings).")
    for f in fields(LaunchConfig):
        boolean = _types()[f.name] in (bool, bool | None)
        choices = f.metadata["choices"]
        names = [n for n in (f.metadata["short"], f"--{_dashed(f.name)}") if n]
        parser.add_argument(*names, dest=f.name, type=_converter(f.name), default=None,
                            metavar="{" + ",".join(choices or ("true", "false")) + "}" if choices or boolean
                            else f.name.upper(),
                            nargs="?" if boolean else None, const=True if boolean else None, help=_help(f))
    return parser


class _Parser(argparse.ArgumentParser):
    """Adds what the model registry serves to --help, read only when help is printed (the
    registry imports torch; a launcher that only parses flags starts without it)."""

    def format_help(self) -> str:
        from engine.models import quantized_architectures, supported_architectures
        from engine.models.bloom import DEFAULT_CONTEXT

        return (super().format_help() + "\nSupported architectures (config.json `architectures`): "
                f"{', '.join(supported_architectures())}. BloomForCausalLM (ALiBi, no max_position_embeddings in "
                f"config.json) serves a {DEFAULT_CONTEXT}-token context, TGI's default for such configs. Quantized "
                f"checkpoints ({', '.join(quantized_architectures())}): GPTQ 4-bit "
                f"(group 128 / -1, act-order), AWQ 4-bit GEMM, FP8 (fp8, compressed-tensors per-tensor or "
                f"per-channel); --quantize fp8 quantizes a float checkpoint at load.\n")


def check_port_free(host: str, port: int) -> None:
    """The front end's address must be free now (it binds only once the model is loaded): a
    taken port fails in a second, not after minutes of downloading and loading."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except OSError as e:
        raise LaunchError(f"--hostname {host!r} cannot be resolved ({e})") from None
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as uvicorn binds it
        try:
            probe.bind((host, port))
        except OSError as e:
            raise LaunchError(f"--port {port} on {host} is taken ({e.strerror}): stop the server that holds it "
                              f"or choose another --port") from None


def parse_args(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """Command line over environment over defaults: the one place that reads the environment.

    Exits with argparse's usage error (status 2) on a bad value or a failed check; the
    message names the flag or the environment variable, what was given and what is expected.
    """
    parser = build_parser()
    given = vars(parser.parse_args(argv))
    environ = os.environ if environ is None else environ
    values = {}
    for name in _fields():
        variable = env_name(name)
        if given[name] is not None:
            values[name] = given[name]
        elif variable and environ.get(variable, "") != "" and not _ignored_env(name, environ):
            try:
                values[name] = _converter(name)(environ[variable])
            except argparse.ArgumentTypeError as e:
                parser.error(f"environment variable {variable}={environ[variable]!r}: {e}")
    _check_pdl_switch(parser, environ)
    if "hf_token" not in values and environ.get("HUGGING_FACE_HUB_TOKEN"):
        values["hf_token"] = environ["HUGGING_FACE_HUB_TOKEN"]
    try:
        return LaunchConfig(**values)
    except LaunchError as e:
        parser.error(str(e))


def _check_pdl_switch(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """ENGINE_PDL is read by the kernels in every shard; a bad value stops the launcher before any starts."""
    from kernels.pdl_switch import ENV_SWITCH, SWITCH_VALUES

    if environ.get(ENV_SWITCH) not in SWITCH_VALUES:
        parser.error(f"environment variable {ENV_SWITCH}={environ[ENV_SWITCH]!r}: expected 1 (programmatic "
                     "dependent launch on Hopper and newer, the default) or 0 (off)")


def _ignored_env(name: str, environ: Mapping[str, str]) -> bool:
    """HOSTNAME set to the machine's own name (shells and Docker do) is not an address to listen on."""
    return name == "hostname" and environ.get("HOSTNAME") == os.uname().nodename


assert all(f.default is not MISSING for f in fields(LaunchConfig)), "every flag needs a default"

__all__ = ["LaunchConfig", "LaunchError", "Limits", "build_parser", "parse_args", "env_name",
           "resolve_limits", "resolve_num_shard", "DEMO_MODEL", "NOT_APPLIED"]
