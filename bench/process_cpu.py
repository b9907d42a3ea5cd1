"""CPU use of each server process, idle and while one request streams.

    python -m bench.process_cpu --model-dir /tmp/llama2-7b [--idle-s 10] [--json out.json]

Starts the real launcher, waits until it is healthy and idle, then reads each process's
user + system CPU time (``/proc/PID/stat``) over ``--idle-s`` seconds with no request, and
again over one streamed request of ``--new-tokens`` tokens. The processes are named from
the launcher's "started NAME (pid N)" log lines. A process that waits without spinning
shows about 0% idle.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time

import requests

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far (fields 14 and 15 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def named_processes(log_text: str) -> dict[str, int]:
    return {name: int(pid) for name, pid in re.findall(r"started (\S+) \(pid (\d+)\)", log_text)}


def usage_over(processes: dict[str, int], seconds: float, during=None) -> dict[str, float]:
    """Percent of one core each process used over ``seconds`` (``during`` runs meanwhile)."""
    before = {name: cpu_seconds(pid) for name, pid in processes.items()}
    start = time.monotonic()
    if during is not None:
        during()
    remaining = seconds - (time.monotonic() - start)
    if remaining > 0:
        time.sleep(remaining)
    elapsed = time.monotonic() - start
    return {name: round(100 * (cpu_seconds(pid) - before[name]) / elapsed, 1) for name, pid in processes.items()}


def stream_one(url: str, new_tokens: int) -> None:
    body = {"inputs": "def fibonacci(n):", "parameters": {"max_new_tokens": new_tokens}}
    with requests.post(url + "/generate_stream", json=body, stream=True, timeout=600) as response:
        response.raise_for_status()
        for _ in response.iter_lines():
            pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True,
                        help="checkpoint directory with a tokenizer, served by the launcher with its default flags")
    parser.add_argument("--idle-s", type=float, default=10.0,
                        help="seconds measured with no request, once the server has settled 2 s after /health "
                             "(default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=512,
                        help="max_new_tokens of the one request streamed after the idle interval; its whole stream "
                             "is measured (default: %(default)s)")
    parser.add_argument("--server-timeout", type=float, default=600.0,
                        help="seconds to wait for the server's /health (default: %(default)s)")
    parser.add_argument("--json", help="also write each process's percent of a core, idle and streaming, to this "
                                       "file")
    return parser


def main(argv=None) -> dict:
    from tests.e2e.server import LaunchedServer

    args = build_parser().parse_args(argv)
    server = LaunchedServer(args.model_dir).wait_healthy(timeout=args.server_timeout)
    try:
        processes = named_processes(server.output())
        time.sleep(2.0)                                       # let the start-up settle
        idle = usage_over(processes, args.idle_s)
        streaming = threading.Thread(target=stream_one, args=(server.url, args.new_tokens))
        busy = usage_over(processes, 0.0, during=lambda: (streaming.start(), streaming.join()))
    finally:
        server.stop()
    result = {"idle_percent_of_a_core": idle, "one_stream_percent_of_a_core": busy}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
