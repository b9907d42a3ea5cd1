"""Which decoding requests share a prompt prefix's KV slots (cascade attention).

Requests that took the same cached prefix from the prefix cache hold the very same KV
slots for its positions. A decode step can then attend to that prefix once for all of
them (``kernels.decode_attention``, the shared-prefix kernel) instead of once per request:
with 256 requests behind a 3,000-token system prompt that is most of a step's KV reads.

A group is keyed by the slot of position 0 (requests with different first slots share
nothing). A request joins at admission with the cached prefix it took, or (a request that
took none: the one that prefilled the prefix) when its first decode row is planned, with
its prompt's slots but the last; the group's length is the common prefix of every member's
slots, so it can only shrink while the group lives. While a group has members, every
member holds the group's slots, so they stay allocated. Each step marks the rows (prompt
chunks and decode rows) of the largest group among its rows that start past the prefix
(one group per step: the decode graphs take one shared prefix).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from engine.protocol.messages import StepRow
from engine.router.prefix_cache import common_prefix_length

MIN_SHARED_TOKENS = 64     # a shorter shared prefix is not worth a kernel of its own
MIN_GROUP_ROWS = 4         # nor one that fewer requests of a step share


@dataclass
class _Group:
    slots: list[int]                     # the first member's prompt slots
    length: int                          # positions every member shares
    members: set[int] = field(default_factory=set)


class SharedPrefixes:
    def __init__(self):
        self._groups: dict[int, _Group] = {}       # slot of position 0 -> group
        self._group_of: dict[int, int] = {}        # request id -> its group's key

    def is_member(self, request_id: int) -> bool:
        return request_id in self._group_of

    def join(self, request_id: int, prompt_slots: list[int]) -> None:
        """``prompt_slots``: a prefix of the request's slots whose KV is written (or planned)."""
        if not prompt_slots or request_id in self._group_of:
            return
        key = prompt_slots[0]
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(slots=list(prompt_slots), length=len(prompt_slots))
        else:
            group.length = common_prefix_length(group.slots[: group.length], prompt_slots)
        group.members.add(request_id)
        self._group_of[request_id] = key

    def leave(self, request_id: int) -> None:
        key = self._group_of.pop(request_id, None)
        if key is None:
            return
        group = self._groups[key]
        group.members.discard(request_id)
        if not group.members:
            del self._groups[key]

    def shared_length(self, request_id: int) -> int:
        """The prefix the request's prompt chunks may take through the shared-prefix kernel (0: none): its
        group's, where the group is large enough for ``mark`` to choose it."""
        key = self._group_of.get(request_id)
        if key is None:
            return 0
        group = self._groups[key]
        return group.length if len(group.members) >= MIN_GROUP_ROWS and group.length >= MIN_SHARED_TOKENS else 0

    def mark(self, rows: list[StepRow]) -> None:
        """Set ``shared_prefix_len`` on the rows of the step's largest shared group."""
        counts = Counter(self._group_of.get(row.request_id) for row in rows)
        counts.pop(None, None)
        for key, count in counts.most_common():
            group = self._groups[key]
            if count < MIN_GROUP_ROWS:
                return
            if group.length >= MIN_SHARED_TOKENS:
                for row in rows:
                    if self._group_of.get(row.request_id) == key and row.start_pos >= group.length:
                        row.shared_prefix_len = group.length
                return

    def check(self, running_ids: set[int]) -> None:
        """Every member is running and every group has members (``Scheduler.check_integrity``)."""
        assert set(self._group_of) <= running_ids, "a finished request is still in a shared-prefix group"
        assert all(group.members for group in self._groups.values()), "an empty shared-prefix group"
        assert sum(len(g.members) for g in self._groups.values()) == len(self._group_of)
