"""Stop sequences matched on the decoded text, across token boundaries.

TGI matches ``escape(stop)$`` on the accumulated token texts; we match a stop sequence
anywhere in the text that a new token adds (together with the tail that could start a
match), so a stop inside a multi-character token is found too. The matched text stays
in the output; the caller then stops consuming the backend, which aborts the request.
"""
from __future__ import annotations


class StopSequenceMatcher:
    def __init__(self, stop_sequences: tuple[str, ...] | list[str]):
        self._stops = tuple(s for s in stop_sequences if s)   # "" would stop at once: ignored
        longest = max((len(s) for s in self._stops), default=0)
        self._keep = max(0, longest - 1)     # a match must end in new text, so this tail suffices
        self._tail = ""

    def push(self, text: str) -> str | None:
        """Add newly decoded text; return the stop sequence it completes, if any."""
        if not self._stops or not text:
            return None
        window = self._tail + text
        for stop in self._stops:
            if stop in window:
                return stop
        self._tail = window[-self._keep:] if self._keep else ""
        return None
