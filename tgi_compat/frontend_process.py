"""The front end process: load the tokenizer, wait for the router's Ready, bind the port, serve."""
from __future__ import annotations

import logging
import signal
from dataclasses import dataclass

log = logging.getLogger("tgi_compat.frontend")


@dataclass(frozen=True)
class FrontendSpec:
    model_dir: str
    hostname: str
    port: int
    settings: object               # tgi_compat.settings.ServerSettings


def frontend_main(spec: FrontendSpec, conn, log_level: str = "INFO") -> None:
    """Load the tokenizer, wait for the router's Ready, then bind the port and serve."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the supervisor stops us with SIGTERM
    import uvicorn
    from transformers import AutoTokenizer

    from engine.client import RouterClient
    from tgi_compat.app import create_app

    client = RouterClient(conn)
    tokenizer = AutoTokenizer.from_pretrained(spec.model_dir)
    status = client.wait_ready()
    if not status.healthy:
        log.error("not serving: %s", status.error)
        raise SystemExit(1)
    app = create_app(spec.settings, tokenizer, client)
    log.info("serving on http://%s:%d", spec.hostname, spec.port)
    uvicorn.run(app, host=spec.hostname, port=spec.port, log_level="warning", timeout_graceful_shutdown=2)


