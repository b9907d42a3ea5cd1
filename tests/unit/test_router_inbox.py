"""The router's inbox: the front end's pipe drained by a thread of its own while the router steps."""
import multiprocessing
import threading

from engine.protocol.codec import encode
from engine.protocol.messages import Abort, GenerationRequest, SamplingParams
from engine.router.process import Inbox


def long_prompt(request_id: int) -> GenerationRequest:
    return GenerationRequest(request_id=request_id, prompt_ids=list(range(3, 3003)), max_new_tokens=4,
                             params=SamplingParams())


def test_a_burst_larger_than_the_pipe_is_all_there_after_one_step():
    """64 prompts of 3,000 tokens (about 0.8 MB, past the pipe's buffer) sent while the router is busy (no
    take): the front end's writer is not held back, and the next take hands over every one, in order."""
    router_end, frontend_end = multiprocessing.Pipe()
    inbox = Inbox(router_end)
    writer = threading.Thread(target=lambda: [frontend_end.send_bytes(encode(long_prompt(i))) for i in range(64)])
    writer.start()
    writer.join(timeout=30)
    assert not writer.is_alive()
    messages = inbox.take(timeout=0)
    while len(messages) < 64:                       # the last few may still be in the reader's hands
        messages += inbox.take(timeout=1)
    assert [m.request_id for m in messages] == list(range(64))
    assert messages[0].prompt_ids == list(range(3, 3003))
    assert inbox.take(timeout=0) == []


def test_the_messages_before_the_front_end_left_are_handed_over_then_none():
    router_end, frontend_end = multiprocessing.Pipe()
    inbox = Inbox(router_end)
    frontend_end.send_bytes(encode(Abort(7)))
    frontend_end.close()
    assert inbox.take(timeout=5) == [Abort(7)]
    assert inbox.take(timeout=5) is None
    assert inbox.take(timeout=0) is None            # and every take after it
