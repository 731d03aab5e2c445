"""`LLMEngine.step()` returns deltas: through the engine's public path, the streamed pieces of a
sampled request join to its final text (held back while a stop string could still start in them),
the first generated token is flagged once, beams report progress and finish with their output, and
streaming 2,000 tokens costs detokenization work linear in the output."""

from __future__ import annotations

import pytest
from tiny_models import save_tiny_model

from widebeam.engine import LLMEngine
from widebeam.params import BeamSearchParams, SamplingParams


class CountingTokenizer:
    """The real tokenizer, counting the tokens passed to `decode`."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.decoded_tokens = 0

    def decode(self, token_ids, **kwargs):
        self.decoded_tokens += len(token_ids)
        return self._tokenizer.decode(token_ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.fixture(scope="module")
def engine(smollm2, tmp_path_factory):
    """A tiny random model over the first 128 ids of the real SmolLM2 tokenizer, long enough to stream
    2,000 tokens."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-long")
    save_tiny_model(path, "llama", max_position_embeddings=4096)
    engine = LLMEngine(str(path), device="cpu", kv_cache_memory="16MiB", tokens_per_block=16,
                       max_num_batched_tokens=8)
    engine.tokenizer = CountingTokenizer(AutoTokenizer.from_pretrained(str(smollm2[1].path)))
    return engine


def run(engine, request_id, prompt, params):
    free = engine.cache.num_free_blocks()
    engine.add_request(request_id, prompt, params)
    deltas = []
    while engine.has_unfinished():
        deltas += [d for d in engine.step() if d.request_id == request_id]
    assert engine.cache.num_free_blocks() == free
    return deltas


def test_streamed_pieces_join_to_the_text_and_never_end_inside_a_stop_string(engine):
    prompt = list(range(5, 25))  # 20 tokens over chunks of 8: two steps choose no token
    plain = run(engine, "plain", prompt, SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True))
    text = plain[-1].output.outputs[0].text
    assert "".join(d.new_text for d in plain) == text and len(text) > 10
    assert [d.first_token for d in plain] == [True] + [False] * 23  # prefill-only steps yield no delta
    assert [d.num_generated_tokens for d in plain] == list(range(1, 25))
    assert [t for d in plain for t in d.new_token_ids] == plain[-1].output.outputs[0].token_ids

    # A stop string that starts mid-output: nothing of it is ever streamed, and the text ends before it.
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = text.find(stop)
    stopped = run(engine, "stopped", prompt, SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True,
                                                            stop=[stop]))
    final = stopped[-1].output.outputs[0]
    assert final.text == text[:cut] and final.finish_reason == "stop"
    streamed = ""
    for delta in stopped:
        streamed += delta.new_text
        assert stop not in streamed and text.startswith(streamed)
    assert streamed == final.text


def test_beam_deltas_report_progress_and_finish_with_the_beams(engine):
    deltas = run(engine, "beams", list(range(5, 15)), BeamSearchParams(beam_width=4, max_new_tokens=6,
                                                                        ignore_eos=True))
    assert [d.num_generated_tokens for d in deltas] == list(range(1, 7))
    assert [d.first_token for d in deltas] == [True] + [False] * 5
    assert not any(d.new_text for d in deltas) and [d.finished for d in deltas] == [False] * 5 + [True]
    assert len(deltas[-1].output.outputs) == 4


def test_streaming_2000_tokens_costs_linear_detokenization_work(engine):
    engine.tokenizer.decoded_tokens = 0
    deltas = run(engine, "long", [5, 6, 7],
                 SamplingParams(max_new_tokens=2000, temperature=0, ignore_eos=True))
    assert deltas[-1].num_generated_tokens == 2000
    # Re-decoding the whole output every step would pass about 2,000,000 tokens to the tokenizer.
    assert engine.tokenizer.decoded_tokens <= 5 * 2000, engine.tokenizer.decoded_tokens
    assert "".join(d.new_text for d in deltas) == engine.tokenizer.decode(
        deltas[-1].output.outputs[0].token_ids, skip_special_tokens=True)
