"""Latency against throughput over a sweep of request rates, drawn as a PNG (as vLLM's
benchmark users plot `benchmark_serving.py` runs).

    python -m bench.plot --url http://127.0.0.1:3000 --rates 1,2,4,8,inf --num-requests 128 \\
        --prompt-len 64-512 --output-len 256 --png sweep.png [--json sweep.json]
    python -m bench.plot --from-json sweep.json --png sweep.png      # redraw a saved sweep

Each rate is one `bench.load` run over the same prompts (built once through the server's
`/tokenize`, see bench/load.py): Poisson arrivals at that many requests/s, `inf` = all at
once. The PNG has two panels against output throughput (generated tokens/s): TTFT p50/p99
and TPOT p50/p99 (ms), each point labelled with its rate.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path

from . import load

# (panel title, summary key) of the two panels; each draws p50 and p99
PANELS = (("TTFT", "ttft_s"), ("TPOT", "tpot_s"))
STATS = ("p50", "p99")


def parse_rates(text: str) -> list[float]:
    """'1,2,4,inf' -> [1.0, 2.0, 4.0, inf]; every rate > 0."""
    rates = [float(part) for part in text.split(",") if part.strip()]
    if not rates or any(not rate > 0 for rate in rates):
        raise ValueError(f"--rates {text!r}: give request rates > 0 separated by commas, e.g. '1,2,4,inf'")
    return rates


def run_sweep(url: str, prompts: list[load.PromptRequest], rates: list[float], seed: int = 0,
              max_concurrency: int | None = None) -> list[dict]:
    """One load run per rate, in order: [{"rate", "summary"}] (summary: ``load.summarize_run``)."""
    points = []
    for rate in rates:
        run = asyncio.run(load.run_load(url, prompts, rate, seed, max_concurrency))
        summary = load.summarize_run(run)
        print(load.format_summary(f"{len(prompts)} requests, rate {rate}", summary))
        points.append({"rate": rate, "summary": summary})
    return points


def series(points: list[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """``"TTFT p50"`` -> (output tokens/s, milliseconds), one pair per rate; NaN where undefined."""
    x = [p["summary"]["output_throughput"] for p in points]
    return {f"{title} {stat}": (x, [p["summary"][key][stat] * 1000 for p in points])
            for title, key in PANELS for stat in STATS}


def plot_sweep(points: list[dict], png_path: str | Path, title: str = "Latency vs throughput"):
    """Draw ``points`` (``run_sweep``'s) into ``png_path``; returns the matplotlib Figure. Headless
    (Agg). The PNG's text chunk "Series" lists the drawn series' names."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    lines = series(points)
    figure, axes = pyplot.subplots(1, len(PANELS), figsize=(11, 4.5), constrained_layout=True)
    for axis, (panel, _) in zip(axes, PANELS):
        for stat, marker in zip(STATS, ("o", "s")):
            x, y = lines[f"{panel} {stat}"]
            axis.plot(x, y, marker=marker, label=f"{panel} {stat}")
        for point, xi, yi in zip(points, *lines[f"{panel} p99"]):
            axis.annotate(_rate_label(point["rate"]), (xi, yi), textcoords="offset points", xytext=(4, 4),
                          fontsize=8)
        axis.set_xlabel("output throughput (tokens/s)")
        axis.set_ylabel(f"{panel} (ms)")
        axis.set_title(panel)
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.suptitle(title)
    figure.savefig(png_path, format="png", dpi=100, metadata={"Series": ", ".join(lines)})
    pyplot.close(figure)
    return figure


def _rate_label(rate: float) -> str:
    return "all at once" if math.isinf(rate) else f"{rate:g} req/s"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.plot", description=__doc__,
                                     formatter_class=load.HelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:3000", help="base URL of the running server")
    parser.add_argument("--rates", default="1,2,4,8,inf", help="request rates of the sweep (requests/s; inf: all "
                                                               "at once)")
    parser.add_argument("--num-requests", type=int, default=128, help="requests per rate")
    parser.add_argument("--prompt-len", default="64-512", help="prompt tokens: 'n' or an inclusive range 'a-b'")
    parser.add_argument("--output-len", default="256", help="max_new_tokens: 'n' or an inclusive range 'a-b'")
    parser.add_argument("--seed", type=int, default=0, help="seed of lengths, prompt words and arrivals")
    parser.add_argument("--max-concurrency", type=int, help="most requests in flight (later arrivals wait)")
    parser.add_argument("--png", required=True, help="write the plot to this PNG file")
    parser.add_argument("--json", help="also write the sweep's numbers to this file")
    parser.add_argument("--from-json", help="redraw a sweep saved with --json instead of running one")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.from_json:
        points = json.loads(Path(args.from_json).read_text())["points"]
    else:
        lengths = load.sample_lengths(args.num_requests, load.parse_length_range(args.prompt_len),
                                      load.parse_length_range(args.output_len), args.seed)
        prompts = load.build_requests(load.ServerTokenizer(args.url), lengths, args.seed)
        points = run_sweep(args.url, prompts, parse_rates(args.rates), args.seed, args.max_concurrency)
    if args.json and not args.from_json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "points": points}, indent=1))
    plot_sweep(points, args.png)
    print(f"wrote {args.png}")
    return points


if __name__ == "__main__":
    main()
