"""Processors read one history (decoding/context.py): through the engine's public path, the history the
decoder hands its processors is, after every step, the live sequences' own (beams reordered, beams
finished on a stop string dropped, a speculative round's replayed steps recorded), and equals the
decoder's `live_token_ids`; the decoder asks its processors generically (`allowed`, `forces_eos`)."""

from __future__ import annotations

import pytest
import torch
from decoder_checks import engine_decoder
from tiny_models import save_tiny_model

from widebeam.decoding.context import StepContext
from widebeam.decoding.decoders import BeamDecoder, RowScores, SamplingDecoder
from widebeam.decoding.processors import CallableProcessor, StepProcessor
from widebeam.engine import LLMEngine
from widebeam.params import BeamSearchParams, SamplingParams

CPU = torch.device("cpu")
PROMPT = [5, 6, 7, 8, 5, 6, 7, 9, 10, 5, 6]


@pytest.fixture(scope="module", params=["plain", "speculative"])
def engine(request, smollm2, tmp_path_factory):
    """A tiny random model over the real SmolLM2 tokenizer (stop strings need text); with prompt-lookup
    drafts, the decoder is replayed on verified scores a round at a time."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-context")
    save_tiny_model(path, "llama")
    kwargs = {}
    if request.param == "speculative":
        kwargs = {"speculative_method": "ngram", "num_speculative_tokens": 3}
    engine = LLMEngine(str(path), device="cpu", kv_cache_memory="16MiB", max_beam_width=8, **kwargs)
    engine.tokenizer = AutoTokenizer.from_pretrained(str(smollm2[1].path))
    return engine


def run_checking_histories(engine, request_id, params):
    """Run one request to the end; after every step, its decoder's history (what processors read)
    holds the prompt + each live sequence's generated tokens, in live order."""
    engine.add_request(request_id, {"prompt_token_ids": PROMPT}, params)
    request = engine._requests[request_id]
    decoder = request.decoder
    checked = 0
    final = None
    fewest_live = params.beam_width
    while engine.has_unfinished():
        for delta in engine.step():
            final = delta if delta.finished else final
        if decoder.done or not request.prompt_done:
            continue
        history = decoder.history.ids(CPU)  # [live, prompt + generated]
        assert history[:, :len(PROMPT)].tolist() == [PROMPT] * history.shape[0]
        assert history[:, len(PROMPT):].tolist() == decoder.live_token_ids
        assert history.shape[1] == len(PROMPT) + decoder.num_generated_tokens
        checked += 1
        fewest_live = min(fewest_live, history.shape[0])
    assert checked >= 3
    return final.output, fewest_live


def test_beam_history_follows_reorders_and_stop_strings(engine):
    params = BeamSearchParams(beam_width=6, max_new_tokens=10, ignore_eos=True, repetition_penalty=1.3)
    unstopped, fewest_live = run_checking_histories(engine, "beams", params)
    assert fewest_live == 6
    assert isinstance(engine_decoder(engine, params, 10, prompt_token_ids=PROMPT), BeamDecoder)
    # A stop string from the middle of the returned texts: some beams finish early, dropping rows.
    texts = [o.text for o in unstopped.outputs]
    middles = [text[len(text) // 2: len(text) // 2 + 1] for text in texts]
    stop = max(middles, key=lambda c: sum(c in t for t in texts))
    _, fewest_live = run_checking_histories(engine, "stopped", params.replace(stop=[stop]))
    assert 0 < fewest_live < 6, stop


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, presence_penalty=0.5),
    SamplingParams(max_new_tokens=12, temperature=0.8, seed=3, ignore_eos=True, repetition_penalty=1.4),
])
def test_sampling_history_is_its_generated_tokens(engine, params):
    output, _ = run_checking_histories(engine, "sampled", params)
    assert len(output.outputs[0].token_ids) == 12


class OnlyTokens(StepProcessor):
    """Allows `tokens` alone, for every row: offers them as a set, or masks the rest."""

    def __init__(self, tokens):
        self.tokens = tokens
        self.processed = 0

    def process(self, scores: torch.Tensor, context: StepContext) -> None:
        self.processed += 1
        kept = scores[:, self.tokens].clone()
        scores.fill_(float("-inf"))
        scores[:, self.tokens] = kept

    def allowed(self, context: StepContext):
        rows = torch.arange(context.num_rows).repeat_interleave(len(self.tokens))  # [rows * tokens]
        return rows, torch.tensor(self.tokens).repeat(context.num_rows)


def test_a_lone_processor_offering_a_set_is_ranked_without_a_mask_and_alike():
    torch.manual_seed(0)
    params = BeamSearchParams(beam_width=3, max_new_tokens=5, ignore_eos=True)
    alone = OnlyTokens([3, 8, 11, 20])
    with_another = OnlyTokens([3, 8, 11, 20])
    fast = BeamDecoder(params, 5, frozenset({2}), [alone], [1, 2])
    masked = BeamDecoder(params, 5, frozenset({2}), [with_another, lambda scores, n: None], [1, 2])
    assert isinstance(masked.processors[1], CallableProcessor)  # a user's callable, wrapped
    rows = 1
    for _ in range(4):
        logits = torch.randn(rows, 40)
        scores = RowScores(logits, torch.log_softmax(logits, -1))
        step = fast.advance(scores)
        assert step == masked.advance(scores)
        rows = len(step.token_ids)
    assert alone.processed == 0 and with_another.processed == 4
    assert fast.finalize() == masked.finalize()


class ForceAt(StepProcessor):
    def __init__(self, token, at):
        self.token, self.at = token, at

    def forces_eos(self, context: StepContext) -> bool:
        return context.num_generated_tokens == self.at

    def process(self, scores: torch.Tensor, context: StepContext) -> None:
        if self.forces_eos(context):
            scores.fill_(float("-inf"))
            scores[:, self.token] = 0.0


def test_any_processor_forcing_eos_lets_it_through_min_new_tokens():
    params = BeamSearchParams(beam_width=2, max_new_tokens=6, min_new_tokens=4)
    logits = torch.randn(1, 40)
    for processors, done in (([ForceAt(2, 0)], True), ([ForceAt(2, 5)], False)):
        decoder = BeamDecoder(params, 6, frozenset({2}), processors, [1])
        decoder.advance(RowScores(logits, torch.log_softmax(logits, -1)))
        assert decoder.done is done  # forced at step 0: every candidate is EOS, let through


def test_both_decoders_stop_alike():
    sampling = SamplingDecoder(SamplingParams(temperature=0), 8, frozenset({2}), [])
    assert sampling.live_token_ids == [[]] and sampling.batched_greedy
    sampling.stop([1])
    assert not sampling.done
    sampling.stop()
    assert sampling.done and sampling.finish_reason == "stop"
    beams = BeamDecoder(BeamSearchParams(beam_width=2, max_new_tokens=8, ignore_eos=True), 8, frozenset({2}),
                        [lambda scores, n: None], [1])
    assert beams.live_token_ids == [[]] and not beams.batched_greedy
    logits = torch.randn(1, 40)
    beams.advance(RowScores(logits, torch.log_softmax(logits, -1)))
    assert len(beams.live_token_ids) == 2 and beams.history.ids(CPU).shape == (2, 2)
    beams.stop([0])
    assert len(beams.live_token_ids) == 1 and beams.history.ids(CPU)[:, 1:].tolist() == beams.live_token_ids
    beams.stop()
    assert beams.done
