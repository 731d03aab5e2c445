"""A request's decoder and its logits processors, built in transformers' order.

The order is HF's, the caller's processors after the engine's and a forced EOS last (it has the last
word): penalties (repetition as early as in HF, then presence / frequency as in vLLM), n-gram and
multi-token bans (`no_repeat_ngram_size`, `bad_words_ids`: decoding/bans.py), min_new_tokens,
suppressed tokens, a catalogue, a grammar, the caller's, CTranslate2's soft prefix (`prefix_bias_beta`:
it renormalises what the others left, as CTranslate2 biases the log-softmax of its processed logits),
a forced BOS (first token), a forced EOS.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from widebeam.catalogue.constraint import CatalogueConstraint
from widebeam.catalogue.trie import Catalogue
from widebeam.decoding.alternatives import AlternativesDecoder
from widebeam.decoding.bans import BadWords, NoRepeatNGram, PrefixBias
from widebeam.decoding.decoders import BeamDecoder, SamplingDecoder
from widebeam.decoding.penalties import TokenPenalties
from widebeam.decoding.processors import (
    BanUntilMinTokens,
    ForceBOSAtStart,
    ForceEOSAtEnd,
    LogitsProcessor,
    StepProcessor,
    SuppressTokens,
)
from widebeam.params import BeamSearchParams, SamplingParams


def build_processors(params: SamplingParams | BeamSearchParams, max_new_tokens: int,
                     eos_token_ids: Iterable[int], *, suppress_token_ids: Sequence[int] = (),
                     forced_eos_token_id: int | None = None, catalogue: Catalogue | None = None,
                     grammar: StepProcessor | None = None,
                     extra_processors: Sequence[LogitsProcessor] = (),
                     forced_bos_token_id: int | None = None, soft_prefix: Sequence[int] = (),
                     ) -> list[LogitsProcessor | StepProcessor]:
    """The processors of one request, in HF's order (see the module docstring); none when nothing is on."""
    processors: list[LogitsProcessor | StepProcessor] = []
    if TokenPenalties.wanted(params.repetition_penalty, params.presence_penalty, params.frequency_penalty):
        processors.append(TokenPenalties(params.repetition_penalty, params.presence_penalty,
                                         params.frequency_penalty))
    if params.no_repeat_ngram_size:
        processors.append(NoRepeatNGram(params.no_repeat_ngram_size))
    if params.bad_words_ids:
        processors.append(BadWords(params.bad_words_ids, set(eos_token_ids) | set(params.stop_token_ids)))
    if isinstance(params, SamplingParams) and params.min_new_tokens:
        # beam search bans EOS before min_new_tokens itself, on its candidates
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        processors.append(BanUntilMinTokens(params.min_new_tokens, banned))
    if suppress_token_ids:
        processors.append(SuppressTokens(suppress_token_ids))
    if catalogue is not None:
        eos = set(params.stop_token_ids) | set(eos_token_ids)
        processors.append(CatalogueConstraint(catalogue, eos, max_new_tokens))
    if grammar is not None:
        processors.append(grammar)
    processors.extend(extra_processors)
    if soft_prefix:
        processors.append(PrefixBias(soft_prefix, params.prefix_bias_beta))
    if forced_bos_token_id is not None:
        processors.append(ForceBOSAtStart(forced_bos_token_id))
    if forced_eos_token_id is not None:
        processors.append(ForceEOSAtEnd(forced_eos_token_id, max_new_tokens))
    return processors


def build_request_decoder(params: SamplingParams | BeamSearchParams, max_new_tokens: int,
                          eos_token_ids: frozenset[int], *, prompt_token_ids: Sequence[int] = (),
                          suppress_token_ids: Sequence[int] = (),
                          forced_eos_token_id: int | None = None, catalogue: Catalogue | None = None,
                          grammar: StepProcessor | None = None,
                          extra_processors: Sequence[LogitsProcessor] = (),
                          forced_bos_token_id: int | None = None,
                          soft_prefix: Sequence[int] = ()) -> SamplingDecoder | BeamDecoder:
    """The request's decoder with its processors. `prompt_token_ids`: what the decoder starts from
    (HF's `input_ids`: the repetition penalty counts it); `grammar`: a built constraint (a JSON format's)."""
    processors = build_processors(params, max_new_tokens, eos_token_ids,
                                  suppress_token_ids=suppress_token_ids,
                                  forced_eos_token_id=forced_eos_token_id,
                                  catalogue=catalogue, grammar=grammar, extra_processors=extra_processors,
                                  forced_bos_token_id=forced_bos_token_id, soft_prefix=soft_prefix)
    decoder_class = BeamDecoder if isinstance(params, BeamSearchParams) else SamplingDecoder
    if getattr(params, "return_alternatives", False):
        decoder_class = AlternativesDecoder
    return decoder_class(params, max_new_tokens, eos_token_ids, processors, prompt_token_ids)
