"""The options only CTranslate2 has (`patience`, `return_alternatives` with `min_alternative_expansion_prob`,
`prefix_bias_beta`, `score_batch`), held to CTranslate2 itself: a tiny NLLB-shaped M2M100 (a locally trained
SentencePiece vocabulary) converted by CTranslate2's own `TransformersConverter` in float32, 50 text
sources, hypotheses equal and scores within 1e-3 (they agree to ~1e-5).

Where the definitions differ (CTranslate2 4.8's `src/decoding.cc`; docs/decoding-options.md), the test
uses the settings under which they coincide, or converts, and says so:

* CTranslate2 bans tokens (its min length, `suppress_sequences`) on the logits before the log-softmax,
  renormalising; widebeam, like transformers, on the log-probs after it. So PAD is not banned on either
  side here (the tiny NLLB's generation config bans it; this copy drops that) and no min length is set,
  except for alternatives, whose first token CTranslate2 always draws with the end tokens banned.
* With a target prefix CTranslate2 counts the prefix in the length it normalises by and bans an end token
  ranked below the first at the first free step; widebeam does neither (transformers' definition). Beam
  searches with length normalisation therefore run without a prefix (the language code is generated).
* An end token list (`</s>` and a frequent piece) makes hypotheses finish at every length, so the
  stopping rules (patience, `early_stopping=True` = CTranslate2's rule when `length_penalty != 0`) matter.
"""

from __future__ import annotations

import json
import math

import pytest
from tiny_nllb import _SENTENCES, save_tiny_nllb

from widebeam.llm import LLM
from widebeam.params import BeamSearchParams

ctranslate2 = pytest.importorskip("ctranslate2", reason="make test installs CTranslate2 (the dev extra)")

W, N, K = 4, 10, 5  # beam width, new tokens, alternatives
ATOL = 1e-3
EOS = 2


class Peers:
    def __init__(self, root):
        path = root / "nllb"
        _, self.tok = save_tiny_nllb(path)
        config = path / "generation_config.json"
        generation = json.loads(config.read_text())
        del generation["bad_words_ids"]  # PAD allowed on both sides: CT2 would renormalise around a ban
        config.write_text(json.dumps(generation))
        converted = root / "ct2"
        ctranslate2.converters.TransformersConverter(str(path)).convert(str(converted), force=True)
        # the model's 64 rows hold 9 past the tokenizer's 55 (CT2 names them madeupwordN): map by its list
        self.vocab = json.loads((converted / "shared_vocabulary.json").read_text())
        self.ids = {t: i for i, t in enumerate(self.vocab)}
        self.ct2 = ctranslate2.Translator(str(converted), device="cpu", compute_type="float32",
                                          intra_threads=1)
        self.llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory="16MiB", max_beam_width=16)
        words = " ".join(_SENTENCES).split()
        texts = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(2 + i % 6)) for i in range(50)]
        self.sources = [self.tok(t).input_ids for t in texts]
        self.lang = self.ids["fra_Latn"]
        self.end = [EOS, self.ids["▁w"]]  # '▁w' ends many hypotheses of this random model early

    def tokens(self, ids):
        return [self.vocab[i] for i in ids]

    def widebeam(self, params, sources=None):
        sources = self.sources if sources is None else sources
        return self.llm.generate([{"prompt_token_ids": s} for s in sources], params, use_tqdm=False)

    def translate(self, sources=None, **options):
        sources = self.sources if sources is None else sources
        # CT2's default min_decoding_length 1 bans (renormalising) end tokens at step 0: widebeam's is 0
        options.setdefault("min_decoding_length", 0)
        return self.ct2.translate_batch([self.tokens(s) for s in sources], return_scores=True,
                                        return_end_token=True, **options)

    def hypotheses(self, result, strip=0):
        return [([self.ids[t] for t in h][strip:], s) for h, s in zip(result.hypotheses, result.scores)]

    def end_probability(self):
        """Per source: the raw probability of any end token at the first free position after the prefix."""
        pairs = [(s, [e]) for s in self.sources for e in self.end]
        scores = self.llm.score([p for p, _ in pairs], [c for _, c in pairs], decoder_prefix=[self.lang])
        return [sum(math.exp(scores[i * len(self.end) + j].logprob) for j in range(len(self.end)))
                for i in range(len(self.sources))]


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    return Peers(tmp_path_factory.mktemp("ct2-options"))


def assert_same(got, expected, score=lambda beam: beam.score, first=None):
    """widebeam's outputs against CT2's (token ids, score) lists, per source (the `first` of each)."""
    assert len(got) == len(expected)
    for i, (out, exp) in enumerate(zip(got, expected)):
        beams, exp = out.outputs[:first], exp[:first]
        assert [b.token_ids for b in beams] == [h for h, _ in exp], i
        for beam, (_, value) in zip(beams, exp):
            assert score(beam) == pytest.approx(value, abs=ATOL), i


def test_score_batch_is_llm_score(peers):
    targets = [[peers.lang] + peers.sources[(i + 1) % 50][1:-1] for i in range(50)]
    ct2 = peers.ct2.score_batch([peers.tokens(s) for s in peers.sources], [peers.tokens(t) for t in targets])
    # score_batch appends </s> and scores it: LLM.score scores exactly what it is given
    ours = peers.llm.score(peers.sources, [t + [EOS] for t in targets])
    for theirs, mine, target in zip(ct2, ours, targets):
        assert [peers.ids[t] for t in theirs.tokens] == target + [EOS]
        assert mine.token_logprobs == pytest.approx(theirs.log_probs, abs=ATOL)


def plain(peers, patience):
    got = peers.widebeam(BeamSearchParams(beam_width=W, max_new_tokens=N, early_stopping=True,
                                          patience=patience, num_return_sequences=W,
                                          stop_token_ids=peers.end[1:]))
    ct2 = peers.translate(beam_size=W, num_hypotheses=W, patience=patience, max_decoding_length=N,
                          end_token=peers.end)
    expected = [peers.hypotheses(r) for r in ct2]
    assert_same(got, expected)
    return expected


def test_beam_search_and_patience(peers):
    """CT2 with length_penalty != 0 stops once round(W * patience) hypotheses finished: widebeam's
    early_stopping=True; length normalised by the generated tokens, end token included, in both."""
    base = plain(peers, 1.0)
    lengths = [len(h) for hyps in base for h, _ in hyps]
    assert sum(n < N for n in lengths) > len(lengths) // 3  # hypotheses do end early
    patient = plain(peers, 2.0)
    assert sum(a != b for a, b in zip(base, patient)) >= 5  # patience changes the outcome


def test_beam_search_with_a_language_code_prefix(peers):
    """Target prefix = the language code, no length normalisation (CT2's score is then the cumulative
    log-prob; it stops when the top candidate ends, which decides the same best hypothesis).
    CT2 bans an end token ranked below the first at the first free step (its issue #277): where
    widebeam's best is such a one-token hypothesis, CT2's best is another."""
    got = peers.widebeam(BeamSearchParams(beam_width=W, max_new_tokens=N, length_penalty=0.0,
                                          decoder_prefix=[peers.lang], stop_token_ids=peers.end[1:]))
    ct2 = peers.translate(target_prefix=[["fra_Latn"]] * 50, beam_size=W, num_hypotheses=1, length_penalty=0,
                          max_decoding_length=N + 1, min_decoding_length=1, end_token=peers.end)
    same = 0
    for out, result in zip(got, ct2):
        ((tokens, score),) = peers.hypotheses(result, strip=1)  # CT2 returns the prefix too
        best = out.outputs[0]
        if best.token_ids == tokens:
            assert best.cumulative_logprob == pytest.approx(score, abs=ATOL)
            same += 1
        else:
            assert len(best.token_ids) == 1 and best.token_ids[0] in peers.end
    assert same >= 25


def test_return_alternatives(peers):
    """CT2 draws the first tokens with the end tokens banned before the log-softmax (renormalised):
    its score = widebeam's cumulative log-prob - log(1 - P(end)). Continued greedily (CT2 beam_size=1),
    length_penalty 0 (CT2 adds the suffix's normalised score to the first token's log-prob)."""
    params = BeamSearchParams(beam_width=K, max_new_tokens=N, length_penalty=0.0, decoder_prefix=[peers.lang],
                              min_new_tokens=1, return_alternatives=True, stop_token_ids=peers.end[1:])
    got = peers.widebeam(params)
    options = {"target_prefix": [["fra_Latn"]] * 50, "num_hypotheses": K, "length_penalty": 0,
               "max_decoding_length": N + 1, "return_alternatives": True, "end_token": peers.end}
    ct2 = peers.translate(beam_size=1, **options)
    p_end = peers.end_probability()
    expected = [[(h, s + math.log1p(-p)) for h, s in peers.hypotheses(r, strip=1)]
                for r, p in zip(ct2, p_end)]
    assert_same(got, expected, score=lambda beam: beam.cumulative_logprob)
    # CT2 continues each alternative with its beam search: the alternatives' first tokens still agree
    with_beams = peers.translate(beam_size=W, **options)
    assert [[b.token_ids[0] for b in out.outputs] for out in got] == \
           [[h[0] for h, _ in peers.hypotheses(r, strip=1)] for r in with_beams]


def test_min_alternative_expansion_prob(peers):
    """CT2 compares the renormalised probability (see above) with the threshold: per source, a threshold
    between the 2nd and 3rd alternatives' keeps two, given to widebeam as threshold * (1 - P(end))."""
    p_end = peers.end_probability()
    params = BeamSearchParams(beam_width=K, max_new_tokens=N, length_penalty=0.0, decoder_prefix=[peers.lang],
                              min_new_tokens=1, return_alternatives=True, stop_token_ids=peers.end[1:])
    firsts = [[b.token_ids[0] for b in out.outputs] for out in peers.widebeam(params)]
    pairs = [(s, [t]) for s, f in zip(peers.sources, firsts) for t in f[1:3]]
    second_third = peers.llm.score([p for p, _ in pairs], [c for _, c in pairs], decoder_prefix=[peers.lang])
    for i, source in enumerate(peers.sources):
        p2, p3 = (math.exp(s.logprob) for s in second_third[2 * i:2 * i + 2])
        threshold = (p2 + p3) / 2 / (1 - p_end[i])  # CT2's scale
        (result,) = peers.translate([source], beam_size=1, target_prefix=[["fra_Latn"]], num_hypotheses=K,
                                    length_penalty=0, max_decoding_length=N + 1, return_alternatives=True,
                                    end_token=peers.end, min_alternative_expansion_prob=threshold)
        (out,) = peers.widebeam(params.replace(min_alternative_expansion_prob=threshold * (1 - p_end[i])),
                                [source])
        expected = [(h, s + math.log1p(-p_end[i])) for h, s in peers.hypotheses(result, strip=1)]
        assert len(expected) == 2
        assert_same([out], [expected], score=lambda beam: beam.cumulative_logprob)


def test_prefix_bias_beta(peers):
    """The whole target prefix (language code, then 'the quick') is soft in both: a beam still on the
    prefix gets log((1 - beta) p + beta) for the prefix token, log(1 - beta) + log p otherwise; a beam
    that left it is not biased. CT2 tracks "left the prefix" per beam slot rather than per beam (its flags
    are not reordered with the beams), so at W > 1 a lower hypothesis can differ where the on-prefix beam
    changes slot; at W = 1 they are one definition."""
    prefix = [peers.lang] + peers.tok("the quick", add_special_tokens=False).input_ids
    target_prefix = [peers.tokens(prefix)] * 50
    for width in (1, W):
        got = peers.widebeam(BeamSearchParams(beam_width=width, max_new_tokens=N, early_stopping=True,
                                              num_return_sequences=width, decoder_prefix=prefix,
                                              prefix_bias_beta=0.5, stop_token_ids=peers.end[1:]))
        ct2 = peers.translate(target_prefix=target_prefix, beam_size=width, num_hypotheses=width,
                              max_decoding_length=N, prefix_bias_beta=0.5, end_token=peers.end)
        expected = [peers.hypotheses(r) for r in ct2]
        if width == 1:
            assert_same(got, expected)
            continue
        left = [b.token_ids[:len(prefix)] != prefix for out in got for b in out.outputs]
        assert 20 <= sum(left) <= len(left) - 20  # hypotheses both follow and leave the prefix
        assert_same(got, expected, first=1)
        assert sum([b.token_ids for b in out.outputs] == [h for h, _ in hyps]
                   for out, hyps in zip(got, expected)) >= 40  # 41 of 50 with CTranslate2 4.8.5

