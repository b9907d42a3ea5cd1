"""Stop sequences: matched on decoded text, across token boundaries, inside tokens."""
from __future__ import annotations

import pytest

from tgi_compat.stop import StopSequenceMatcher


def first_match(stops, pieces):
    matcher = StopSequenceMatcher(stops)
    for i, piece in enumerate(pieces):
        found = matcher.push(piece)
        if found is not None:
            return i, found
    return None


@pytest.mark.parametrize("stops,pieces,expected", [
    (["world"], ["hello", " wo", "rld", "!"], (2, "world")),              # spans two tokens
    (["abcdefgh"], ["ab", "cd", "ef", "gh", "ij"], (3, "abcdefgh")),      # spans four tokens
    (["lo w"], ["hel", "lo", " ", "w"], (3, "lo w")),
    (["cd"], ["abcdef"], (0, "cd")),                                      # inside one token
    (["\n\n"], ["a\n", "\nb"], (1, "\n\n")),
    (["xyz"], ["x", "y", "z"], (2, "xyz")),
    (["zz", "b"], ["a", "b"], (1, "b")),                                  # any of several
    (["é"], ["caf", "", "é"], (2, "é")),                                  # held-back text arrives later
])
def test_stop_sequence_found(stops, pieces, expected):
    assert first_match(stops, pieces) == expected


@pytest.mark.parametrize("stops,pieces", [
    (["xyz"], ["x", "y", "x", "z"]),
    (["world"], ["wor", "k", "ld"]),
    ([], ["anything"]),
    ([""], ["an empty stop sequence never matches"]),
])
def test_no_false_stop(stops, pieces):
    assert first_match(stops, pieces) is None


def test_old_text_does_not_match_again():
    matcher = StopSequenceMatcher(["ab", "abcdefghij"])
    assert matcher.push("xa") is None
    assert matcher.push("b") == "ab"
