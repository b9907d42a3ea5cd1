"""The front end process: load the tokenizer, wait for the router's Ready, bind the port, serve."""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

from .frontend_group import FrontendMember, listening_socket, usable_cores, use_shared_metrics

log = logging.getLogger("tgi_compat.frontend")

# The front ends yield the CPU to the router and the shards, whose launches feed the GPU: during a burst's
# intake the tokenizers' threads of every front end want every core. Their niceness is raised by this much, and
# each front end's tokenizer pool gets its share of the cores (RAYON_NUM_THREADS, unless set). One H200 host,
# 4 front ends, the shared-prefix burst's first step (the 3,000-token prefix alone): launched in 70.8 ms
# without this, 43.4 ms with it (stop 54, one debug-logged run each; the later 4,000-token steps took
# 84-120 ms to launch either way).
FRONTEND_NICENESS = 5

# The front end's helper threads (tokenizers, the router pipe's reader and writer) each need the GIL for a
# moment, mostly while the event loop is busy with a burst: Python's default 5 ms before a waiting thread may
# take it made each hand-over wait 5-50 ms (a busy loop beside two such threads on a 2-core machine: a queued
# message waited p50 16.6 ms for its writer thread, 1.3 ms at 0.5 ms)
GIL_SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True)
class FrontendSpec:
    model_dir: str
    hostname: str
    port: int
    settings: object               # tgi_compat.settings.ServerSettings
    tokenizer_config_path: str | None = None   # --tokenizer-config-path: its chat template and special tokens
    processes: int = 1             # --frontend-processes: how many serve the port together


def frontend_main(spec: FrontendSpec, conn, log_level="INFO", member: FrontendMember = FrontendMember()) -> None:
    """Load the tokenizer, wait for the router's Ready, then bind the port and serve until
    SIGTERM (then: stop accepting, let running requests finish within the settings'
    ``stream_shutdown_grace_s``, --graceful-termination-timeout).
    ``log_level``: an ``engine.processes.LogSetup`` (or a level name); ``member``: which of the server's
    front-end processes this is (``tgi_compat.frontend_group``)."""
    from engine.processes import child_setup

    child_setup(log_level)           # dies with the supervisor, which stops it with SIGTERM
    yield_cpu_to_the_engine(member)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    log.info("a waiting thread may take the GIL after %.1f ms (sys.setswitchinterval)", 1000 * sys.getswitchinterval())
    import uvicorn

    from engine.client import RouterClient
    from tgi_compat.app import create_app
    from tgi_compat.http_protocol import HeaderTimeoutProtocol
    from tgi_compat.request_ids import number_from

    number_from(member.first_request_id(), member.count)
    use_shared_metrics(member)
    client = RouterClient(conn)
    log.info("loading the tokenizer of %s", spec.model_dir)
    try:
        tokenizer = load_tokenizer(spec.model_dir, spec.tokenizer_config_path)
    except TokenizerError as e:
        log.error("not serving: %s", e)
        raise SystemExit(1) from None
    log.info("waiting for the shards to load the model, warm up and size the KV cache")
    status = client.wait_ready()
    if not status.healthy:
        log.error("not serving: %s", status.error)
        raise SystemExit(1)
    app = create_app(spec.settings, tokenizer, client, member)
    try:
        sock = listening_socket(spec.hostname, spec.port, reuse_port=member.shared)
    except OSError as e:
        log.error("not serving: cannot listen on %s:%d (%s)", spec.hostname, spec.port, e)
        raise SystemExit(1) from None
    log.info("%s", serving_line(spec, status.kv_capacity, member))
    # log_config=None: uvicorn's loggers go through the process's own handler (--json-output too).
    config = uvicorn.Config(app, log_level="warning", log_config=None, http=HeaderTimeoutProtocol,
                            timeout_graceful_shutdown=spec.settings.stream_shutdown_grace_s)
    uvicorn.Server(config).run(sockets=[sock])


def yield_cpu_to_the_engine(member: FrontendMember) -> None:
    """Lower this process's CPU priority below the router's and the shards' (``FRONTEND_NICENESS``) and size
    its tokenizer thread pool to its share of the usable cores (before the tokenizer's first batch)."""
    os.nice(FRONTEND_NICENESS)
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, usable_cores() // member.count)))
    log.info("CPU niceness %d, up to %s tokenizer threads (RAYON_NUM_THREADS)", os.nice(0),
             os.environ["RAYON_NUM_THREADS"])


def serving_line(spec: FrontendSpec, kv_slots: int, member: FrontendMember = FrontendMember()) -> str:
    """The one line that says what is served, with which limits (TGI logs its args likewise)."""
    s = spec.settings
    who = f" (front end {member.index + 1} of {member.count})" if member.shared else ""
    return (f"serving {s.model_id} on http://{spec.hostname}:{spec.port}{who}: {s.model_dtype} on "
            f"{s.num_shards} {s.model_device_type} shard(s), {kv_slots} KV slots (tokens) of "
            f"{s.kv_cache_dtype or s.model_dtype}, "
            f"max_input_tokens {s.max_input_tokens}, max_total_tokens {s.max_total_tokens}, "
            f"max_batch_prefill_tokens {s.max_batch_prefill_tokens}, "
            f"max_concurrent_requests {s.max_concurrent_requests}")


class TokenizerError(RuntimeError):
    """The model's tokenizer cannot be loaded (the message says why and what to do)."""


# What a tokenizer_config.json given by --tokenizer-config-path replaces (TGI reads the same keys).
TOKENIZER_CONFIG_KEYS = ("chat_template", "bos_token", "eos_token")


def load_tokenizer(model_dir: str, tokenizer_config_path: str | None = None):
    """The model's tokenizer; with ``tokenizer_config_path``, that file's chat template and
    BOS/EOS tokens (as the chat template sees them) replace the model's."""
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001  (missing files, a converter that is not installed, a corrupt file)
        reason = " ".join(str(e).split())
        raise TokenizerError(f"the tokenizer of {model_dir} cannot be loaded ({reason}); the server needs a fast "
                             f"tokenizer: add the base model's tokenizer.json to the model's folder") from None
    if tokenizer_config_path:
        overrides = json.loads(Path(tokenizer_config_path).read_text())
        for key in TOKENIZER_CONFIG_KEYS:
            value = overrides.get(key)
            if isinstance(value, dict):        # {"content": "<s>", ...}, as tokenizer_config.json may spell it
                value = value.get("content")
            if value is not None:
                setattr(tokenizer, key, value)
        log.info("tokenizer config from %s (%s)", tokenizer_config_path,
                 ", ".join(k for k in TOKENIZER_CONFIG_KEYS if k in overrides) or "no chat keys")
    return tokenizer
