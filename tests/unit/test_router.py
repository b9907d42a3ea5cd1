"""The router's per-step numbers (``StepStats``, TGI's tgi_batch_* metrics), with shards that answer a fixed token."""
from __future__ import annotations

from collections import deque

from engine.protocol.messages import (
    GenerationRequest,
    RowResult,
    SamplingParams,
    StepResult,
)
from engine.router.allocator import SlotAllocator
from engine.router.router import Router
from engine.router.scheduler import Scheduler, SchedulerConfig


class FixedTokenShards:
    """Every sampling row answers token 7 (never an EOS here)."""

    def __init__(self):
        self.pending: deque = deque()

    def submit(self, step) -> None:
        self.pending.append(step)

    def collect(self, timeout=None) -> StepResult:
        step = self.pending.popleft()
        return StepResult([RowResult(r.request_id, token_id=7 if r.sample else None, logprob=-1.0) for r in step.rows])


def make_router() -> Router:
    allocator = SlotAllocator(num_slots=256, max_requests=8)
    scheduler = Scheduler(allocator, SchedulerConfig(max_prefill_tokens=8, max_seq_len=256, prefix_caching=False))
    return Router(scheduler, FixedTokenShards(), eos_token_ids=(0,))


def request(rid: int, prompt: int, new: int) -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt_ids=list(range(1, prompt + 1)), max_new_tokens=new,
                             params=SamplingParams())


def run(router: Router, late: GenerationRequest | None = None, join_after: int = 0) -> None:
    steps = 0
    while router.has_work():
        router.step()
        steps += 1
        if late is not None and steps == join_after:
            router.submit(late)


def test_each_collected_step_is_reported_once_with_its_method_and_size():
    router = make_router()
    router.submit(request(1, prompt=20, new=4))
    run(router, late=request(2, prompt=3, new=2), join_after=4)
    stats = router.take_stats()
    assert router.take_stats() == []
    # request 1: 20 prompt tokens in chunks of 8 (3 prefill steps), then decode rows; request 2 joins later
    assert [s.method for s in stats[:3]] == ["prefill"] * 3 and {s.size for s in stats[:3]} == {1}
    joined = [s for s in stats if s.joined]
    assert len(joined) == 1 and joined[0].method == "prefill" and joined[0].size == 2
    assert stats[-1].method == "decode" and all(s.ok for s in stats)
    tokens = sum(s.size for s in stats)
    # request 1: 3 prompt chunks (the last samples its first token) + 3 decode rows; request 2: 1 chunk + 1 decode row
    assert tokens == 3 + 3 + 1 + 1
    for s in stats:
        assert 0 <= s.forward_s <= s.inference_s and 0 <= s.concat_s <= s.inference_s
        assert s.decode_s >= 0 and s.filter_s >= 0


def test_steps_in_flight_when_the_shards_fail_are_reported_failed():
    router = make_router()
    router.submit(request(1, prompt=4, new=8))
    router.step()                      # submitted, not collected (one step in flight)
    router.fail_all("the shard died")
    (failed,) = router.take_stats()
    assert not failed.ok and failed.method == "prefill" and failed.size == 1


class ArrivalDuringStep(FixedTokenShards):
    """Records each submitted step's request ids; while collecting step ``during`` (the device busy with it), a
    request arrives at the router."""

    def __init__(self, during: int, arrival: GenerationRequest):
        super().__init__()
        self.submitted: list[set[int]] = []
        self.during, self.arrival, self.router = during, arrival, None

    def submit(self, step) -> None:
        self.submitted.append({row.request_id for row in step.rows})
        super().submit(step)

    def collect(self, timeout=None) -> StepResult:
        collected = len(self.submitted) - len(self.pending)
        if collected == self.during:
            self.router.submit(self.arrival)
        return super().collect(timeout)


def first_step_with_the_arrival(arrival_window_s: float) -> int:
    allocator = SlotAllocator(num_slots=256, max_requests=8)
    scheduler = Scheduler(allocator, SchedulerConfig(max_prefill_tokens=8, max_seq_len=256, prefix_caching=False))
    shards = ArrivalDuringStep(during=1, arrival=request(2, prompt=3, new=2))
    router = Router(scheduler, shards, eos_token_ids=(0,), arrival_window_s=arrival_window_s)
    shards.router = router
    router.submit(request(1, prompt=40, new=2))     # five prompt steps of 8 tokens
    run(router)
    scheduler.check_integrity()
    assert allocator.used_slots == 0 and allocator.free_rows == 8       # both requests gave everything back
    return next(i for i, ids in enumerate(shards.submitted) if 2 in ids)


def test_a_request_arriving_during_a_prompt_step_joins_the_very_next_step():
    """While requests arrive, a prompt step in flight is collected before the next is planned: a request that
    arrives while the device runs step 1 is in step 2. Always pipelined, step 2 was planned before it came:
    it waits for a later one (here behind the long prompt, whose aged chunks then fill the budget)."""
    assert first_step_with_the_arrival(arrival_window_s=3600.0) == 2
    assert first_step_with_the_arrival(arrival_window_s=0.0) > 2


class InFlightAtSubmit(FixedTokenShards):
    """Records how many steps were in flight (submitted, not collected) when each step was submitted."""

    def __init__(self):
        super().__init__()
        self.in_flight: list[int] = []

    def submit(self, step) -> None:
        self.in_flight.append(len(self.pending))
        super().submit(step)


def steps_in_flight_at_submit(second_prompt: int) -> list[int]:
    allocator = SlotAllocator(num_slots=256, max_requests=8)
    scheduler = Scheduler(allocator, SchedulerConfig(max_prefill_tokens=8, max_seq_len=256, prefix_caching=False))
    shards = InFlightAtSubmit()
    router = Router(scheduler, shards, eos_token_ids=(0,), arrival_window_s=3600.0)    # requests keep "arriving"
    router.submit(request(1, prompt=8, new=1))
    router.submit(request(2, prompt=second_prompt, new=1))
    run(router)
    scheduler.check_integrity()
    assert allocator.used_slots == 0 and allocator.free_rows == 8
    return shards.in_flight


def test_while_requests_arrive_the_next_step_is_planned_early_when_the_waiting_fill_it():
    """Step 1 takes request 1's 8 prompt tokens (the budget). Request 2's 8 tokens fill step 2 alone: nothing
    arriving could join it, so it is planned while step 1 runs. With 3 tokens waiting, step 1 is collected
    first (an arrival could still join step 2)."""
    assert steps_in_flight_at_submit(second_prompt=8)[:2] == [0, 1]
    assert steps_in_flight_at_submit(second_prompt=3)[:2] == [0, 0]


def test_the_debug_log_has_a_line_for_each_step_planned_and_collected(caplog):
    """``--log-level debug``: what each step carried and how long its planning, hand-over and device took."""
    import logging

    router = make_router()
    router.submit(request(1, prompt=12, new=2))
    with caplog.at_level(logging.DEBUG, logger="engine.router.router"):
        run(router)
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.router.router"]
    assert lines[0].startswith("step 1: 1 rows (8 prompt tokens in 1 prompt rows, 1 new requests), 0 waiting; "
                               "planned in ")
    assert any(line.startswith("step 2: 1 rows (4 prompt tokens in 1 prompt rows, 0 new requests)") for line in lines)
    collected = [line for line in lines if " collected " in line]
    assert [line.split()[1] for line in collected] == [str(i) for i in range(1, len(collected) + 1)]
