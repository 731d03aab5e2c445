"""Stop strings (`decoding/stop.py`): where a text is cut, and how much of a streamed text is safe to
send (`held_back_chars`, the server's stream-safe prefix: what was `stream_safe_prefix`).

The streaming promise: text sent while decoding is always a prefix of the final, cut text, so the
pieces join to it; and nothing is held back that could not start a stop string.
"""

from __future__ import annotations

from typing import ClassVar

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


ALPHABET = "ab c"
FIRST_ID = 3  # token FIRST_ID + i decodes to ALPHABET[i]; ids below are the model's special ones


class CharTokenizer:
    """One character per token over ALPHABET, so a forced token sequence streams a chosen text."""

    all_special_ids: ClassVar[list[int]] = []

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return "".join(ALPHABET[t - FIRST_ID] for t in token_ids)

    def encode(self, text: str) -> list[int]:
        return [FIRST_ID + ALPHABET.index(ch) for ch in text]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    from widebeam.engine import LLMEngine

    engine = LLMEngine(str(tiny_llama_dir), device="cpu", kv_cache_memory="4MiB", tokens_per_block=4,
                       enable_prefix_caching=False)
    engine.tokenizer = CharTokenizer()
    return engine


def stream_through_the_engine(engine, text: str, stops: list[str]):
    """The engine's public streaming path (`add_request`, then `step()` deltas): a greedy request
    forced to generate `text`'s tokens, with stop strings `stops`. Returns its deltas."""
    from widebeam.params import SamplingParams

    token_ids = engine.tokenizer.encode(text)

    def force(scores, num_generated_tokens):
        target = scores[:, token_ids[num_generated_tokens]].clone()
        scores.fill_(float("-inf"))
        scores[:, token_ids[num_generated_tokens]] = target

    params = SamplingParams(max_new_tokens=len(text), temperature=0, ignore_eos=True, stop=stops)
    engine.add_request("s", [5, 6, 7], params, logits_processors=[force])
    deltas = []
    while engine.has_unfinished():
        deltas += [d for d in engine.step() if d.request_id == "s"]
    return deltas


def expected_stream(text: str, stops: list[str]) -> tuple[str, list[int]]:
    """From the definition, with str.find only: (the final text: cut before the stop string found
    first as the text arrives, the earliest-starting one among those completed at that character;
    per character, how many trailing characters could still start a stop string)."""
    held = []
    for k in range(1, len(text) + 1):
        seen = text[:k]
        starts = [seen.find(stop) for stop in stops if stop in seen]
        if starts:
            return seen[:min(starts)], held
        held.append(max([n for stop in stops for n in range(1, len(stop)) if seen.endswith(stop[:n])],
                        default=0))
    return text, held


@settings(max_examples=120, deadline=None)
@given(text=st.text(alphabet=ALPHABET, min_size=1, max_size=16),
       stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3))
def test_streamed_text_is_always_a_prefix_of_the_final_text(engine, text, stops):
    """Streamed one character per step through the engine: what is sent never shrinks and is always
    a prefix of the final text, the pieces join to it, the final text is cut before the first stop
    string, and each step holds back exactly the characters that could still start one."""
    final, held = expected_stream(text, stops)
    deltas = stream_through_the_engine(engine, text, stops)
    assert deltas and deltas[-1].finished and all(not d.finished for d in deltas[:-1])
    [output] = deltas[-1].output.outputs
    assert output.text == final
    assert output.finish_reason == ("stop" if any(stop in text for stop in stops) else "length")
    sent = ""
    for k, delta in enumerate(deltas, start=1):
        sent += delta.new_text
        assert final.startswith(sent), (k, sent, final)
        if not delta.finished:  # the k-th character arrived: all of it out but what could start a stop
            assert len(sent) == k - held[k - 1], (k, sent, held)
    assert sent == final
