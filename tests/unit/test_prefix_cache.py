"""The prefix cache's radix tree, and a randomized simulation of the router with it.

The simulation runs the real ``Router`` and ``Scheduler`` against a stand-in worker whose
"KV" in each slot is (position, token, digest of the whole sequence up to it) and whose
next token is a function of the sequence. Every row checks that the slots its
``req_to_token`` row maps hold exactly its sequence, so a slot freed, evicted or reused
too early shows up as a wrong digest; ``check_integrity`` runs after every step.
"""
import random

import pytest

from engine.protocol.messages import FED_BACK, NO_PREFIX, GenerationRequest, RowResult, SamplingParams, Step, StepResult
from engine.router.allocator import AllocatorError, SlotAllocator
from engine.router.prefix_cache import STALE_MARGIN, PrefixCache, common_prefix_length
from engine.router.router import LocalShards, Router
from engine.router.scheduler import PrefixTable, Request, Scheduler, SchedulerConfig


def make_cache(num_slots=64):
    alloc = SlotAllocator(num_slots, 4)
    return alloc, PrefixCache(alloc)


def cache_tokens(alloc, cache, rid, tokens):
    """A request computes ``tokens`` and caches them; returns the leaf."""
    alloc.open_request(rid)
    slots = alloc.allocate(rid, len(tokens))
    node = cache.insert(tokens, slots)
    alloc.release(rid)
    return node, slots


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([5] * 100 + [1], [5] * 100 + [2]) == 100
    rng = random.Random(0)                # lists that part anywhere: in, at and past the compare chunks' ends
    for n in (255, 256, 257, 3042):
        for cut in (0, 1, 255, 256, 257, n - 1):
            if cut < n:
                a = [rng.randrange(9) for _ in range(n)]
                b = a[:cut] + [a[cut] + 1] + a[cut + 1 :] + [4]
                assert common_prefix_length(a, b) == cut and common_prefix_length(b, a) == cut


def test_match_splits_where_a_prefix_ends_inside_a_node_and_keeps_the_slots():
    alloc, cache = make_cache()
    _, slots = cache_tokens(alloc, cache, "a", [1, 2, 3, 4, 5])
    assert alloc.used_slots == 0 and alloc.cached_slots == 5 and cache.evictable_slots == 5
    match = cache.match([1, 2, 3, 9])
    assert match.length == 3 and match.slots == slots[:3]
    node = cache.lock(match)                      # split after 3 tokens, upper part locked
    assert node.key == [1, 2, 3] and node.lock_count == 1
    assert [c.key for c in node.children.values()] == [[4, 5]]
    assert cache.evictable_slots == 2
    alloc.check_integrity()
    cache.unlock_node(node)
    assert cache.evictable_slots == 5
    with pytest.raises(AssertionError, match="unlocked more often"):
        cache.unlock_node(node)


def test_insert_keeps_the_trees_slots_and_caches_only_the_new_tail():
    alloc, cache = make_cache()
    _, first = cache_tokens(alloc, cache, "a", [1, 2, 3])
    alloc.open_request("b")
    own = alloc.allocate("b", 5)
    leaf = cache.insert([1, 2, 3, 7, 8], own)
    assert leaf.key == [7, 8] and leaf.slots == own[3:]
    assert cache.match([1, 2, 3, 7, 8]).slots == first + own[3:]
    alloc.release("b")                      # its copies of 1, 2, 3 are freed, 7 and 8 stay cached
    assert alloc.free_slots == 64 - 5 and alloc.cached_slots == 5
    alloc.check_integrity()


def test_eviction_is_least_recently_used_leaves_first_and_never_a_locked_node():
    alloc, cache = make_cache(num_slots=12)
    cache_tokens(alloc, cache, "a", [1, 2, 3, 4])
    locked = cache.lock(cache.match([1]))          # lock the shared first token
    cache_tokens(alloc, cache, "b", [1, 9, 9, 9])
    cache_tokens(alloc, cache, "c", [6, 6, 6, 6])
    assert alloc.free_slots == 12 - 11     # b's copy of token 1 was freed
    alloc.open_request("d")
    alloc.allocate("d", 4)                 # needs 3 more: evicts [2, 3, 4], the oldest unlocked leaf
    assert cache.match([1, 2]).length == 1 and cache.match([1, 9, 9, 9]).length == 4
    assert cache.stats.evicted_tokens == 3
    alloc.allocate("d", 5)                 # everything unlocked goes; the locked token 1 stays
    assert cache.match([1]).length == 1 and cache.cached_slots == 1 and locked.lock_count == 1
    alloc.check_integrity()
    with pytest.raises(AllocatorError, match="asked for 3 slots, 2 free"):
        alloc.allocate("d", 3)


def eviction_order(cache):
    """Evict leaf after leaf (``evict(1)`` takes one), checking integrity after each; returns their keys."""
    order = []
    while cache.evictable_slots:
        before = set(cache.nodes())
        cache.evict(1)
        order += [node.key for node in before - set(cache.nodes())]
        assert not cache.check_integrity(cache.allocator.is_cached)
    return order


def test_a_parent_left_without_children_is_evicted_at_its_own_last_use():
    """Eviction order across a split, a lock, a new leaf and parents that become leaves mid-evict:
    [1] (split off [1, 2] by [1, 3], then used) goes after [5, 6] but before the newer [7]."""
    alloc, cache = make_cache()
    cache_tokens(alloc, cache, "a", [1, 2])
    cache_tokens(alloc, cache, "b", [1, 3])              # splits [1, 2]: the upper [1] is no leaf
    cache_tokens(alloc, cache, "c", [5, 6])
    cache.unlock_node(cache.lock(cache.match([1])))       # [1] used after [5, 6]
    cache_tokens(alloc, cache, "d", [7])
    assert not cache.check_integrity(alloc.is_cached)
    assert eviction_order(cache) == [[2], [3], [5, 6], [1], [7]]
    assert cache.cached_slots == 0 and alloc.free_slots == 64


class UnwalkableChildren(dict):
    """A node's children that fail any walk over them: evict may look up and delete, not scan."""

    def _walked(self, *args):
        pytest.fail("evict walked the tree")

    __iter__ = keys = values = items = _walked


def test_evict_touches_only_the_leaves_it_evicts_not_the_tree():
    """300 leaves under 30 shared prefixes; evicting 3 leaves' worth reads no node's list of children
    (the walk of the whole tree that took milliseconds a call at 10,000 nodes), and takes the 3 least recently used."""
    alloc, cache = make_cache(num_slots=2000)
    for i in range(300):
        cache_tokens(alloc, cache, i, [1000 + i % 30, 2000 + i % 30, 3000 + i, 4000 + i])
    for i in (0, 2, 4):                                   # the oldest leaves used again: 1, 3, 5 go first
        cache.unlock_node(cache.lock(cache.match([1000 + i % 30, 2000 + i % 30, 3000 + i, 4000 + i])))
    nodes = list(cache.nodes())
    for node in [cache.root] + nodes:
        node.children = UnwalkableChildren(node.children)
    assert cache.evict(5) == 6
    for node in [cache.root] + nodes:
        node.children = dict(dict.items(node.children))
    lengths = [cache.match([1000 + i, 2000 + i, 3000 + i]).length for i in range(7)]
    assert lengths == [3, 2, 3, 2, 3, 2, 3]          # 1, 3, 5 lost their leaves
    assert not cache.check_integrity(alloc.is_cached)


def test_integrity_checks_the_evictable_leaves_and_the_heap_keeps_few_stale_entries():
    """``check_integrity`` catches an unlocked leaf missing from the eviction heap, a locked node on it and
    a stale ``last_used`` or a heap out of order; 1,000 lock/unlock cycles with no eviction leave the heap O(leaves)."""
    alloc, cache = make_cache()
    leaf, _ = cache_tokens(alloc, cache, "a", [1, 2, 3])
    cache_tokens(alloc, cache, "b", [4])
    for _ in range(1000):
        cache.unlock_node(cache.lock(cache.match([1, 2, 3])))
    assert len(cache._lru) <= 2 * 2 + STALE_MARGIN and not cache.check_integrity(alloc.is_cached)
    entry = cache._evictable.pop(leaf)
    assert any("not listed as evictable" in p for p in cache.check_integrity(alloc.is_cached))
    cache._evictable[leaf] = entry
    locked = cache.lock(cache.match([4]))
    cache._evictable[locked] = (locked.last_used, -1, locked)
    assert any("listed nodes are not unlocked leaves" in p for p in cache.check_integrity(alloc.is_cached))
    del cache._evictable[locked]
    leaf.last_used += 1000
    assert any("no longer has" in p for p in cache.check_integrity(alloc.is_cached))
    leaf.last_used -= 1000
    cache._lru.reverse()
    assert cache.check_integrity(alloc.is_cached) == ["the eviction heap is out of order"]


def test_integrity_catches_a_cached_slot_that_is_also_free():
    alloc, cache = make_cache()
    _, slots = cache_tokens(alloc, cache, "a", [1, 2, 3])
    alloc._free_slots.append(slots[0])
    with pytest.raises(AllocatorError, match="free"):
        alloc.check_integrity()


def test_borrowed_prefix_slots_stay_cached_count_once_and_are_checked():
    """Requests given a cached prefix (``share``) borrow its slots under their lock: releasing them frees
    none of those, used_slots counts them once however many requests map them, a truncate into them is
    refused, and a borrowed slot the tree no longer holds is caught."""
    alloc, cache = make_cache()
    _, slots = cache_tokens(alloc, cache, "a", [1, 2, 3, 4])
    locks = {}
    for rid in ("b", "c"):
        match = cache.match([1, 2, 3, 4, 9])
        locks[rid] = cache.lock(match)
        alloc.open_request(rid)
        alloc.share(rid, match.slots)
        alloc.allocate(rid, 1)
    assert alloc.slots("b")[:4] == slots and alloc.used_slots == 4 + 2 and alloc.free_slots == 64 - 6
    alloc.check_integrity()
    with pytest.raises(AllocatorError, match="4 borrowed"):
        alloc.truncate("b", 3)
    alloc.release("b")
    cache.unlock_node(locks.pop("b"))
    assert alloc.used_slots == 4 + 1 and alloc.free_slots == 64 - 5 and all(map(alloc.is_cached, slots))
    alloc.check_integrity()
    alloc.uncache_slots(slots[:1])          # the tree let go of a slot "c" still borrows (a broken lock)
    with pytest.raises(AllocatorError, match="borrows a slot the prefix cache does not hold"):
        alloc.check_integrity()


# ---- the randomized simulation -------------------------------------------------------

VOCAB = 5


def digest(previous: int, position: int, token: int) -> int:
    return hash((previous, position, token))


class FakeStep:
    def __init__(self, result):
        self._result = result

    def result(self):
        return self._result


class FakeWorker:
    """Keeps req_to_token and per-slot (position, token, digest); checks every row's context."""

    def __init__(self, num_slots, max_requests):
        self.table = [[None] * 512 for _ in range(max_requests + 1)]
        self.kv = [None] * (num_slots + 1)
        self.last_tokens = [0] * (max_requests + 1)
        self.prefill_tokens = 0

    def launch(self, step):
        results = []
        for r in step.rows:
            if r.prefix != NO_PREFIX:
                self.table[r.row][: r.start_pos] = step.prefix_slots(r.prefix, r.start_pos)
            chain = self._context_digest(r.row, r.start_pos)
            inputs = [self.last_tokens[r.row] if t == FED_BACK else t for t in r.input_ids]
            if r.input_ids[0] != FED_BACK:
                self.prefill_tokens += len(inputs)
            for i, (token, slot) in enumerate(zip(inputs, r.slots)):
                position = r.start_pos + i
                chain = digest(chain, position, token)
                self.table[r.row][position] = slot
                self.kv[slot] = (position, token, chain)
            result = RowResult(r.request_id, logprob=-1.0)
            if r.sample:
                result.token_id = chain % VOCAB
                self.last_tokens[r.row] = result.token_id
            results.append(result)
        return FakeStep(StepResult(results))

    def _context_digest(self, row, length):
        chain = 0
        for position in range(length):
            entry = self.kv[self.table[row][position]]
            assert entry is not None and entry[0] == position, "a row maps a slot with no KV for its position"
            expected = digest(chain, position, entry[1])
            assert entry[2] == expected, "a row maps a slot whose KV belongs to another sequence"
            chain = expected
        return chain


def expected_tokens(prompt, n):
    """What the fake model generates for ``prompt`` (a function of the sequence alone)."""
    chain, out, seq = 0, [], list(prompt)
    for position, token in enumerate(seq):
        chain = digest(chain, position, token)
    for _ in range(n):
        token = chain % VOCAB
        out.append(token)
        chain = digest(chain, len(prompt) + len(out) - 1, token)
    return out


class Simulation:
    def __init__(self, seed, num_slots, caching=True, max_requests=8, budget=24, multi_turn=True):
        self.multi_turn = multi_turn
        self.rng = random.Random(seed)
        self.worker = FakeWorker(num_slots, max_requests)
        self.alloc = SlotAllocator(num_slots, max_requests)
        config = SchedulerConfig(max_prefill_tokens=budget, max_seq_len=num_slots, prefix_caching=caching)
        self.scheduler = Scheduler(self.alloc, config)
        self.router = Router(self.scheduler, LocalShards(self.worker), eos_token_ids=())
        self.outputs: dict[int, list[int]] = {}
        self.finished: set[int] = set()
        self.aborted: set[int] = set()
        self.prompts: dict[int, list[int]] = {}
        self.next_id = 0
        self.bases = [[self.rng.randrange(VOCAB) for _ in range(self.rng.randint(5, 40))] for _ in range(4)]

    def new_prompt(self):
        done = [rid for rid in self.finished if rid not in self.aborted]
        if self.multi_turn and done and self.rng.random() < 0.3:          # a next turn: last prompt + its answer + more
            rid = self.rng.choice(done)
            base = self.prompts[rid] + self.outputs[rid]
        else:
            base = self.rng.choice(self.bases)
            base = base[: self.rng.randint(1, len(base))]      # a prefix ending anywhere
        return (base + [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(0, 12))])[:100] or [1]

    def submit(self, **params):
        prompt = self.new_prompt()
        rid, self.next_id = self.next_id, self.next_id + 1
        self.prompts[rid], self.outputs[rid] = prompt, []
        self.router.submit(GenerationRequest(rid, prompt, self.rng.randint(1, 20), SamplingParams(**params),
                                             stop_token_ids=[]))

    def run(self, steps, abort_rate=0.03):
        for _ in range(steps):
            if self.rng.random() < 0.4:
                self.submit(repetition_penalty=1.2 if self.rng.random() < 0.1 else 1.0,
                            prompt_logprobs=self.rng.random() < 0.05)
            if self.rng.random() < abort_rate and self.scheduler.running:
                victim = self.rng.choice(self.scheduler.running).request_id
                self.router.abort(victim)
                self.aborted.add(victim)
                self.finished.add(victim)
            self.step()
        while self.router.has_work():
            self.step()

    def step(self):
        for event in self.router.step():
            self.outputs[event.request_id].append(event.token_id)
            if event.finish_reason:
                self.finished.add(event.request_id)
        self.scheduler.check_integrity()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_traffic_with_eviction_keeps_every_slot_and_every_token_right(seed):
    sim = Simulation(seed, num_slots=160)
    sim.run(1500)
    for rid, prompt in sim.prompts.items():
        expected = expected_tokens(prompt, len(sim.outputs[rid]))
        assert sim.outputs[rid] == expected, f"request {rid} generated wrong tokens"
        if rid not in sim.aborted:
            assert rid in sim.finished
    cache = sim.scheduler.cache
    assert cache.stats.hit_tokens > 0.2 * cache.stats.lookup_tokens
    assert cache.stats.evicted_tokens > 0
    assert sim.alloc.used_slots == 0
    sim.scheduler.check_idle()                   # the router's check when it goes idle agrees
    cache.evict(sim.alloc.num_slots)
    assert sim.alloc.free_slots == sim.alloc.num_slots
    sim.alloc.check_integrity()


def test_the_cache_saves_prefill_and_changes_no_token():
    runs = {}
    for caching in (True, False):
        sim = Simulation(5, num_slots=400, caching=caching, multi_turn=False)   # the same prompts in both runs
        sim.run(600, abort_rate=0.0)
        runs[caching] = sim
    assert runs[True].outputs == runs[False].outputs
    assert runs[True].worker.prefill_tokens < 0.7 * runs[False].worker.prefill_tokens


def test_a_repeated_prompt_prefills_only_its_last_token_and_a_twin_waits_for_the_first():
    alloc = SlotAllocator(2000, 8)
    scheduler = Scheduler(alloc, SchedulerConfig(max_prefill_tokens=256, max_seq_len=2000))
    worker = FakeWorker(2000, 8)
    router = Router(scheduler, LocalShards(worker), eos_token_ids=())
    shared = list(range(1, 301))
    for rid in range(4):      # arrive together: 0 is prefilled alone, the others take its prompt
        router.submit(GenerationRequest(rid, shared + [rid], 4, stop_token_ids=[]))
    rows = []
    while router.has_work():
        step = scheduler.schedule()
        rows += [(r.request_id, len(r.input_ids), r.start_pos) for r in step.rows if r.input_ids[0] != FED_BACK]
        scheduler.process(step, worker.launch(step).result())
        scheduler.check_integrity()
    assert [r for r in rows if r[0] == 0] == [(0, 256, 0), (0, 45, 256)]
    assert sorted(r for r in rows if r[0] != 0) == [(1, 1, 300), (2, 1, 300), (3, 1, 300)]
    router.submit(GenerationRequest(9, shared + [0], 4, stop_token_ids=[]))    # the same prompt as 0
    step = scheduler.schedule()
    assert [(r.request_id, r.input_ids, r.start_pos, r.prefix) for r in step.rows] == [(9, [0], 300, 0)]
    assert len(step.prefixes) == 1 and len(step.prefixes[0].slots) == 300


def test_a_burst_behind_one_cached_prefix_carries_its_slots_once_a_step():
    """Every first row of a burst maps the same cached slots: the step carries them once (not one copy a
    row: 1.3 MB a step for 100 rows behind 3,000 tokens). Each row's first ``start_pos`` slots are exactly
    its own."""
    alloc = SlotAllocator(4000, 16)
    scheduler = Scheduler(alloc, SchedulerConfig(max_prefill_tokens=4096, max_seq_len=2000))
    worker = FakeWorker(4000, 16)
    router = Router(scheduler, LocalShards(worker), eos_token_ids=())
    shared = list(range(1, 301))
    router.submit(GenerationRequest(0, shared + [7, 8], 1, stop_token_ids=[]))
    while router.has_work():
        router.step()
    tails = {1: [7, 9], 2: [5], 3: [6, 1], 4: [7, 2], 5: [4]}          # 1 and 4 match 301 tokens, the rest 300
    for rid, tail in tails.items():
        router.submit(GenerationRequest(rid, shared + tail, 1, stop_token_ids=[]))
    step = scheduler.schedule()
    firsts = {r.request_id: r for r in step.rows if r.start_pos > 0}
    assert {rid: r.start_pos for rid, r in firsts.items()} == {1: 301, 2: 300, 3: 300, 4: 301, 5: 300}
    # 2 and 5 go first (the shorter prompts) and map 300 slots, sent whole; 1 and 4 each add their 301st
    assert [len(p.slots) for p in step.prefixes] == [300, 1, 1]
    for rid, r in firsts.items():
        assert step.prefix_slots(r.prefix, r.start_pos) == alloc.slots(rid)[: r.start_pos]
    scheduler.process(step, worker.launch(step).result())       # the stand-in worker checks every row's context
    while router.has_work():
        router.step()
    scheduler.check_integrity()


def test_a_steps_prefix_table_sends_each_slot_once_and_resolves_every_prefix():
    table = PrefixTable()
    rows = {"a": ([5, 6, 7, 8], 3), "b": ([5, 6, 7, 9], 2), "c": ([5, 6, 7, 9], 4), "d": ([9, 6], 2),
            "e": ([5, 1, 2], 3), "f": ([5, 6, 7, 8], 4)}
    index = {name: table.index(slots, length) for name, (slots, length) in rows.items()}
    step = Step(rows=[], prefixes=table.lists)
    assert index["a"] == index["b"] == 0 and len({index[n] for n in "acdef"}) == 5
    assert [(p.slots, p.base, p.base_len) for p in table.lists] == [
        ([5, 6, 7], NO_PREFIX, 0), ([9], 0, 3), ([9, 6], NO_PREFIX, 0), ([1, 2], 0, 1), ([8], 0, 3)]
    for name, (slots, length) in rows.items():
        assert step.prefix_slots(index[name], length) == slots[:length], name
    assert step.prefix_segments(index["c"], 4) == [(0, 0, 3), (1, 3, 4)]
    assert step.prefix_segments(index["c"], 2) == [(0, 0, 2)]


def test_waiting_prompts_fill_a_step_only_with_the_tokens_their_cached_prefixes_lack():
    alloc = SlotAllocator(2000, 8)
    scheduler = Scheduler(alloc, SchedulerConfig(max_prefill_tokens=8, max_seq_len=2000))
    router = Router(scheduler, LocalShards(FakeWorker(2000, 8)), eos_token_ids=())
    shared = list(range(1, 301))
    router.submit(GenerationRequest(0, shared + [7], 1, stop_token_ids=[]))
    while router.has_work():
        router.step()
    for rid in (1, 2, 3):              # 300 cached tokens each, 1 to prefill
        scheduler.add(Request(request_id=rid, prompt_ids=shared + [rid], max_new_tokens=1, params=SamplingParams(), seed=0))
    assert not scheduler.waiting_fills_a_step()
    scheduler.add(Request(request_id=4, prompt_ids=list(range(500, 506)), max_new_tokens=1, params=SamplingParams(), seed=0))
    matched = []
    scheduler.cache.match = lambda tokens, match=scheduler.cache.match: matched.append(len(tokens)) or match(tokens)
    assert scheduler.waiting_fills_a_step()          # 3 + 6 >= 8
    assert scheduler.waiting_fills_a_step()
    assert matched == [5]       # only the newcomer was matched, once: the others' counts were kept


def test_extend_adds_below_a_known_node_without_comparing_its_tokens_again(monkeypatch):
    """A request's prompt (and later its answer) goes in below its lock node, which ends the tokens the
    tree already holds: no compare of those (3,000 of them behind a system prompt) when no child goes on
    with the next token; None (the caller inserts from the root) when one does."""
    alloc, cache = make_cache()
    shared, _ = cache_tokens(alloc, cache, "a", [1, 2, 3, 4])
    alloc.open_request("b")
    alloc.share("b", list(shared.slots))
    cache.lock_node(shared)
    slots = alloc.slots("b")[:4] + alloc.allocate("b", 3)
    import engine.router.prefix_cache as prefix_cache
    monkeypatch.setattr(prefix_cache, "common_prefix_length", lambda a, b: pytest.fail("compared again"))
    leaf = cache.extend(shared, 4, [1, 2, 3, 4, 7, 8, 9], slots)
    assert leaf.parent is shared and leaf.key == [7, 8, 9] and leaf.slots == slots[4:]
    assert cache.extend(shared, 4, [1, 2, 3, 4, 7, 5], slots[:6]) is None      # a child goes on with 7
    assert cache.extend(leaf, 7, [1, 2, 3, 4, 7, 8, 9], slots) is leaf          # nothing left to add
    monkeypatch.undo()
    cache.unlock_node(shared)
    alloc.release("b")
    assert cache.match([1, 2, 3, 4, 7, 8, 9]).length == 7 and alloc.cached_slots == 7
    alloc.check_integrity()
    with pytest.raises(ValueError):
        cache.extend(shared, 4, [1, 2, 3, 4, 5], slots)


def test_admission_counts_a_shared_prefix_once():
    alloc = SlotAllocator(1000, 16)
    scheduler = Scheduler(alloc, SchedulerConfig(max_prefill_tokens=4096, max_seq_len=1000))
    worker = FakeWorker(1000, 16)
    shared = list(range(1, 401))
    def request(rid):
        return Request(rid, shared + [rid % 5, rid], 20, SamplingParams(), seed=0)
    scheduler.add(request(0))
    step = scheduler.schedule()
    scheduler.process(step, worker.launch(step).result())
    for rid in range(1, 12):          # each adds 2 prompt tokens + 20 new ones: all fit beside 0
        scheduler.add(request(rid))
    scheduler.schedule()
    assert len(scheduler.running) == 12 and not scheduler.waiting
    uncached = Scheduler(SlotAllocator(1000, 16), SchedulerConfig(max_seq_len=1000, prefix_caching=False))
    for rid in range(12):
        uncached.add(request(rid))
    uncached.schedule()
    assert len(uncached.running) == 2      # without the cache each needs 422 slots


def test_the_idle_check_catches_a_leak_a_double_free_and_a_lock_left_behind():
    """``Scheduler.check_idle`` (the router's, each time it goes idle): the counts alone, after real traffic."""
    def drained():
        sim = Simulation(3, num_slots=160)
        sim.run(200)
        sim.scheduler.check_idle()
        assert sim.scheduler.cache.cached_slots > 0
        return sim
    sim = drained()
    sim.alloc._free_slots.pop()                                    # a slot neither free nor cached
    with pytest.raises(AllocatorError, match="a slot leaked or was freed twice"):
        sim.scheduler.check_idle()
    sim = drained()
    sim.alloc._free_slots.append(sim.alloc._free_slots[0])          # freed twice
    with pytest.raises(AllocatorError, match="a slot leaked or was freed twice"):
        sim.scheduler.check_idle()
    sim = drained()
    sim.scheduler.cache.lock_node(next(sim.scheduler.cache.nodes()))   # a lock nobody will release
    with pytest.raises(AllocatorError, match="stay locked with no request running"):
        sim.scheduler.check_idle()
    sim = drained()
    sim.alloc._cached[sim.alloc._free_slots[-1]] = 1               # a mark the tree does not hold
    with pytest.raises(AllocatorError, match="marked cached but the tree holds"):
        sim.scheduler.check_idle()
    sim.submit()
    with pytest.raises(RuntimeError, match="use check_integrity"):
        sim.scheduler.check_idle()


def test_the_router_loop_checks_the_counts_once_each_time_it_goes_idle(monkeypatch):
    """``RouterLoop.run``: after its work drains it runs ``check_idle`` once (not the whole ``check_integrity``,
    which a request arriving meanwhile would wait for), and not again while it stays idle."""
    import multiprocessing
    import threading
    import time

    from engine.protocol.codec import encode
    from engine.router.process import FrontendLinks, RouterLoop

    sim = Simulation(4, num_slots=160)
    sim.router.shards.check_idle = lambda: None          # LocalShards: no processes to watch
    checks = []
    monkeypatch.setattr(sim.scheduler, "check_idle", lambda: checks.append("idle"))
    monkeypatch.setattr(sim.scheduler, "check_integrity", lambda: checks.append("whole"))
    front_end, router_end = multiprocessing.Pipe()
    loop = RouterLoop(sim.router, FrontendLinks([router_end]))
    running = threading.Thread(target=loop.run, daemon=True)
    running.start()
    front_end.send_bytes(encode(GenerationRequest(1, [5, 6, 7, 8], 4, SamplingParams(), stop_token_ids=[])))
    deadline = time.monotonic() + 10
    while not checks and time.monotonic() < deadline:
        while front_end.poll(0.05):
            front_end.recv_bytes()                       # events and status
    time.sleep(0.6)                                      # idle past two status intervals
    while front_end.poll(0):
        front_end.recv_bytes()
    front_end.close()
    running.join(5)
    assert not running.is_alive() and checks == ["idle"] and not sim.router.has_work()
