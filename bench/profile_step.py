"""Where a decode step's time goes, batch size by batch size (no HTTP, no router).

    python -m bench.profile_step --model-dir /tmp/llama2-7b [--batch-sizes 1,64,256] [--table-dir DIR]

For each batch size B it prefills B requests of --context tokens, then measures:

  gpu_ms      the decode forward + logits alone on the device (CUDA events around a graph
              replay, or around the eager forward when graphs are off)
  step_ms     ``ModelWorker.execute`` of a decode step, wall clock: inputs, forward, sampling,
              tokens back on the host (one step at a time)
  piped_ms    the same steps pipelined as the router runs them (launch N+1, then wait for N)
  sample_ms   the sampler alone on that step's logits (greedy), wall clock
  host_ms     step_ms - gpu_ms: the time the device would idle in a one-step-at-a-time loop
  launch_ms   the host's time to issue that forward (inputs, launches), the device idle, not waiting

and, with --table-dir, writes torch.profiler's kernel table of one eager forward per B (with PDL on, a
kernel's time there includes its wait for the launch before it: take the tables with ENGINE_PDL=0).
On a CPU the timings are wall clock of the torch references (for a smoke run only).

With --prompt-chunk N every measured step is a mixed step, as stall-free batching makes them: the B
decode rows plus one N-token prompt chunk of another request, from position --context (the same
positions each step: the timing, not the text, is measured). Mixed steps run through the piecewise CUDA
graphs (``engine.worker.piecewise``: every layer but its attention replayed; eagerly with --cuda-graphs off or
past the largest bucket), so gpu_ms is that forward between CUDA events and piped_ms - gpu_ms shows how far the host's
launches fall behind the device:

    python -m bench.profile_step --model-dir /tmp/llama2-7b --batch-sizes 1,64,200 --prompt-chunk 704

A batch size of 0 (with --prompt-chunk) measures the chunk alone, as a long prompt's steps run when nothing
else decodes (no row samples: sample_ms and tokens/s are 0):

    python -m bench.profile_step --model-dir /tmp/llama31-8b --batch-sizes 0 --prompt-chunk 4096 \
        --chunk-context 28672 --table-dir DIR
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine.router.allocator import SlotAllocator
from engine.models import load_model_config
from engine.protocol.messages import SamplingParams
from engine.protocol.messages import FED_BACK, Step, StepRow
from engine.worker.kv_cache import KV_CACHE_DTYPES
from engine.worker.model_worker import ModelWorker, WorkerConfig, resolve_dtype

PREFILL_CHUNK_TOKENS = 8192


class DecodeFixture:
    """B requests prefilled to ``context`` tokens; ``next_step`` makes their next decode step, with
    ``prompt_chunk`` > 0 also a chunk of that many prompt tokens of one more request (prefilled to
    ``chunk_context`` tokens, default ``context``), at positions ``chunk_context..chunk_context + prompt_chunk - 1``
    every step."""

    def __init__(self, worker: ModelWorker, batch_size: int, context: int, first_id: int, prompt_chunk: int = 0,
                 chunk_context: int | None = None):
        self.worker = worker
        self.allocator = SlotAllocator(worker.num_slots, worker.config.max_requests)
        self.ids = [first_id + i for i in range(batch_size)]
        self.positions = {}
        self.chunk_row = None
        prompter = first_id + batch_size
        rows = []
        chunk_context = context if chunk_context is None else chunk_context
        held = {request_id: context for request_id in self.ids}
        if prompt_chunk:
            held[prompter] = chunk_context
        for request_id, length in held.items():
            self.allocator.open_request(request_id)
            prompt = [(request_id * 7919 + j) % 1000 + 10 for j in range(length)]
            rows.append(StepRow(request_id, self.allocator.row(request_id), 0, prompt,
                                self.allocator.allocate(request_id, length), sample=True, params=SamplingParams()))
            self.positions[request_id] = length
        for chunk in _chunks(rows, PREFILL_CHUNK_TOKENS):
            worker.execute(Step(rows=chunk))
        if prompt_chunk:
            tokens = [(prompter * 31 + j) % 1000 + 10 for j in range(prompt_chunk)]
            self.chunk_row = StepRow(prompter, self.allocator.row(prompter), chunk_context, tokens,
                                     self.allocator.allocate(prompter, prompt_chunk), sample=False)

    def next_step(self) -> Step:
        rows = []
        for request_id in self.ids:
            pos = self.positions[request_id]
            rows.append(StepRow(request_id, self.allocator.row(request_id), pos, [FED_BACK],
                                self.allocator.allocate(request_id, 1), sample=True))
            self.positions[request_id] = pos + 1
        return Step(rows=rows + ([self.chunk_row] if self.chunk_row is not None else []))

    def close(self) -> None:
        self.worker.execute(Step(rows=[], released=list(self.positions)))


def _chunks(rows: list[StepRow], max_tokens: int):
    chunk, tokens = [], 0
    for row in rows:
        if chunk and tokens + len(row.input_ids) > max_tokens:
            yield chunk
            chunk, tokens = [], 0
        chunk.append(row)
        tokens += len(row.input_ids)
    if chunk:
        yield chunk


def _wall_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _forward_call(worker: ModelWorker, step: Step):
    """What a step runs on the device, as a call: a decode step's graph replay (inputs put in place once),
    else (a mixed step, or no graphs) the worker's forward with its inputs and logits (``ModelWorker._forward``:
    a mixed step's piecewise graphs)."""
    decoder = worker.decoder
    if decoder is None or any(row.input_ids[0] != FED_BACK for row in step.rows):
        return lambda: worker._forward(step, [])
    size = next(b for b in decoder.buckets if b >= len(step.rows))
    decoder.run(step)                         # fills the inputs and the table
    return decoder.graphs[size][0].replay if size in decoder.graphs else (lambda: decoder._forward(size))


def _device_ms(worker: ModelWorker, step: Step, repeats: int) -> float:
    """The forward + logits on the device (CUDA events around ``repeats`` calls in a row: an eager step whose
    launches take longer than its kernels shows the launches' time), wall clock on a CPU."""
    run = _forward_call(worker, step)
    return _events_ms(run, repeats) if worker.device.type == "cuda" else _wall_ms(run, repeats)


def _launch_ms(worker: ModelWorker, step: Step, repeats: int) -> float:
    """Host ms to issue one forward (inputs, launches) with the device idle, not waiting for it to finish."""
    run = _forward_call(worker, step)
    times = []
    for _ in range(repeats):
        if worker.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    if worker.device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times)


def _events_ms(run, repeats: int) -> float:
    """Device ms per call of ``run``, between CUDA events around ``repeats`` calls in a row."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def _pipelined_ms(worker: ModelWorker, fixture: DecodeFixture, repeats: int) -> float:
    """Wall clock per step when step N+1 is launched before step N's tokens are awaited."""
    launched = worker.launch(fixture.next_step())
    start = time.perf_counter()
    for _ in range(repeats):
        newer = worker.launch(fixture.next_step())
        launched.result()
        launched = newer
    launched.result()
    return (time.perf_counter() - start) * 1e3 / (repeats + 1)


def _kernel_table(worker: ModelWorker, step: Step, path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if worker.device.type == "cuda" else [])
    forward = lambda: worker._forward(step, [], eager=True)  # noqa: E731  (the step's own work: the last layer
    #                                                          and the LM head for the rows it reads)
    forward()
    with profile(activities=activities) as prof:
        for _ in range(3):
            forward()
        if worker.device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if worker.device.type == "cuda" else "self_cpu_time_total"
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70))


def profile_batch(worker: ModelWorker, batch_size: int, context: int, repeats: int, table_dir: Path | None,
                  prompt_chunk: int = 0, chunk_context: int | None = None) -> dict:
    fixture = DecodeFixture(worker, batch_size, context, first_id=batch_size * 100_000, prompt_chunk=prompt_chunk,
                            chunk_context=chunk_context)
    try:
        for _ in range(3):
            worker.execute(fixture.next_step())            # warm-up
        step_ms = statistics.median(_wall_ms(lambda: worker.execute(fixture.next_step()), 1)
                                    for _ in range(repeats))
        piped_ms = _pipelined_ms(worker, fixture, repeats)
        step = fixture.next_step()
        gpu_ms = _device_ms(worker, step, repeats)
        launch_ms = _launch_ms(worker, step, repeats)
        _, logits, _ = worker._forward(step, [])           # the sampled rows' logits, as a step's sampler gets them
        states = [worker._sampling[r.request_id] for r in step.rows if r.sample]
        sample_ms = _wall_ms(lambda: worker.sampler(logits, states), repeats) if states else 0.0
        if table_dir is not None:
            _kernel_table(worker, step, table_dir / f"kernels_b{batch_size}.txt")
    finally:
        fixture.close()
    return {"batch_size": batch_size, "prompt_chunk": prompt_chunk, "gpu_ms": round(gpu_ms, 3),
            "step_ms": round(step_ms, 3),
            "piped_ms": round(piped_ms, 3),
            "sample_ms": round(sample_ms, 3), "host_ms": round(step_ms - gpu_ms, 3), "launch_ms": round(launch_ms, 3),
            "tokens_per_s": round(batch_size / piped_ms * 1e3, 1)}


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text}")
    return value


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers >= 0, got {text!r}")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, help="checkpoint directory")
    parser.add_argument("--batch-sizes", type=_batch_sizes, default="1,64,256",
                        help="comma-separated decode batch sizes (0: none, the --prompt-chunk alone)")
    parser.add_argument("--context", type=int, default=384, help="tokens each request holds before decoding")
    parser.add_argument("--repeats", type=int, default=30, help="timed repetitions per measurement")
    parser.add_argument("--cuda-graphs", choices=["on", "off"], default="on", help="decode CUDA graphs")
    parser.add_argument("--dtype", default=None, help="float16 | bfloat16 | float32 (default: the device's)")
    parser.add_argument("--kv-cache-dtype", default=None, choices=sorted(KV_CACHE_DTYPES),
                        help="a quantized KV cache (the launcher's flag; default: the model's dtype)")
    parser.add_argument("--prompt-chunk", type=_non_negative, default=0,
                        help="prompt tokens of another request in every measured step (mixed steps); "
                             "default 0: decode steps")
    parser.add_argument("--chunk-context", type=_non_negative, default=None,
                        help="tokens the prompt chunk's request holds before its chunk (default: --context): "
                             "a short-context stream beside a chunk late in a long prompt")
    parser.add_argument("--table-dir", help="write torch.profiler kernel tables here")
    parser.add_argument("--json", help="also write the numbers to this file")
    return parser


def main(argv=None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    sizes = args.batch_sizes
    if 0 in sizes and not args.prompt_chunk:
        parser.error("--batch-sizes: 0 (no decode rows) needs --prompt-chunk, or a step would carry nothing")
    chunk_context = args.context if args.chunk_context is None else args.chunk_context
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = load_model_config(args.model_dir)
    worker = ModelWorker(WorkerConfig(
        model_dir=args.model_dir, dtype=resolve_dtype(args.dtype, config, device), device=device,
        kernel_backend="triton" if device.type == "cuda" else "torch",
        max_requests=max(sizes) + (1 if args.prompt_chunk else 0),
        max_seq_len=max(args.context + 4 * args.repeats, chunk_context + args.prompt_chunk) + 64,
        cuda_graphs=None if args.cuda_graphs == "on" else (),
        kv_cache_dtype=args.kv_cache_dtype))
    table_dir = Path(args.table_dir) if args.table_dir else None
    if table_dir:
        table_dir.mkdir(parents=True, exist_ok=True)
    results = [profile_batch(worker, b, args.context, args.repeats, table_dir, args.prompt_chunk, chunk_context)
               for b in sizes]
    if args.prompt_chunk:
        print(f"\nmixed steps: each batch's decode rows plus a {args.prompt_chunk}-token prompt chunk from position "
              f"{chunk_context}")
    print(f"\n{'batch':>6} {'gpu ms':>8} {'step ms':>8} {'piped ms':>9} {'sample ms':>10} {'host ms':>8} "
          f"{'launch ms':>10} {'tokens/s (piped)':>17}")
    for r in results:
        print(f"{r['batch_size']:6d} {r['gpu_ms']:8.3f} {r['step_ms']:8.3f} {r['piped_ms']:9.3f} "
              f"{r['sample_ms']:10.3f} {r['host_ms']:8.3f} {r['launch_ms']:10.3f} {r['tokens_per_s']:17.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
