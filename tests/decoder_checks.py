"""A request's decoder as an engine builds it (its EOS ids, suppressed tokens and forced EOS), for
tests that look at the processors of a decoder without running a request."""

from __future__ import annotations

from widebeam.decoder_factory import build_request_decoder


def engine_decoder(engine, params, max_new_tokens: int, prompt_token_ids=()):
    return build_request_decoder(params, max_new_tokens, engine.eos_token_ids,
                                 prompt_token_ids=prompt_token_ids,
                                 suppress_token_ids=engine.suppress_token_ids,
                                 forced_eos_token_id=engine.forced_eos_token_id)
