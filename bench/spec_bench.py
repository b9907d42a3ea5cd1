"""Speculative decoding (--speculate): what it gains and what a verify step costs.

    python -m bench.spec_bench demo [--new-tokens 256] [--speculate 4,8] # batch-1 tokens/s, speculate 0 vs 4
    python -m bench.spec_bench verify --model-dir /tmp/llama2-7b       # verify step vs plain decode step
    python -m bench.spec_bench profile --model-dir /tmp/llama2-7b      # their kernels side by side
    python -m bench.spec_bench host --model-dir DIR                    # their host work outside the forward
    python -m bench.spec_bench load --model-dir /tmp/llama2-7b         # random prompts, speculate 0 vs 2
    python -m bench.spec_bench steps [--references /tmp/spec_refs.json] # tokens per forward step (CPU, exact)
    python -m bench.spec_bench batch [--references /tmp/spec_refs.json] # many requests at once (CPU, exact)

demo: the bundled demo model, one request at a time, on prompts that quote their input ("the same
function, renamed": real standard-library sources read with inspect.getsource, then the first line
of the renamed copy; ``--task write``: only the function's signature and docstring); output tokens/s
of the decode phase with --speculate 0 and 4, their ratio, the tokens per forward step and the
acceptance rate (accepted / drafted tokens), drafted by n-gram lookup or by ``--draft-heads``; then,
untimed, each engine runs the prompts again
asking for the top 5 tokens of every step, and each prompt is reported identical, parting at a
near-tie (step k), or NOT at a near-tie (tests/gpu/greedy.py ``near_tie_problem``).
verify: B requests prefilled to --context tokens; the wall time of one ``ModelWorker.execute`` of a
plain decode step ([FED_BACK] per row) and of a verify step (4 drafts per row), and their ratio.
profile: the same two steps under torch.profiler, device time per kernel per step, side by side.
host: the same two steps with the forward replaced by ready logits and hidden states (a graph replay's
host cost): the wall time of the rest of ``execute`` and the torch ops of one step; on a CPU through the eager
PaddedDecoder / PaddedVerifier, the code CUDA runs around its graphs.
load: N random prompts (no repetition to find) all queued at once, output tokens/s with --speculate
0 and 2 (drafts rarely hit: the cost of trying).
steps: what decides the speed-up, exactly and on any machine. The demo model's greedy outputs
(--speculate 0) of the rename prompts and of random prompts (the small model soon repeats itself)
are computed once (cached in --references); "noise" pairs random prompts with random tokens as
outputs (nothing to draft: what trying costs). The real Scheduler, pipelined as the Router runs
it, then replays each request alone against a shard that verifies drafts greedily against that
output (greedy verification is exact, so the rows, drafts and accepted counts are the real
engine's). Per --speculate N: verify rows, drafted, accepted, acceptance rate, output tokens per
forward step of the request (plain decoding = 1.0) and the steps that wait (the request runs but has
no row to plan: its verify row's result decides the next position; plain rows are pipelined and never
wait) per forward step. A wait costs the host's turnaround between a result and the next launch, not a
step (``engine.router.scheduler``): the demo's speed-up on a GPU tells what it costs there.
batch: the same replay with whole workloads at once (64 noise requests of --new-tokens / 2; the rename
prompts; the rename prompts beside 52 noise requests), with the scheduler's step gate and without it
(``verify_step_cost`` 0): decode steps, those that carry verify rows (every row padded to 1 + N tokens),
drafted and accepted, and the cost in decode steps if a verify step costs ``VERIFY_STEP_COST`` more.
"""
from __future__ import annotations

import argparse
import ast
import gc
import inspect
import json
import statistics
import time
from pathlib import Path

import torch

from engine.generation import Engine, EngineConfig, GenerationRequest
from engine.protocol.messages import FED_BACK, RowResult, SamplingParams, Step, StepResult, StepRow
from engine.router.scheduler import VERIFY_STEP_COST, SchedulerConfig

DEMO = Path(__file__).resolve().parents[1] / "weights" / "demo"
DRAFTS = 4              # verify: drafts per verify row
WARMUP_STEPS = 3        # verify: untimed steps before each measurement
DEMO_PASSES = 7         # demo: timed passes, each prompt on every engine in turn (the median pass counts)
DEMO_SLOTS = 32768      # demo: KV slots of each engine (side by side: not sized from free memory)


def stdlib_functions() -> list:
    """Python-level standard-library functions (their sources ship with Python)."""
    import calendar, colorsys, fnmatch, glob, heapq, shutil, statistics, string, textwrap  # noqa: E401
    return [textwrap.dedent, textwrap.indent, string.capwords, shutil.copyfileobj, fnmatch.filter,
            colorsys.rgb_to_hsv, colorsys.hsv_to_rgb, statistics.mean, glob.has_magic, calendar.isleap,
            heapq.nsmallest, calendar.monthrange]


def rename_prompt(tokenizer, function) -> list[int]:
    """A function's source, then the start of its copy under a new name (the model may quote it)."""
    source, name = inspect.getsource(function), function.__name__
    renamed = source.replace(f"def {name}(", f"def renamed_{name}(", 1)
    return tokenizer(f"{source}\n\n# The same function, renamed to renamed_{name}:\n{renamed.splitlines()[0]}\n")[
        "input_ids"]


def write_prompt(tokenizer, function) -> list[int]:
    """A function's first lines up to the end of its docstring: the model writes a body it has not seen
    in the prompt (little for n-gram lookup to copy)."""
    source = inspect.getsource(function)
    definition = ast.parse(source).body[0]
    first = definition.body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str)
    end = first.end_lineno if docstring else definition.lineno       # else the signature's first line
    return tokenizer("\n".join(source.splitlines()[:end]) + "\n")["input_ids"]


PROMPT_TASKS = {"rename": rename_prompt, "write": write_prompt}


def decode_one(engine: Engine, request_id: int, prompt: list[int], new_tokens: int) -> tuple[int, float, list, int]:
    """One request alone: (tokens after the first, the seconds from the first token to the last, the output
    token ids, the steps after the first token's)."""
    engine.add_request(GenerationRequest(request_id, prompt, new_tokens, SamplingParams(), stop_token_ids=[]))
    stamps, out, steps = [], [], 0
    while engine.has_work():
        events = engine.step()
        steps += bool(stamps)
        for event in events:
            stamps.append(time.perf_counter())
            out.append(event.token_id)
    return len(stamps) - 1, stamps[-1] - stamps[0], out, steps


def top_tokens_pass(engine: Engine, prompts: list[list[int]], new_tokens: int) -> list:
    """One request at a time, as timed, asking for the top ``TOP_N`` tokens of every step (untimed): a
    ``tests.gpu.greedy.Greedy`` per prompt."""
    from tests.gpu.greedy import TOP_N, Greedy

    runs = []
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(i, prompt, new_tokens, SamplingParams(top_n_tokens=TOP_N),
                                             stop_token_ids=[]))
        events = []
        while engine.has_work():
            events.extend(engine.step())
        runs.append(Greedy([e.token_id for e in events], [e.logprob for e in events],
                           [dict(zip(e.top_ids, e.top_logprobs)) for e in events]))
    return runs


def compare_prompts(plain: list, speculating: list) -> list[str]:
    """Per prompt, the two greedy runs (``Greedy``): "identical", "near-tie at step k" or "NOT a near-tie
    at step k" (tests/gpu/greedy.py ``near_tie_problem``: at the first difference each run's token is
    among the other's top ``TOP_N``, where a bfloat16 verify row and a decode step may round apart)."""
    from tests.gpu.greedy import first_difference, near_tie_problem

    verdicts = []
    for a, b in zip(plain, speculating):
        k = first_difference(a, b)
        if k is None and len(a.tokens) == len(b.tokens):
            verdicts.append("identical")
        elif k is None:
            verdicts.append(f"NOT a near-tie at step {min(len(a.tokens), len(b.tokens))}: lengths differ")
        elif near_tie_problem(a, b, "speculate 0", "speculating") is None:
            verdicts.append(f"near-tie at step {k}")
        else:
            verdicts.append(f"NOT a near-tie at step {k}")
    return verdicts


def demo(args) -> dict:
    """--speculate 0 and each of ``args.speculate`` (default 4): the first one's speed-up and acceptance
    as the summary's top keys, every one's under "by_speculate". The engines run side by side, one
    warm-up pass, then ``DEMO_PASSES`` timed passes, each prompt on every engine in turn (``_timed_passes``);
    the median pass's speed-up counts. A pass is a second or two of host-bound work (a tiny model at batch
    1), and on the H100 machine one engine's passes ranged over 1.4x (speculate 0 at 1172-2860 tokens/s in
    one process, 1362-1836 across runs), which one pass each turned into speed-ups of 0.99-2.39x; on one H200
    (stop 79) --speculate 0's five passes, each engine's whole pass in turn, ranged over 1.3-2.0x in one
    process while --speculate 4's stayed within 5%, so the best pass of each gave 1.34-1.87x of one tree
    from run to run. After its timed pass each engine runs
    the prompts once more asking for the top tokens (untimed): per prompt, the speculating run is
    identical to --speculate 0's, parts at a near-tie, or not ("prompts", ``compare_prompts``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    task = getattr(args, "task", None) or "rename"
    prompts = [PROMPT_TASKS[task](tokenizer, f) for f in stdlib_functions()][: getattr(args, "prompts", None)]
    lengths = [int(n) for n in str(getattr(args, "speculate", None) or "4").split(",")]
    engines = demo_engines([0, *lengths], getattr(args, "kernel_backend", None),
                           draft_heads=getattr(args, "draft_heads", None))
    try:
        results, outputs, tops = _timed_passes(engines, prompts, args.new_tokens)
    finally:
        for engine in engines.values():
            engine.close()
        engines.clear()
        gc.collect()
    for speculate in lengths:
        r = results[speculate]
        r["speedup"] = statistics.median(r["speedups"])
        r["outputs_identical"] = outputs[speculate] == outputs[0]
        r["prompts"] = compare_prompts(tops[0], tops[speculate])
        r["identical_prompts"] = r["prompts"].count("identical")
        r["not_near_tie_prompts"] = sum(v.startswith("NOT") for v in r["prompts"])
        ties = [v.removeprefix("near-tie at step ") for v in r["prompts"] if v.startswith("near-tie")]
        print(f"demo batch 1 ({len(prompts)} {task} prompts x {args.new_tokens} tokens): speculate 0 "
              f"{results[0]['tokens_per_s']} tokens/s, speculate {speculate} {r['tokens_per_s']} "
              f"tokens/s (median passes), speed-up {r['speedup']}x (median pass; passes {r['speedups']}), "
              f"{r['tokens_per_step']} tokens per step, acceptance "
              f"{r['acceptance_rate']}, identical "
              f"{r['outputs_identical']}: {r['identical_prompts']}/{len(prompts)} prompts identical, "
              f"{len(ties)} part at a near-tie (steps {', '.join(ties) or '-'}), {r['not_near_tie_prompts']} "
              f"NOT at a near-tie")
        for i, verdict in enumerate(r["prompts"]):
            if verdict.startswith("NOT"):
                print(f"  prompt {i}: {verdict}")
    first = results[lengths[0]]
    return {"speculate0_tokens_per_s": results[0]["tokens_per_s"],
            f"speculate{lengths[0]}_tokens_per_s": first["tokens_per_s"], "speedup": first["speedup"],
            "acceptance_rate": first["acceptance_rate"], "accepted_per_step_bonus_excluded": first["accepted"],
            "drafted": first["drafted"], "outputs_identical": all(results[n]["outputs_identical"] for n in lengths),
            "identical_prompts": min(results[n]["identical_prompts"] for n in lengths),
            "not_near_tie_prompts": sum(results[n]["not_near_tie_prompts"] for n in lengths),
            "by_speculate": {str(n): results[n] for n in lengths}}


def demo_engines(lengths: list[int], kernel_backend: str | None, draft_heads: str | None = None) -> dict[int, Engine]:
    """One demo-model engine per --speculate length; ``draft_heads``: the speculating engines draft with these
    Medusa heads."""
    engines = {n: Engine(EngineConfig(model_dir=str(DEMO), max_requests=8, speculate=n, num_slots=DEMO_SLOTS,
                                      kernel_backend=kernel_backend, draft_heads=draft_heads if n else None))
               for n in lengths}
    return engines


def _timed_passes(engines: dict[int, Engine], prompts: list[list[int]], new_tokens: int):
    """``demo``'s passes over the prompts: a warm-up pass, then ``DEMO_PASSES`` timed ones. Within a pass each
    prompt runs on every engine in turn, the first engine rotating from prompt to prompt, so a slow spell of the
    host (they last a prompt or more) falls on every engine alike. A pass's speed-up is its speculating
    tokens/s over its plain ones; the median pass counts. Per engine: (the median pass's tokens/s, every
    timed pass, the median speed-up over --speculate 0 and the last pass's draft counts; the last pass's
    outputs; its top-token runs)."""
    order = list(engines)
    rates = {n: [] for n in engines}
    for _ in range(1 + DEMO_PASSES):
        tokens, seconds, steps = dict.fromkeys(order, 0), dict.fromkeys(order, 0.0), dict.fromkeys(order, 0)
        outputs = {n: [] for n in order}
        for n in order:
            engines[n].router.scheduler.speculation.drafted_tokens = 0
            engines[n].router.scheduler.speculation.accepted_tokens = 0
        for i, prompt in enumerate(prompts):
            for n in order[i % len(order):] + order[:i % len(order)]:
                count, elapsed, out, taken = decode_one(engines[n], i, prompt, new_tokens)
                tokens[n] += count
                seconds[n] += elapsed
                steps[n] += taken
                outputs[n].append(out)
        for n in order:
            rates[n].append(round(tokens[n] / seconds[n], 1))
    results, tops = {}, {}
    for n, engine in engines.items():
        print(f"speculate {n}: tokens/s of the warm-up pass and the timed passes {rates[n]}")
        stats = engine.router.scheduler.speculation
        results[n] = {"tokens_per_s": statistics.median(rates[n][1:]), "passes": rates[n][1:],
                      "speedups": [round(r / r0, 3) for r, r0 in zip(rates[n][1:], rates[order[0]][1:])],
                      "tokens_per_step": round(tokens[n] / max(steps[n], 1), 3),
                      "drafted": stats.drafted_tokens,
                      "accepted": stats.accepted_tokens,
                      "acceptance_rate": round(stats.accepted_tokens / max(stats.drafted_tokens, 1), 3)}
        tops[n] = top_tokens_pass(engine, prompts, new_tokens)
        results[n]["top_pass_equals_timed"] = [r.tokens for r in tops[n]] == outputs[n]
    return results, outputs, tops


def _verify_worker(args, sizes: list[int]):
    """The worker that ``verify`` and ``profile`` time: sized for the largest batch (``_slots_per_request``)."""
    from engine.models import load_model_config
    from engine.worker.model_worker import ModelWorker, WorkerConfig, resolve_dtype

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = load_model_config(args.model_dir)
    return ModelWorker(WorkerConfig(
        model_dir=args.model_dir, dtype=resolve_dtype(None, config, device), device=device,
        kernel_backend="triton" if device.type == "cuda" else "torch", max_requests=max(sizes),
        max_seq_len=args.context + 8 * args.repeats + 64, num_slots=max(sizes) * _slots_per_request(args, DRAFTS),
        warmup_tokens=max(4096, 5 * max(sizes)), speculate=DRAFTS))


def verify(args) -> dict:
    from bench.profile_step import DecodeFixture

    sizes = [int(s) for s in args.batch_sizes.split(",")]
    worker = _verify_worker(args, sizes)
    results = []
    for batch_size in sizes:
        fixture = DecodeFixture(worker, batch_size, args.context, first_id=batch_size * 100_000)
        try:
            plain = _step_ms(worker, lambda: fixture.next_step(), args.repeats)
            verify_ms = _step_ms(worker, lambda: _verify_step(fixture, drafts=DRAFTS), args.repeats)
        finally:
            fixture.close()
        results.append({"batch_size": batch_size, "decode_ms": round(plain, 3), "verify4_ms": round(verify_ms, 3),
                        "ratio": round(verify_ms / plain, 3)})
        print(f"batch {batch_size}, context {args.context}: decode step {plain:.3f} ms, verify step (4 drafts) "
              f"{verify_ms:.3f} ms, ratio {verify_ms / plain:.3f}")
    return {"verify": results}


def profile(args) -> dict:
    """Where a verify step's extra time goes: per batch size, torch.profiler's device time per kernel (op names on
    a CPU) of ``args.repeats`` decode steps and as many verify steps, per step, the kernels of both side by side,
    largest difference first. With PDL (Hopper) a kernel starts early and waits for the one before, so its time
    includes that wait: ``ENGINE_PDL=0`` gives each kernel its own time (an H100 run with PDL put 4.7 of 5.5 ms
    on the skinny GEMMs and spread a verify step's extra over every kernel)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from bench.profile_step import DecodeFixture

    sizes = [int(s) for s in args.batch_sizes.split(",")]
    worker = _verify_worker(args, sizes)
    activity = ProfilerActivity.CUDA if worker.device.type == "cuda" else ProfilerActivity.CPU
    results = []
    for batch_size in sizes:
        fixture = DecodeFixture(worker, batch_size, args.context, first_id=batch_size * 100_000)
        try:
            times = {}
            for name, make in (("decode", fixture.next_step), ("verify", lambda: _verify_step(fixture, DRAFTS))):
                for _ in range(WARMUP_STEPS):
                    worker.execute(make())
                with torch_profile(activities=[activity]) as prof:
                    for _ in range(args.repeats):
                        worker.execute(make())
                times[name] = _kernel_us(prof.key_averages(), activity, args.repeats)
        finally:
            fixture.close()
        rows = sorted(set(times["decode"]) | set(times["verify"]),
                      key=lambda k: -abs(times["verify"].get(k, 0.0) - times["decode"].get(k, 0.0)))
        table = [{"kernel": k, "decode_us": times["decode"].get(k, 0.0), "verify_us": times["verify"].get(k, 0.0)}
                 for k in rows]
        results.append({"batch_size": batch_size, "decode_us": round(sum(times["decode"].values()), 1),
                        "verify_us": round(sum(times["verify"].values()), 1), "kernels": table})
        print(f"batch {batch_size}: {results[-1]['decode_us']} us of kernels a decode step, "
              f"{results[-1]['verify_us']} a verify step ({DRAFTS} drafts); largest differences:")
        for row in table[:15]:
            print(f"  {row['decode_us']:9.1f} -> {row['verify_us']:9.1f} us  {row['kernel'][:100]}")
    return {"profile": results}


def _kernel_us(events, activity, steps: int) -> dict[str, float]:
    """Device microseconds per step of each kernel (CUDA), or self CPU microseconds of each op (CPU)."""
    out = {}
    for e in events:
        us = e.self_device_time_total if activity.name == "CUDA" else e.self_cpu_time_total
        if us > 0 and (activity.name != "CUDA" or e.device_type.name == "CUDA"):
            out[e.key] = round(us / steps, 1)
    return out


def _slots_per_request(args, drafts: int) -> int:
    """The KV slots one request of ``verify`` holds at most (exactly: the CPU test runs with no more): its
    context, a slot per decode step and per verify step (warm-up and timed; each keeps one, the next
    truncates the rest) and the last verify step's drafts. Sized explicitly, for the largest batch: sized
    from free memory after the demo's engines (their freed KV cache still cached, the weights placed in
    it) the worker had too few slots for batch 32 (asked for 512, 492 free)."""
    return args.context + 2 * (WARMUP_STEPS + args.repeats) + drafts


def _verify_step(fixture, drafts: int) -> Step:
    """Every row feeds its newest token and ``drafts`` tokens (arbitrary: the cost does not depend on
    them); the slots past the one kept are given back, as the router truncates rejected drafts."""
    rows = []
    for request_id in fixture.ids:
        pos = fixture.positions[request_id]
        fixture.allocator.truncate(request_id, pos)
        rows.append(StepRow(request_id, fixture.allocator.row(request_id), pos,
                            [FED_BACK] + [(request_id + j) % 300 + 10 for j in range(drafts)],
                            fixture.allocator.allocate(request_id, 1 + drafts), sample=True))
        fixture.positions[request_id] = pos + 1
    return Step(rows=rows)


def _step_ms(worker, make_step, repeats: int) -> float:
    for _ in range(WARMUP_STEPS):
        worker.execute(make_step())          # warm-up (compiles)
    times = []
    for _ in range(repeats):
        step = make_step()
        if worker.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        worker.execute(step)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def host(args) -> dict:
    """What a decode step and a verify step cost the host outside the forward (graph replay on CUDA): the
    forward is replaced by ready logits, the rest of ``ModelWorker.execute`` runs (inputs, table writes,
    sampling, the verify row's kept tokens); median wall time and the torch ops of one step. On a CPU the
    worker gets the eager PaddedDecoder and PaddedVerifier, the paths CUDA runs around its graphs."""
    from torch.profiler import ProfilerActivity, profile

    from bench.profile_step import DecodeFixture
    from engine.models import load_model_config
    from engine.worker.cuda_graphs import GraphOutputs, PaddedDecoder, PaddedVerifier
    from engine.worker.model_worker import ModelWorker, WorkerConfig, resolve_dtype

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = load_model_config(args.model_dir)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    steps = 2 * (WARMUP_STEPS + args.repeats + 1)
    worker = ModelWorker(WorkerConfig(
        model_dir=args.model_dir, dtype=resolve_dtype(None, config, device), device=device,
        kernel_backend="triton" if device.type == "cuda" else "torch", max_requests=max(sizes),
        max_seq_len=args.context + steps + 64, num_slots=max(sizes) * (args.context + steps + DRAFTS),
        speculate=DRAFTS, cuda_graphs=()))
    if device.type == "cpu":
        worker.decoder = PaddedDecoder(worker.model, worker.ops, worker.kv_cache, worker.last_tokens, max(sizes), None,
                                       False)
        worker.verifier = PaddedVerifier(worker.model, worker.ops, worker.kv_cache, worker.last_tokens, max(sizes),
                                         DRAFTS, False)
    ready = torch.randn(max(sizes) * (1 + DRAFTS), config.vocab_size, device=device)
    hidden = torch.randn(ready.shape[0], config.hidden_size, device=device)
    picks = worker.ops.greedy_pick(ready)
    worker.decoder._forward = lambda size: GraphOutputs(ready, hidden, picks).rows(slice(0, size), True)
    width = worker.verifier.width
    worker.verifier._forward = lambda rows: GraphOutputs(ready, hidden, picks).rows(slice(0, rows * width), True)
    results = []
    for batch_size in sizes:
        fixture = DecodeFixture(worker, batch_size, args.context, first_id=batch_size * 100_000)
        try:
            for name, make in (("decode", fixture.next_step), ("verify", lambda: _verify_step(fixture, DRAFTS))):
                ms = _step_ms(worker, make, args.repeats)
                step = make()
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    worker.execute(step)
                ops = {e.key.removeprefix("aten::"): e.count for e in prof.key_averages() if e.key.startswith("aten::")}
                results.append({"batch_size": batch_size, "step": name, "host_us": round(ms * 1e3, 1),
                                "torch_ops": sum(ops.values()), "copies": ops.get("copy_", 0),
                                "tensors_from_lists": ops.get("lift_fresh", 0)})
                print(f"batch {batch_size}, {name} step outside the forward: {ms * 1e3:.0f} us, "
                      f"{sum(ops.values())} torch ops ({ops.get('copy_', 0)} copy_, {ops.get('lift_fresh', 0)} "
                      f"tensors from lists): " + ", ".join(f"{k} x{c}" for k, c in sorted(ops.items(),
                                                                                         key=lambda kv: -kv[1])))
        finally:
            fixture.close()
    return {"host": results}


def load(args) -> dict:
    from engine.models import load_model_config

    from .workloads import many

    vocab = load_model_config(args.model_dir).vocab_size
    workload = many(vocab, count=args.requests, new_tokens=args.new_tokens)
    results = {}
    for speculate in (0, 2):
        engine = Engine(EngineConfig(model_dir=args.model_dir, speculate=speculate))
        engine.generate([GenerationRequest(-1, workload.prompts[0], 8, SamplingParams(), stop_token_ids=[])])
        requests = [GenerationRequest(i, p, workload.max_new_tokens, SamplingParams(), stop_token_ids=[])
                    for i, p in enumerate(workload.prompts)]
        start = time.perf_counter()
        generated = sum(len(v) for v in engine.generate(requests).values())
        results[speculate] = generated / (time.perf_counter() - start)
        stats = engine.router.scheduler.speculation
        print(f"{args.requests} random prompts, speculate {speculate}: {results[speculate]:.1f} output tokens/s "
              f"(drafted {stats.drafted_tokens}, accepted {stats.accepted_tokens})")
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    ratio = results[2] / results[0]
    print(f"speculate 2 / speculate 0 throughput: {ratio:.3f}")
    return {"load_tokens_per_s": {str(k): round(v, 1) for k, v in results.items()}, "load_ratio": round(ratio, 3)}


def references(args) -> dict[str, list[tuple[list[int], list[int]]]]:
    """{"rename"/"random": [(prompt, greedy output)]} of the demo model (speculate 0), cached in a file."""
    path = Path(args.references) if args.references else None
    if path is not None and path.exists():
        cached = json.loads(path.read_text())
        if cached.get("new_tokens") == args.new_tokens:
            return {name: [tuple(pair) for pair in pairs] for name, pairs in cached["workloads"].items()}
    from transformers import AutoTokenizer

    from .workloads import random_prompts

    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    prompts = {"rename": [rename_prompt(tokenizer, f) for f in stdlib_functions()],
               "random": random_prompts(4, 64, 256, tokenizer.vocab_size, seed=2)}
    engine = Engine(EngineConfig(model_dir=str(DEMO), max_requests=8, speculate=0))
    workloads = {}
    for name, group in prompts.items():
        requests = [GenerationRequest(i, p, args.new_tokens, SamplingParams(), stop_token_ids=[])
                    for i, p in enumerate(group)]
        outputs = engine.generate(requests)
        workloads[name] = [(p, [e.token_id for e in outputs[i]]) for i, p in enumerate(group)]
    engine.close()
    if path is not None:
        path.write_text(json.dumps({"new_tokens": args.new_tokens, "workloads": workloads}))
    return workloads


class ReferenceShards:
    """A shard that 'decodes' a known greedy output: a prompt's last chunk samples its first token, a
    decode row the token after its fed one, and a verify row accepts its drafts while they equal the
    output (exactly the worker's greedy verification). Results come back in order, like the worker's."""

    def __init__(self):
        self.outputs: dict[int, tuple[int, list[int]]] = {}    # request id -> (prompt length, output)
        self.results = []

    def submit(self, step: Step) -> None:
        rows = []
        for row in step.rows:
            if not row.sample:
                rows.append(RowResult(row.request_id))
                continue
            prompt_len, output = self.outputs[row.request_id]
            first = row.start_pos + len(row.input_ids) - prompt_len if row.input_ids[0] != FED_BACK \
                else row.start_pos + 1 - prompt_len
            drafts = row.input_ids[1:] if row.input_ids[0] == FED_BACK else []
            kept = 0
            while kept < len(drafts) and drafts[kept] == output[first + kept]:
                kept += 1
            tokens = [RowResult(row.request_id, token_id=t, logprob=0.0) for t in output[first : first + kept + 1]]
            tokens[0].following = tokens[1:]
            rows.append(tokens[0])
        self.results.append(StepResult(rows))

    def collect(self, timeout=None):
        return self.results.pop(0)


def run_pipelined(scheduler, pairs: list[tuple[list[int], list[int]]]) -> dict:
    """The (prompt, output) pairs as requests 0, 1, .. of ``scheduler`` against ``ReferenceShards``, pipelined as
    ``Router.step`` does (a step submitted, then the oldest in flight collected once two are or nothing new could
    be planned). Counts decode steps, those with verify rows, decode rows, verify rows and waits (tokens left to
    plan, but the next row needs the result in flight); raises if any output changed."""
    from collections import deque

    from engine.router.scheduler import Request

    shards, in_flight = ReferenceShards(), deque()
    generated: dict[int, list[int]] = {}
    for rid, (prompt, output) in enumerate(pairs):
        shards.outputs[rid] = (len(prompt), output)
        scheduler.add(Request(rid, list(prompt), len(output), SamplingParams(), seed=0))
        generated[rid] = []
    counts = {"steps": 0, "verify_steps": 0, "rows": 0, "verify_rows": 0, "waits": 0}
    while scheduler.has_work() or in_flight:
        step = scheduler.schedule()
        if step.rows or step.released:
            shards.submit(step)
            in_flight.append(step)
            decode = [len(row.input_ids) for row in step.rows if row.input_ids[0] == FED_BACK]
            verify = sum(n > 1 for n in decode)
            counts["steps"] += bool(decode)
            counts["verify_steps"] += bool(verify)
            counts["rows"] += len(decode)
            counts["verify_rows"] += verify
            if len(in_flight) < 2:
                continue
        elif any(r.remaining > 0 and not r.in_prefill for r in scheduler.running):
            counts["waits"] += 1
        done = in_flight.popleft()
        for request, res, _ in scheduler.process(done, shards.collect()):
            generated[request.request_id].append(res.token_id)
    if any(generated[rid] != output for rid, (_, output) in enumerate(pairs)):
        raise AssertionError("the replay changed an output: speculation must not")
    return counts


def replay(pairs: list[tuple[list[int], list[int]]], speculate: int) -> dict:
    """Each (prompt, output) alone through the real Scheduler (``run_pipelined``): the counts of ``steps``
    (module docstring)."""
    from engine.router.allocator import SlotAllocator
    from engine.router.scheduler import Scheduler

    totals = {"tokens": 0, "rows": 0, "verify_rows": 0, "waits": 0, "drafted": 0, "accepted": 0}
    for prompt, output in pairs:
        longest = len(prompt) + len(output)
        scheduler = Scheduler(SlotAllocator(num_slots=longest + 64, max_requests=2),
                              SchedulerConfig(max_seq_len=longest, speculate=speculate))
        counts = run_pipelined(scheduler, [(prompt, output)])
        for key in ("rows", "verify_rows", "waits"):
            totals[key] += counts[key]
        totals["tokens"] += len(output) - 1
        totals["drafted"] += scheduler.speculation.drafted_tokens
        totals["accepted"] += scheduler.speculation.accepted_tokens
    return totals


def noise(count: int, new_tokens: int, vocab_size: int = 32000) -> list[tuple[list[int], list[int]]]:
    """Random prompts whose 'outputs' are random tokens too (no model): nothing to draft, what trying
    costs (the waits) on loads like the random-prompt ones of ``load``."""
    from .workloads import random_prompts

    prompts = random_prompts(count, 64, 512, vocab_size, seed=3)
    return list(zip(prompts, random_prompts(count, new_tokens, new_tokens, vocab_size, seed=4)))


def replay_batch(pairs: list[tuple[list[int], list[int]]], speculate: int, gate: bool) -> dict:
    """All (prompt, output) pairs at once through the real Scheduler (``run_pipelined``): the counts of
    ``batch`` (module docstring)."""
    from engine.router.allocator import SlotAllocator
    from engine.router.scheduler import Scheduler

    longest = max(len(p) + len(o) for p, o in pairs)
    config = SchedulerConfig(max_seq_len=longest, speculate=speculate, max_prefill_tokens=longest * len(pairs),
                             verify_step_cost=VERIFY_STEP_COST if gate else 0.0)
    scheduler = Scheduler(SlotAllocator(num_slots=len(pairs) * (longest + 16), max_requests=len(pairs)), config)
    counts = run_pipelined(scheduler, pairs)
    return {"decode_steps": counts["steps"], "verify_steps": counts["verify_steps"],
            "drafted": scheduler.speculation.drafted_tokens, "accepted": scheduler.speculation.accepted_tokens,
            "cost_in_decode_steps": round(counts["steps"] + VERIFY_STEP_COST * counts["verify_steps"], 1)}


def batch(args) -> dict:
    refs = references(args)
    rename = refs["rename"][: args.prompts] if args.prompts else refs["rename"]
    loads = {"noise x64": noise(64, args.new_tokens // 2), f"rename x{len(rename)}": rename,
             f"rename x{len(rename)} + noise x52": rename + noise(52, args.new_tokens // 2)}
    results = {}
    for name, pairs in loads.items():
        for gate in (False, True):
            t = replay_batch(pairs, int(args.speculate or 2), gate)
            results[f"{name}/{'gated' if gate else 'ungated'}"] = t
            label = "gated  " if gate else "ungated"
            print(f"{name:22} {label}: {t['decode_steps']} decode steps, {t['verify_steps']} with verify rows, "
                  f"drafted {t['drafted']}, accepted {t['accepted']}, cost {t['cost_in_decode_steps']} decode steps")
    return results


def steps(args) -> dict:
    workloads = {**references(args), "noise": noise(8, args.new_tokens)}
    results = {}
    for name, pairs in workloads.items():
        for speculate in [0] + [int(n) for n in (args.speculate or "2,4,6,8").split(",")]:
            t = replay(pairs, speculate)
            summary = {"verify_rows": t["verify_rows"], "drafted": t["drafted"], "accepted": t["accepted"],
                       "acceptance_rate": round(t["accepted"] / max(t["drafted"], 1), 3),
                       "tokens_per_step": round(t["tokens"] / t["rows"], 3),
                       "waiting_steps": round(t["waits"] / t["rows"], 3)}
            results[f"{name}/speculate{speculate}"] = summary
            print(f"{name:6} speculate {speculate}: {t['rows']} rows ({t['verify_rows']} verify), drafted "
                  f"{t['drafted']}, accepted {t['accepted']} ({summary['acceptance_rate']}), tokens/step "
                  f"{summary['tokens_per_step']}, waits/step {summary['waiting_steps']}")
    return results


def build_parser() -> argparse.ArgumentParser:
    """The command line; ``main`` checks that verify, profile, host and load get --model-dir."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["demo", "verify", "profile", "host", "load", "steps", "batch"],
                        help="the measurement to run (each described above)")
    parser.add_argument("--model-dir", help="checkpoint directory (verify, profile, host, load)")
    parser.add_argument("--new-tokens", type=int, default=256, help="new tokens per request")
    parser.add_argument("--batch-sizes", default="1,32", help="verify, profile, host: comma-separated batch sizes")
    parser.add_argument("--context", type=int, default=512, help="verify, profile, host: tokens each request holds")
    parser.add_argument("--repeats", type=int, default=20, help="verify, profile, host: timed steps per measurement")
    parser.add_argument("--requests", type=int, default=64, help="load: requests queued at once")
    parser.add_argument("--speculate", help="steps (default 2,4,6,8), demo (default 4): comma-separated draft "
                                            "lengths; batch: one (default 2)")
    parser.add_argument("--prompts", type=int, help="demo, batch: only the first N rename prompts (a smoke run)")
    parser.add_argument("--task", choices=sorted(PROMPT_TASKS), default="rename",
                        help="demo: rename (the function quoted, then its renamed copy) or write (its signature and "
                             "docstring only: a body to write)")
    parser.add_argument("--draft-heads", help="demo: the speculating engines draft with these Medusa heads "
                                              "(e.g. weights/demo/medusa) instead of n-gram lookup")
    parser.add_argument("--references", help="steps: cache of the greedy outputs (computed when missing)")
    parser.add_argument("--json", help="also write the numbers to this file")
    return parser


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.what in ("verify", "profile", "host", "load") and not args.model_dir:
        parser.error(f"{args.what} needs --model-dir")
    modes = {"demo": demo, "verify": verify, "profile": profile, "host": host, "load": load, "steps": steps,
             "batch": batch}
    result = modes[args.what](args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
