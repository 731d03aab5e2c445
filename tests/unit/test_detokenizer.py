"""The incremental detokenizer: streamed one token (or a few) at a time, its pieces join to exactly what
`tokenizer.decode` gives for the whole output, and the work is linear in the output's length."""

from __future__ import annotations

import random

import pytest

from widebeam.detokenizer import IncrementalDetokenizer

MIXED = ("Hello 世界! 🎉 The family 👩\u200d👩\u200d👧 went to 東京 — naïve café, ½ price. "
         "日本語のテキストと한국어 텍스트 😀😃🙃\n\n    code() {x: 1}  end")


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    _, source = smollm2
    return AutoTokenizer.from_pretrained(str(source.path))


class CountingTokenizer:
    """Counts the tokens passed to `decode`; everything else is the wrapped tokenizer's."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.decoded_tokens = 0
        self.decode_calls = 0

    def decode(self, token_ids, **kwargs):
        self.decoded_tokens += len(token_ids)
        self.decode_calls += 1
        return self._tokenizer.decode(token_ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int], sizes=(1,)) -> list[str]:
    pieces, k, i = [], 0, 0
    while k < len(token_ids):
        size = sizes[i % len(sizes)]
        pieces.append(detokenizer.add(token_ids[k:k + size]))
        k, i = k + size, i + 1
    return pieces


def test_multibyte_text_streamed_one_token_at_a_time(tokenizer):
    ids = tokenizer.encode(MIXED)
    assert len(ids) > len(MIXED.split())  # emoji and CJK take several byte-level tokens each
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = stream(detokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == MIXED
    assert detokenizer.text == MIXED and detokenizer.flush() == ""
    assert not any("\ufffd" in piece for piece in pieces), "no piece shows half a character"
    assert sum(1 for piece in pieces if piece == "") > 0, "the bytes of a character wait for the rest"


@pytest.mark.parametrize("sizes", [(1,), (2,), (3, 1, 4), (1000,)])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_and_batches(tokenizer, sizes, skip_special_tokens):
    ids = tokenizer.encode(MIXED)
    # <|im_end|>, <|endoftext|>, <file_sep> (a special token not in all_special_ids), and EOS repeated
    ids = [1, *ids[:7], 2, 0, 5, *ids[7:], *([2] * 50)]
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    text = "".join(stream(detokenizer, ids, sizes)) + detokenizer.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert detokenizer.text == text
    assert ("<|im_end|>" in text) is not skip_special_tokens


def test_random_token_sequences_match_decode(tokenizer):
    """Any ids, including lone bytes of characters that never complete (rendered '\\ufffd' as decode does)."""
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(200):
        ids = [rng.randrange(vocab) if rng.random() < 0.9 else rng.randrange(17)
               for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
            text = "".join(stream(detokenizer, ids, (1, 2, 3))) + detokenizer.flush()
            assert text == tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_an_incomplete_last_character_is_held_until_flush(tokenizer):
    ids = tokenizer.encode("ok 🎉")
    head = ids[:-1]  # the emoji's last byte missing
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert "".join(stream(detokenizer, head)) == "ok"
    tail = detokenizer.flush()
    assert tail.startswith(" ") and tail.endswith("\ufffd")
    assert detokenizer.text == tokenizer.decode(head, skip_special_tokens=True)
    assert detokenizer.flush() == ""


def test_streaming_2000_tokens_costs_linear_detokenization_work(tokenizer):
    text = MIXED + " " + " ".join(f"word{i} 数{i} 🎉" for i in range(2000))
    ids = tokenizer.encode(text)[:2000]
    assert len(ids) == 2000

    counting = CountingTokenizer(tokenizer)
    detokenizer = IncrementalDetokenizer(counting)
    pieces = stream(detokenizer, ids) + [detokenizer.flush()]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    incremental = counting.decoded_tokens
    # 3 tokens per token streamed (its window of two, then the one before it), a little more while an
    # emoji's or a CJK character's bytes wait for the rest: 7,460 here
    assert incremental <= 5 * len(ids), incremental

    # The naive way, decoding the whole output after every token: ~N^2 / 2 tokens.
    naive_counting = CountingTokenizer(tokenizer)
    for k in range(1, len(ids) + 1):
        whole = naive_counting.decode(ids[:k], skip_special_tokens=True)
    assert whole == "".join(pieces)
    assert naive_counting.decoded_tokens == len(ids) * (len(ids) + 1) // 2 == 2_001_000
    assert naive_counting.decoded_tokens > 100 * incremental


def test_sentencepiece_tokenizer_keeps_word_spaces(tmp_path):
    """SentencePiece drops the leading space of the first piece a decode call sees: the window's context
    token keeps the spaces between words that one-token decodes would lose."""
    pytest.importorskip("sentencepiece")
    from tiny_models import save_tiny_marian_tokenizer

    tokenizer = save_tiny_marian_tokenizer(tmp_path)
    ids = tokenizer.encode("the cat sat on the mat hello world")
    assert "".join(tokenizer.decode([i]) for i in ids) != tokenizer.decode(ids, skip_special_tokens=True)
    rng = random.Random(1)
    for sample in [ids] + [[rng.randrange(len(tokenizer)) for _ in range(20)] for _ in range(50)]:
        for skip in (True, False):
            detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
            text = "".join(stream(detokenizer, sample)) + detokenizer.flush()
            assert text == tokenizer.decode(sample, skip_special_tokens=skip), sample
