"""Token-slot allocator of TokenAttention, owned by the router (CPU, no torch).

The KV buffer has ``num_slots`` usable slots (0 .. num_slots-1) plus one dummy slot
(index ``num_slots``) that padded rows write into. Request rows index the
``req_to_token`` table (0 .. max_requests-1; row ``max_requests`` is the dummy row).

Invariants (checked by ``check_integrity``):
  * free + used == num_slots, and no slot is free and used, or used twice;
  * every slot a request holds was allocated to it and is freed exactly once.
"""
from __future__ import annotations


class AllocatorError(RuntimeError):
    """An allocation or free broke TokenAttention's bookkeeping."""


class SlotAllocator:
    def __init__(self, num_slots: int, max_requests: int):
        if num_slots <= 0 or max_requests <= 0:
            raise ValueError(f"num_slots ({num_slots}) and max_requests ({max_requests}) must be positive")
        self.num_slots = num_slots
        self.max_requests = max_requests
        self._free_slots = list(range(num_slots - 1, -1, -1))  # a stack: pop() gives low slots first
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self._slots_of: dict[object, list[int]] = {}
        self._row_of: dict[object, int] = {}

    @property
    def dummy_slot(self) -> int:
        return self.num_slots

    @property
    def dummy_row(self) -> int:
        return self.max_requests

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free_slots)

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def open_request(self, request_id) -> int:
        """Give a request its table row; it holds no slots yet."""
        if request_id in self._row_of:
            raise AllocatorError(f"request {request_id!r} already holds row {self._row_of[request_id]}")
        if not self._free_rows:
            raise AllocatorError(f"no free request row: all {self.max_requests} are taken")
        row = self._free_rows.pop()
        self._row_of[request_id] = row
        self._slots_of[request_id] = []
        return row

    def allocate(self, request_id, count: int) -> list[int]:
        """Append ``count`` slots to the request's tokens and return them."""
        held = self._slots_of.get(request_id)
        if held is None:
            raise AllocatorError(f"request {request_id!r} has no row; call open_request first")
        if count > len(self._free_slots):
            raise AllocatorError(f"asked for {count} slots, {len(self._free_slots)} free")
        slots = [self._free_slots.pop() for _ in range(count)]
        held.extend(slots)
        return slots

    def held(self, request_id) -> int:
        return len(self._slots_of.get(request_id, ()))

    def row(self, request_id) -> int:
        return self._row_of[request_id]

    def release(self, request_id) -> int:
        """Free the request's row and every slot it holds; returns the slot count."""
        if request_id not in self._row_of:
            raise AllocatorError(f"request {request_id!r} holds nothing (released twice?)")
        slots = self._slots_of.pop(request_id)
        self._free_slots.extend(reversed(slots))
        self._free_rows.append(self._row_of.pop(request_id))
        return len(slots)

    def check_integrity(self) -> None:
        used = [s for slots in self._slots_of.values() for s in slots]
        problems = []
        if len(used) + len(self._free_slots) != self.num_slots:
            problems.append(f"free {len(self._free_slots)} + used {len(used)} != capacity {self.num_slots}")
        if len(set(used)) != len(used):
            problems.append("a slot is owned twice")
        if set(used) & set(self._free_slots):
            problems.append("a slot is both free and used")
        if len(set(self._free_slots)) != len(self._free_slots):
            problems.append("a slot is free twice")
        if any(not 0 <= s < self.num_slots for s in used + self._free_slots):
            problems.append("a slot index is out of range")
        rows = list(self._row_of.values())
        if len(rows) + len(self._free_rows) != self.max_requests or set(rows) & set(self._free_rows):
            problems.append("request rows are inconsistent")
        if problems:
            raise AllocatorError("; ".join(problems))
