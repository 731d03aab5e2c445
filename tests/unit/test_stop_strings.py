"""Stop strings (`decoding/stop.py`): where a text is cut, and how much of a streamed text is safe to
send (`held_back_chars`, the server's stream-safe prefix: what was `stream_safe_prefix`).

The streaming promise: text sent while decoding is always a prefix of the final, cut text, so the
pieces join to it; and nothing is held back that could not start a stop string.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from widebeam.decoding.stop import held_back_chars, stop_string_cut


@pytest.mark.parametrize("text,stops,start,cut", [
    ("hello world", [], 0, None),
    ("hello world", ["xyz"], 0, None),
    ("hello world", ["o"], 0, 4),
    ("hello world", ["world", "lo"], 0, 3),  # the earliest start wins, not the first listed
    ("hello world", ["o w"], 0, 4),
    ("hello world", ["d"], 10, 10),
    ("hello world", ["hello"], 5, None),  # ended before the new text: found on an earlier step
    ("hello world", ["lo w"], 5, 3),  # started before the new text, ends in it
    ("aaa", ["aa"], 2, 1),
    ("", ["a"], 0, None),
])
def test_stop_string_cut(text, stops, start, cut):
    assert stop_string_cut(text, stops, start) == cut


@pytest.mark.parametrize("text,stops,held", [
    ("hello", [], 0),
    ("hello", ["xyz"], 0),
    ("hello wo", ["world"], 2),
    ("hello w", ["world", "o w"], 1),
    ("hello o", ["o w"], 1),
    ("hello o ", ["o w", "xy"], 2),
    ("abab", ["abac"], 2),  # the longest partial match, not the first found
    ("ab", ["abc", "b"], 2),
    ("xa", ["a"], 0),  # a whole stop string is a cut, not a held-back start
    ("wor", ["world"], 3),
])
def test_held_back_chars(text, stops, held):
    assert held_back_chars(text, stops) == held


def streamed_pieces(text: str, stops: list[str]) -> tuple[str, str]:
    """(what a stream sends, the final text) when `text` arrives one character at a time."""
    sent, final = "", text
    for k in range(1, len(text) + 1):
        seen = text[:k]
        cut = stop_string_cut(seen, stops, k - 1)
        if cut is not None:
            final = seen[:cut]
            break
        safe = seen[:k - held_back_chars(seen, stops)]
        assert safe.startswith(sent), "the sent text never shrinks"
        sent = safe
    else:
        final = text
    return sent, final


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab c", max_size=16),
       stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4),
                                                                    max_size=3))
def test_streamed_text_is_always_a_prefix_of_the_final_text(text, stops):
    sent, final = streamed_pieces(text, stops)
    assert final.startswith(sent)
    # nothing is held back at the end that is not the start of a stop string
    held = len(final) - len(sent) if stop_string_cut(text, stops) is None else None
    if held is not None:
        assert held == max([k for s in stops for k in range(1, len(s)) if final.endswith(s[:k])], default=0)
