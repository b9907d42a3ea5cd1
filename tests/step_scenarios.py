"""Step sequences driven straight into a ``ModelWorker`` (prompt chunks, decode rows, prompt logprobs), and the
comparison of two workers' results over them."""
import torch

from engine.protocol.messages import FED_BACK, SamplingParams, Step, StepRow
from engine.worker.model_worker import ModelWorker


class Requests:
    """Requests with rows and slots of their own, stepping through prompt chunks and decode rows."""

    def __init__(self):
        self.next_slot, self.pos, self.rows = 0, {}, {}

    def _slots(self, n: int) -> list[int]:
        self.next_slot += n
        return list(range(self.next_slot - n, self.next_slot))

    def chunk(self, rid: int, tokens: list[int], sample: bool, **extra) -> StepRow:
        """The next chunk of request ``rid``'s prompt (its first one opens it)."""
        first = rid not in self.pos
        self.rows.setdefault(rid, len(self.rows))
        start = self.pos.get(rid, 0)
        self.pos[rid] = start + len(tokens)
        return StepRow(rid, self.rows[rid], start, tokens, self._slots(len(tokens)), sample=sample,
                       params=SamplingParams(top_n_tokens=2) if first else None, **extra)

    def decode(self, rid: int) -> StepRow:
        self.pos[rid] += 1
        return StepRow(rid, self.rows[rid], self.pos[rid] - 1, [FED_BACK], self._slots(1), sample=True)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def scenario() -> list[Step]:
    """Ragged prompts, decode rows beside prompt chunks (FED_BACK ids inside the padded step), a chunk that
    samples, a step of exactly a bucket's tokens, prompt logprobs, and a step too large for the buckets."""
    r = Requests()
    steps = [Step([r.chunk(0, prompt(5, 0), True), r.chunk(1, prompt(9, 1), True)]),
             Step([r.decode(0), r.decode(1), r.chunk(2, prompt(7, 2), False)]),
             Step([r.decode(0), r.decode(1), r.chunk(2, prompt(4, 3), True), r.chunk(3, prompt(3, 4), True)]),
             Step([r.decode(0), r.decode(1), r.decode(2), r.decode(3), r.chunk(4, prompt(12, 5), True)]),
             Step([r.decode(i) for i in range(5)] + [r.chunk(5, prompt(20, 6), True,
                                                             logprob_targets=prompt(19, 7) + [0])]),
             Step([r.decode(i) for i in range(6)] + [r.chunk(6, prompt(70, 8), True)])]
    return steps + [Step([r.decode(i) for i in range(7)]) for _ in range(3)]


def run_steps(worker: ModelWorker, steps: list[Step]) -> list[list[tuple]]:
    out = []
    for step in steps:
        result = worker.execute(step)
        out.append([(r.token_id, r.logprob, r.top_ids, r.top_logprobs, r.prompt_logprobs) for r in result.rows])
    return out


def run_pipelined(worker: ModelWorker, steps: list[Step]) -> tuple[list[list[tuple]], list[int]]:
    """``run_steps``' rows, each step launched before the previous one's result is taken; that result taken
    between the pieces of the next launch once it is ready, as the shard process does
    (``engine.worker.process``), else after it. And per step, how often the launch called back."""
    results, calls, previous = [], [], None

    def meanwhile():
        nonlocal previous
        calls[-1] += 1
        if previous is not None and previous.ready():
            results.append(previous.result())
            previous = None

    for step in steps:
        calls.append(0)
        launched = worker.launch(step, meanwhile=meanwhile)
        if previous is not None:
            results.append(previous.result())
        previous = launched
    results.append(previous.result())
    rows = [[(r.token_id, r.logprob, r.top_ids, r.top_logprobs, r.prompt_logprobs) for r in res.rows] for res in results]
    return rows, calls


def assert_same(a: list[list[tuple]], b: list[list[tuple]], tol: float) -> None:
    """Equal tokens and top ids, logprobs within ``tol``."""
    for step_a, step_b in zip(a, b, strict=True):
        for (tok_a, lp_a, top_a, tlp_a, plp_a), (tok_b, lp_b, top_b, tlp_b, plp_b) in zip(step_a, step_b, strict=True):
            assert tok_a == tok_b and top_a == top_b
            if lp_a is not None:
                assert abs(lp_a - lp_b) < tol
                assert max(abs(x - y) for x, y in zip(tlp_a, tlp_b, strict=True)) < tol
            assert (plp_a is None) == (plp_b is None)
            if plp_a is not None:
                assert max(abs(x - y) for x, y in zip(plp_a, plp_b, strict=True)) < tol
