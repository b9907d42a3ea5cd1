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

and, with --table-dir, writes torch.profiler's kernel table of one eager forward per B (with PDL on, a
kernel's time there includes its wait for the launch before it: take the tables with ENGINE_PDL=0).
On a CPU the timings are wall clock of the torch references (for a smoke run only).
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
    """B requests prefilled to ``context`` tokens; ``next_step`` makes their next decode step."""

    def __init__(self, worker: ModelWorker, batch_size: int, context: int, first_id: int):
        self.worker = worker
        self.allocator = SlotAllocator(worker.num_slots, worker.config.max_requests)
        self.ids = [first_id + i for i in range(batch_size)]
        self.positions = {}
        rows = []
        for request_id in self.ids:
            self.allocator.open_request(request_id)
            prompt = [(request_id * 7919 + j) % 1000 + 10 for j in range(context)]
            rows.append(StepRow(request_id, self.allocator.row(request_id), 0, prompt,
                                self.allocator.allocate(request_id, context), sample=True, params=SamplingParams()))
            self.positions[request_id] = context
        for chunk in _chunks(rows, PREFILL_CHUNK_TOKENS):
            worker.execute(Step(rows=chunk))

    def next_step(self) -> Step:
        rows = []
        for request_id in self.ids:
            pos = self.positions[request_id]
            rows.append(StepRow(request_id, self.allocator.row(request_id), pos, [FED_BACK],
                                self.allocator.allocate(request_id, 1), sample=True))
            self.positions[request_id] = pos + 1
        return Step(rows=rows)

    def close(self) -> None:
        self.worker.execute(Step(rows=[], released=self.ids))


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


def _device_ms(worker: ModelWorker, step: Step, repeats: int) -> float:
    """The decode forward + logits on the device, inputs already in place."""
    decoder = worker.decoder
    if decoder is None:                       # CPU: the eager forward, wall clock
        batch = worker._forward_batch(step)
        return _wall_ms(lambda: worker.model.compute_logits(worker.model.forward(batch, worker.kv_cache)), repeats)
    size = next(b for b in decoder.buckets if b >= len(step.rows))
    decoder.run(step)                         # fills the inputs and the table
    run = decoder.graphs[size][0].replay if size in decoder.graphs else (lambda: decoder._forward(size))
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

    batch = worker._forward_batch(step)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if worker.device.type == "cuda" else [])
    forward = lambda: worker.model.compute_logits(worker.model.forward(batch, worker.kv_cache))  # noqa: E731
    forward()
    with profile(activities=activities) as prof:
        for _ in range(3):
            forward()
        if worker.device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if worker.device.type == "cuda" else "self_cpu_time_total"
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70))


def profile_batch(worker: ModelWorker, batch_size: int, context: int, repeats: int, table_dir: Path | None) -> dict:
    fixture = DecodeFixture(worker, batch_size, context, first_id=batch_size * 100_000)
    try:
        for _ in range(3):
            worker.execute(fixture.next_step())            # warm-up
        step_ms = statistics.median(_wall_ms(lambda: worker.execute(fixture.next_step()), 1)
                                    for _ in range(repeats))
        piped_ms = _pipelined_ms(worker, fixture, repeats)
        step = fixture.next_step()
        gpu_ms = _device_ms(worker, step, repeats)
        logits = worker.model.compute_logits(worker.model.forward(worker._forward_batch(step), worker.kv_cache))
        states = [worker._sampling[r.request_id] for r in step.rows]
        sample_ms = _wall_ms(lambda: worker.sampler(logits, states), repeats)
        if table_dir is not None:
            _kernel_table(worker, step, table_dir / f"kernels_b{batch_size}.txt")
    finally:
        fixture.close()
    return {"batch_size": batch_size, "gpu_ms": round(gpu_ms, 3), "step_ms": round(step_ms, 3),
            "piped_ms": round(piped_ms, 3),
            "sample_ms": round(sample_ms, 3), "host_ms": round(step_ms - gpu_ms, 3),
            "tokens_per_s": round(batch_size / piped_ms * 1e3, 1)}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, help="checkpoint directory")
    parser.add_argument("--batch-sizes", default="1,64,256", help="comma-separated decode batch sizes")
    parser.add_argument("--context", type=int, default=384, help="tokens each request holds before decoding")
    parser.add_argument("--repeats", type=int, default=30, help="timed repetitions per measurement")
    parser.add_argument("--cuda-graphs", choices=["on", "off"], default="on", help="decode CUDA graphs")
    parser.add_argument("--dtype", default=None, help="float16 | bfloat16 | float32 (default: the device's)")
    parser.add_argument("--kv-cache-dtype", default=None, choices=sorted(KV_CACHE_DTYPES),
                        help="a quantized KV cache (the launcher's flag; default: the model's dtype)")
    parser.add_argument("--table-dir", help="write torch.profiler kernel tables here")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = load_model_config(args.model_dir)
    worker = ModelWorker(WorkerConfig(
        model_dir=args.model_dir, dtype=resolve_dtype(args.dtype, config, device), device=device,
        kernel_backend="triton" if device.type == "cuda" else "torch", max_requests=max(sizes),
        max_seq_len=args.context + 4 * args.repeats + 64, cuda_graphs=None if args.cuda_graphs == "on" else (),
        kv_cache_dtype=args.kv_cache_dtype))
    table_dir = Path(args.table_dir) if args.table_dir else None
    if table_dir:
        table_dir.mkdir(parents=True, exist_ok=True)
    results = [profile_batch(worker, b, args.context, args.repeats, table_dir) for b in sizes]
    print(f"\n{'batch':>6} {'gpu ms':>8} {'step ms':>8} {'piped ms':>9} {'sample ms':>10} {'host ms':>8} "
          f"{'tokens/s (piped)':>17}")
    for r in results:
        print(f"{r['batch_size']:6d} {r['gpu_ms']:8.3f} {r['step_ms']:8.3f} {r['piped_ms']:9.3f} "
              f"{r['sample_ms']:10.3f} {r['host_ms']:8.3f} {r['tokens_per_s']:17.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
