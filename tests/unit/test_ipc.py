import math
import time

import msgpack
import pytest

import subprocess
import sys

from engine.protocol.codec import decode, encode
from engine.protocol.messages import (Abort, Events, GenerationRequest, PrefixSlots, Ready, RouterStatus, RowResult,
                                      SamplingParams, Step, StepResult, StepRow, TokenEvent)


def test_every_message_round_trips():
    messages = [
        GenerationRequest(7, [1, 2, 3], 16, SamplingParams(do_sample=True, top_p=0.5, seed=2**64 - 1), [2]),
        Abort(7),
        Step(rows=[StepRow(1, 0, 0, [5, 6], [10, 11], True, SamplingParams(), 99, [6]),
                   StepRow(2, 1, 4, [9], [12], True, prefix=1)], released=[3, 4],
             prefixes=[PrefixSlots([40, 41, 42]), PrefixSlots([43], base=0, base_len=3)]),
        StepResult([RowResult(1, 5, -0.5, [5, 6], [-0.5, -1.0], [-2.0]), RowResult(2)]),
        Events([TokenEvent(1, 5, -0.25, finish_reason="length", seed=3, prompt_logprobs=[None, -1.5]),
                TokenEvent(2, logprob=-1.0, error="boom")]),
        Ready(0, 1234),
        RouterStatus(True, 1, 2, 3, 4),
    ]
    for message in messages:
        assert decode(encode(message)) == message


def test_int_lists_travel_as_raw_int32_bytes():
    step = Step(rows=[StepRow(1, 0, 0, list(range(1000)), list(range(1000, 2000)), True)])
    raw = msgpack.unpackb(encode(step), raw=False, strict_map_key=False)
    row = raw["rows"][0]
    assert isinstance(row["input_ids"], msgpack.ExtType) and len(row["input_ids"].data) == 4000
    assert len(encode(step)) < 8500


def test_lists_that_are_not_int32_keep_their_values():
    for values in ([True, False], [2**31, 1], [-(2**31) - 1], [1, 2.5], [1, None]):
        raw = msgpack.unpackb(encode(RouterStatus(True, error=values)), raw=False, strict_map_key=False)
        assert raw["error"] == values and [type(v) for v in raw["error"]] == [type(v) for v in values]
    edges = [-(2**31), 2**31 - 1, 0]
    assert isinstance(msgpack.unpackb(encode(Abort(edges)), raw=False)["request_id"], msgpack.ExtType)
    assert decode(encode(Abort(edges))).request_id == edges


def test_nan_logprob_survives():
    event = decode(encode(TokenEvent(1, 2)))
    assert math.isnan(event.logprob)


def test_unknown_message_type_is_rejected():
    with pytest.raises(ValueError, match="unknown message type"):
        decode(msgpack.packb({"~": "Nope"}))


def test_the_messages_the_router_and_the_client_need_load_without_torch():
    modules = ["engine.protocol.messages", "engine.protocol.codec", "engine.router.scheduler", "engine.router.router",
               "engine.router.process", "engine.client"]
    code = f"import sys; import {', '.join(modules)}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_the_router_queues_requests_while_it_waits_for_a_steps_result():
    """``PipeShards.collect`` serves the front end's pipe while the step runs (a burst's requests are queued
    during a long prompt step, not after it); the result is still returned, and the watchdog still fires."""
    import multiprocessing
    import threading
    import time

    from engine.router.process import PipeShards, ShardStalled

    shard_end, router_shard_end = multiprocessing.Pipe()
    front_end, router_front_end = multiprocessing.Pipe()
    shards = PipeShards([router_shard_end])
    seen = []

    def read_inbox(result_ready) -> bool:
        while router_front_end.poll(0) and not result_ready():
            seen.append((decode(router_front_end.recv_bytes()).request_id, router_shard_end.poll(0)))
        return True

    shards.also_read([router_front_end], read_inbox)

    def device():
        for rid in (1, 2, 3):
            front_end.send_bytes(encode(Abort(rid)))
            time.sleep(0.05)
        shard_end.send_bytes(encode(StepResult([RowResult(7, 5)])))

    threading.Thread(target=device).start()
    assert shards.collect(timeout=10) == StepResult([RowResult(7, 5)])
    assert seen == [(1, False), (2, False), (3, False)]           # each handled while no result had come
    start = time.monotonic()
    threading.Timer(0.05, lambda: front_end.send_bytes(encode(Abort(4)))).start()
    with pytest.raises(ShardStalled):
        shards.collect(timeout=0.3)
    assert 0.29 < time.monotonic() - start < 2 and seen[-1] == (4, False)


def test_a_front_end_that_is_gone_is_not_read_again_while_a_result_is_awaited():
    import multiprocessing
    import threading

    from engine.router.process import PipeShards

    shard_end, router_shard_end = multiprocessing.Pipe()
    front_end, router_front_end = multiprocessing.Pipe()
    shards = PipeShards([router_shard_end])
    calls = []

    def read_inbox(result_ready) -> bool:
        calls.append(1)
        return False           # as RouterLoop.read_inbox answers at EOF

    shards.also_read([router_front_end], read_inbox)
    front_end.close()
    threading.Timer(0.1, lambda: shard_end.send_bytes(encode(StepResult([])))).start()
    assert shards.collect(timeout=5) == StepResult([]) and calls == [1]


def test_the_routers_inbox_reading_stops_when_a_steps_result_is_there():
    """``RouterLoop.read_inbox(stop=...)``: while a step's result waits, the rest of a burst is read later."""
    import multiprocessing

    from engine.router.allocator import SlotAllocator
    from engine.router.process import FrontendLinks, RouterLoop
    from engine.router.router import Router
    from engine.router.scheduler import Scheduler, SchedulerConfig

    scheduler = Scheduler(SlotAllocator(64, 4), SchedulerConfig(max_prefill_tokens=8, max_seq_len=32))
    front_end, router_front_end = multiprocessing.Pipe()
    loop = RouterLoop(Router(scheduler, shards=None, eos_token_ids=(0,)), FrontendLinks([router_front_end]))
    for rid in (1, 2, 3):
        front_end.send_bytes(encode(GenerationRequest(rid, [5, 6, 7], 2)))
    assert loop.read_inbox(0, stop=lambda: len(scheduler.waiting) >= 1)
    assert [r.request_id for r in scheduler.waiting] == [1]
    assert loop.read_inbox(0) and [r.request_id for r in scheduler.waiting] == [1, 2, 3]
    front_end.close()
    assert not loop.read_inbox(0)                      # the front end is gone


def test_a_shard_answers_each_step_and_logs_its_decode_launch_and_result_times(caplog):
    import logging
    import multiprocessing
    import threading

    from engine.protocol.messages import Shutdown
    from engine.worker.process import serve_steps

    class Done:
        def __init__(self, result):
            self._result = result

        def ready(self):
            return True

        def result(self):
            return self._result

    class EchoWorker:
        def launch(self, step, meanwhile=None):
            return Done(StepResult([RowResult(r.request_id, 5) for r in step.rows]))

    router_end, shard_end = multiprocessing.Pipe()
    with caplog.at_level(logging.DEBUG, logger="engine.worker"):
        shard = threading.Thread(target=serve_steps, args=(EchoWorker(), shard_end, True))
        shard.start()
        router_end.send_bytes(encode(Step(rows=[StepRow(1, 0, 0, [5, 6], [10, 11], True)])))
        assert decode(router_end.recv_bytes()) == StepResult([RowResult(1, 5)])
        router_end.send_bytes(encode(Shutdown()))
        shard.join(5)
    assert not shard.is_alive()
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.worker"]
    assert any(line.startswith("shard step of 1 rows (") and "decoded in" in line and "launched in" in line
               for line in lines)
    assert any(line.startswith("shard step result of 1 rows: ready and sent after") for line in lines)


def test_a_shard_sends_a_result_as_soon_as_its_step_is_done_while_it_launches_the_next():
    """The previous step finishes on the device while the next one is being launched (a launch that takes
    longer than that step ran): its result goes out from between the launch's pieces, not after the launch."""
    import multiprocessing
    import threading

    from engine.protocol.messages import Shutdown
    from engine.worker.process import serve_steps

    router_end, shard_end = multiprocessing.Pipe()

    class Handle:
        def __init__(self, token):
            self.token, self.done = token, False

        def ready(self):
            return self.done

        def result(self):
            return StepResult([RowResult(1, self.token)])

    class SlowLaunches:
        def __init__(self):
            self.handles, self.sent_during = [], []

        def launch(self, step, meanwhile=None):
            if self.handles:
                meanwhile()                                     # a piece queued; the previous step still runs
                nothing_yet = not router_end.poll(0.2)
                self.handles[-1].done = True
                meanwhile()                                     # the next piece: it has finished
                arrived = router_end.poll(5) and decode(router_end.recv_bytes()).rows[0].token_id
                meanwhile()                                     # already sent: not again
                self.sent_during.append((nothing_yet, arrived))
            self.handles.append(Handle(10 + len(self.handles)))
            return self.handles[-1]

    worker = SlowLaunches()
    shard = threading.Thread(target=serve_steps, args=(worker, shard_end, True))
    shard.start()
    row = StepRow(1, 0, 0, [5], [10], True)
    for _ in range(3):
        router_end.send_bytes(encode(Step(rows=[row])))
        time.sleep(0.05)                        # each Step arrives while the one before is still running
    deadline = time.monotonic() + 5
    while len(worker.handles) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.handles[-1].done = True
    last = decode(router_end.recv_bytes()).rows[0].token_id
    router_end.send_bytes(encode(Shutdown()))
    shard.join(5)
    assert not shard.is_alive() and not router_end.poll(0)
    assert worker.sent_during == [(True, 10), (True, 11)] and last == 12


@pytest.mark.parametrize("slice_s, first_step_sees", [(0.0, 1), (60.0, 40)])
def test_the_router_steps_before_it_has_read_a_whole_burst(monkeypatch, slice_s, first_step_sees):
    """``RouterLoop.run`` reads its inbox for ``INBOX_SLICE_S`` at most once it has work, then steps: the first
    request of a burst starts while the rest are still in the pipe. A slice longer than the burst reads it all."""
    import multiprocessing

    from engine.router import process
    from engine.router.allocator import SlotAllocator
    from engine.router.router import Router
    from engine.router.scheduler import Scheduler, SchedulerConfig

    class FirstStep(Exception):
        pass

    class Shards:
        def submit(self, step):
            raise FirstStep(len(scheduler.waiting) + len(scheduler.running), len(step.rows))

    monkeypatch.setattr(process, "INBOX_SLICE_S", slice_s)
    scheduler = Scheduler(SlotAllocator(4096, 64), SchedulerConfig(max_prefill_tokens=512, max_seq_len=32))
    front_end, router_front_end = multiprocessing.Pipe()
    for rid in range(1, 41):
        front_end.send_bytes(encode(GenerationRequest(rid, [5, 6, 7], 2)))
    loop = process.RouterLoop(Router(scheduler, Shards(), eos_token_ids=(0,)), process.FrontendLinks([router_front_end]))
    with pytest.raises(FirstStep) as first:
        loop.run()
    assert first.value.args == (first_step_sees, first_step_sees)      # requests read, and all in the first step
