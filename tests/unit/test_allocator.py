import random

import pytest

from engine.router.allocator import AllocatorError, SlotAllocator


def test_slots_are_allocated_per_token_and_freed_exactly_once():
    alloc = SlotAllocator(num_slots=64, max_requests=4)
    rng = random.Random(0)
    held = {}
    for step in range(400):
        action = rng.random()
        if action < 0.3 and alloc.free_rows and len(held) < 4:
            rid = step
            alloc.open_request(rid)
            held[rid] = []
        elif action < 0.8 and held:
            rid = rng.choice(list(held))
            n = rng.randint(0, min(5, alloc.free_slots))
            held[rid] += alloc.allocate(rid, n)
        elif held:
            rid = rng.choice(list(held))
            assert alloc.release(rid) == len(held.pop(rid))
        alloc.check_integrity()
        all_held = [s for v in held.values() for s in v]
        assert len(all_held) == len(set(all_held)) == alloc.used_slots
    for rid in list(held):
        alloc.release(rid)
    alloc.check_integrity()
    assert alloc.free_slots == 64 and alloc.free_rows == 4


def test_double_release_and_overallocation_are_errors():
    alloc = SlotAllocator(num_slots=4, max_requests=2)
    alloc.open_request("a")
    with pytest.raises(AllocatorError, match="asked for 5 slots, 4 free"):
        alloc.allocate("a", 5)
    alloc.allocate("a", 4)
    alloc.release("a")
    with pytest.raises(AllocatorError, match="released twice"):
        alloc.release("a")
    with pytest.raises(AllocatorError, match="open_request first"):
        alloc.allocate("b", 1)


def test_check_integrity_detects_corruption():
    alloc = SlotAllocator(num_slots=8, max_requests=2)
    alloc.open_request(1)
    slots = alloc.allocate(1, 3)
    alloc._free_slots.append(slots[0])  # simulate a slot freed while still owned
    with pytest.raises(AllocatorError, match="free"):
        alloc.check_integrity()


def test_the_idle_check_wants_every_slot_free_and_no_request_open():
    alloc = SlotAllocator(num_slots=8, max_requests=2)
    alloc.check_idle()
    alloc.open_request(1)
    alloc.allocate(1, 3)
    with pytest.raises(AllocatorError, match="1 requests and 3 slots are held with no request open"):
        alloc.check_idle()
    alloc.release(1)
    alloc.check_idle()
    alloc._free_slots.pop()
    with pytest.raises(AllocatorError, match=r"free 7 \+ cached 0 != capacity 8"):
        alloc.check_idle()


def test_dummy_slot_and_row_sit_past_the_usable_ones():
    alloc = SlotAllocator(num_slots=10, max_requests=3)
    assert alloc.dummy_slot == 10 and alloc.dummy_row == 3
    alloc.open_request(0)
    assert max(alloc.allocate(0, 10)) < 10
