"""The router's shared-prefix groups (cascade attention): who shares which prefix's slots."""
import pytest

from engine.protocol.messages import FED_BACK, StepRow
from engine.router.shared_prefix import (
    MIN_GROUP_ROWS,
    MIN_SHARED_TOKENS,
    SharedPrefixes,
)

PREFIX = list(range(1000, 1000 + 2 * MIN_SHARED_TOKENS))


def decode_row(request_id: int) -> StepRow:
    return StepRow(request_id=request_id, row=request_id, start_pos=500, input_ids=[FED_BACK], slots=[9], sample=True)


def test_the_largest_group_is_marked_with_the_prefix_all_its_members_share():
    shared = SharedPrefixes()
    for rid in range(5):
        shared.join(rid, PREFIX + [2000 + rid] * 3)          # 5 requests: the prefix, then their own slots
    shared.join(5, PREFIX[:MIN_SHARED_TOKENS + 10] + [3000])  # a sixth shares less: the group shrinks to that
    for rid in (10, 11):
        shared.join(rid, [50, 51] + PREFIX)                   # another group, too small to mark
    rows = [decode_row(rid) for rid in (0, 1, 2, 3, 4, 5, 10, 11, 99)]
    shared.mark(rows)
    assert [r.shared_prefix_len for r in rows] == [MIN_SHARED_TOKENS + 10] * 6 + [0, 0, 0]
    shared.check({0, 1, 2, 3, 4, 5, 10, 11})


def test_groups_too_small_or_too_short_are_not_marked_and_empty_groups_go():
    shared = SharedPrefixes()
    for rid in range(MIN_GROUP_ROWS):
        shared.join(rid, PREFIX[: MIN_SHARED_TOKENS - 1] + [rid])
    rows = [decode_row(rid) for rid in range(MIN_GROUP_ROWS)]
    shared.mark(rows)
    assert all(r.shared_prefix_len == 0 for r in rows)        # a prefix shorter than MIN_SHARED_TOKENS
    for rid in range(MIN_GROUP_ROWS):
        shared.leave(rid)
    shared.check(set())
    assert not shared._groups


def test_a_member_that_left_is_an_integrity_error():
    shared = SharedPrefixes()
    shared.join(1, PREFIX)
    with pytest.raises(AssertionError, match="still in a shared-prefix group"):
        shared.check(set())


def test_prompt_chunks_of_members_are_marked_only_past_the_prefix():
    shared = SharedPrefixes()
    for rid in range(MIN_GROUP_ROWS):
        shared.join(rid, PREFIX)                     # joined at admission with the cached prefix
    chunks = [StepRow(request_id=rid, row=rid, start_pos=len(PREFIX) - (rid == 0), input_ids=[5, 6], slots=[7, 8],
                      sample=True) for rid in range(MIN_GROUP_ROWS)]
    shared.mark(chunks)
    assert [r.shared_prefix_len for r in chunks] == [0] + [len(PREFIX)] * (MIN_GROUP_ROWS - 1)
