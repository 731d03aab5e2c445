"""A request's KV need, decided before anything is queued: the engine admits with it, the router
places with it.

`RequestSizer.size` is the part of `LLMEngine.add_request` that reads no model: the params checked
against the engine's limits, the prompt tokenized and split as the engine runs it, a catalogue's
default length, the bans, and admission's exact per-pool bound (sched/admission.py) against a
`KVCache` of the engine's layout. The engine calls it for every request; the Ray router's ingress
(server/router_ingress.py) builds one from a replica's `sizing_spec` and a `KVCache` of the same
pools (counts only, no tensors), so the blocks it places a request by are the blocks the replica
admits it with. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, replace

from widebeam.errors import InvalidParameterError
from widebeam.kv.cache import KVCache
from widebeam.kv.prefix import PrefixKey
from widebeam.param_checks import check_bans_leave_a_token
from widebeam.prompts import PreparedPrompt, PromptRules, prepare_prompt
from widebeam.request_checks import check_request
from widebeam.sched.admission import Admission, admit_check
from widebeam.score_params import ScoreParams


class UnsizedRequestError(InvalidParameterError):
    """The sizer cannot bound this request where it runs (a catalogue lives on the replicas only):
    the caller routes it without a bound and lets the engine decide."""


@dataclass(frozen=True)
class SizedRequest:
    params: object  # as the engine runs them (a catalogue's default length filled in)
    prepared: PreparedPrompt
    admission: Admission
    catalogue: object | None
    key: PrefixKey | None  # the prompt's prefix-cache key, None when the request does not use the cache

    @property
    def required_blocks(self) -> dict[str, int]:
        return self.admission.required_blocks


@dataclass
class RequestSizer:
    cache: KVCache
    prompt_rules: PromptRules
    eos_token_ids: Sequence[int]
    suppress_token_ids: Sequence[int]
    max_seq_len: int
    max_encoder_tokens: int
    max_beam_width: int
    num_draft_tokens: int = 0
    # a preempted request may resume by re-feeding every beam (a schedule's bound counts that)
    preempts: bool = False
    # the catalogue registry's `fit_request`; None where no catalogue is held (the router's ingress)
    fit_request: Callable | None = None

    def for_router(self) -> RequestSizer:
        """A copy for the router's ingress, safe to pickle: no catalogue (their requests are sized by the
        replica), and a counting copy of the pools (`KVCache.counting_copy`: same bounds, pins held)."""
        return replace(self, cache=self.cache.counting_copy(), fit_request=None)

    @property
    def vocab_size(self) -> int:
        return self.prompt_rules.vocab_size

    def size(self, request_id: str, prompt, params, logits_processors: Sequence = (), *,
             ids_in_use: Container[str] = ()) -> SizedRequest:
        """The request as the engine runs it and its exact per-pool bound; raises `InvalidParameterError`
        (a `RequestTooLargeError` when it can never fit) naming what is wrong. Nothing is allocated."""
        params = check_request(request_id, params, logits_processors, ids_in_use=ids_in_use,
                               max_beam_width=self.max_beam_width, tokenizer=self.prompt_rules.tokenizer,
                               speculative=bool(self.num_draft_tokens), vocab_size=self.vocab_size)
        catalogue = None
        if self.fit_request is not None:
            catalogue, params = self.fit_request(params)
        elif getattr(params, "constrained", False):
            raise UnsizedRequestError("catalogue", "a catalogue-constrained request is sized by the replica")
        prepared = prepare_prompt(prompt, params, self.prompt_rules)
        if not isinstance(params, ScoreParams):  # bans that leave the first step no token: a 400
            check_bans_leave_a_token(params, self.vocab_size, self.eos_token_ids, self.suppress_token_ids)
        token_ids, encoder_token_ids = prepared.token_ids, prepared.encoder_token_ids
        # prompt log-probs compute every token: no prefix reuse for them
        caching = self.cache.enable_prefix_caching and params.prompt_logprobs is None
        key = self.cache.prefix_key(token_ids, encoder_token_ids) if caching else None
        admission = admit_check(self.cache, self.max_seq_len, len(token_ids), params.max_new_tokens,
                                params.beam_width, encoder_tokens=len(encoder_token_ids or ()),
                                max_encoder_tokens=self.max_encoder_tokens,
                                extra_tokens=self.num_draft_tokens, refeed_tokens=self.num_draft_tokens,
                                key=key,
                                beam_width_schedule=getattr(params, "beam_width_schedule", None) or (),
                                refeeds_after_preemption=self.preempts)
        return SizedRequest(params, prepared, admission, catalogue, key)
