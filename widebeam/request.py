"""One request's life on the KV cache: its live sequences (one, or W beams), their block tables,
and how a step's logits advance them.

A beam request's prompt is prefilled once, as one sequence. After each step the beam search picks
the next W beams as (parent, token) pairs; `_reorder` then releases the parents nobody continues,
forks the ones continued more than once, and the next step's `append_slots` copies a shared
partial block before it is written: free -> fork -> copy, so the request never holds more than its
`required_blocks`.

An encoder-decoder request's prompt is its source (`encoder_token_ids`): the engine encodes it once,
into one cross block table that every beam points at, and the decoder prompt is the decoder start token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from widebeam.beam.search import BeamSearchState
from widebeam.kv.cache import KVCache
from widebeam.kv.managers import BlockTable, CrossAttentionManager, Holding
from widebeam.model.runner import SequenceInput
from widebeam.outputs import CompletionOutput, RequestOutput
from widebeam.params import BeamSearchParams, SamplingParams
from widebeam.sampling import sample_token
from widebeam.sched.admission import Admission


@dataclass(eq=False)  # identity, not field equality: requests are looked up in queues
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    admission: Admission
    holdings: dict[str, Holding]
    eos_token_ids: frozenset[int]
    tokenizer: object | None = None
    beam: BeamSearchState | None = None
    generator: torch.Generator | None = None
    # One table per live sequence, per pool; empty until the prompt is prefilled.
    tables: dict[str, list[BlockTable]] = field(default_factory=dict)
    output_token_ids: list[int] = field(default_factory=list)  # sampling: the one sequence's tokens
    next_token_ids: list[int] = field(default_factory=list)  # what each live sequence feeds next
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    text: str = ""
    outputs: list[CompletionOutput] | None = None
    num_prefilled_tokens: int = 0
    # Encoder-decoder models: the source, and its cross table (allocated when the encoder runs).
    encoder_token_ids: list[int] | None = None
    cross_table: BlockTable | None = None
    # Tokens never generated (HF `bad_words_ids` of single tokens, e.g. Marian's pad).
    suppress_token_ids: tuple[int, ...] = ()
    # HF `forced_eos_token_id` (Marian's generation config sets it): the last allowed token is this.
    forced_eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.params, BeamSearchParams):
            self.beam = BeamSearchState(self.params, self.admission.max_new_tokens, self.eos_token_ids)
        elif self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def finished(self) -> bool:
        return self.outputs is not None

    @property
    def prompt_done(self) -> bool:
        return self.num_prefilled_tokens == len(self.prompt_token_ids)

    @property
    def num_prompt_tokens_left(self) -> int:
        return len(self.prompt_token_ids) - self.num_prefilled_tokens

    @property
    def num_live_sequences(self) -> int:
        return len(self.next_token_ids)

    def remaining_blocks(self) -> dict[str, int]:
        """Blocks this request may still take, per pool: its reservation in the scheduler.

        `Holding` counts the distinct blocks of the whole beam tree, so shared blocks count once.
        """
        return {pool: need - self.holdings[pool].num_held_blocks
                for pool, need in self.admission.required_blocks.items()}

    # -- building a step ---------------------------------------------------------------------------
    def encoder_input(self, cache: KVCache) -> tuple[list[int], list[int]] | None:
        """(source tokens, cross slots) the first time an encoder-decoder request runs: the cross
        table is allocated here, once, for every beam; None when there is nothing to encode."""
        if self.encoder_token_ids is None or self.cross_table is not None:
            return None
        name, manager = _cross_pool(cache)
        self.cross_table = manager.allocate(self.holdings[name], len(self.encoder_token_ids))
        return self.encoder_token_ids, manager.slots(self.cross_table)

    def _cross_fields(self) -> dict:
        if self.cross_table is None:
            return {}
        return {"cross_block_table": self.cross_table.block_ids, "num_encoder_tokens": self.cross_table.num_tokens}

    def prefill_input(self, cache: KVCache, num_tokens: int) -> SequenceInput:
        """The next `num_tokens` prompt tokens, as one sequence: the prompt is stored once."""
        start = self.num_prefilled_tokens
        if not self.tables:
            # the cross pool is not per beam: its one table is `cross_table`
            self.tables = {name: [manager.new_table(self.holdings[name])] for name, manager in cache.managers.items()
                           if not isinstance(manager, CrossAttentionManager)}
        slots = {name: cache[name].append_slots(tables[0], num_tokens) for name, tables in self.tables.items()}
        block_tables = {name: tables[0].block_ids for name, tables in self.tables.items()}
        self.num_prefilled_tokens += num_tokens
        return SequenceInput(self.prompt_token_ids[start:start + num_tokens], start, block_tables, slots,
                             group=self.request_id, **self._cross_fields())

    def decode_inputs(self, cache: KVCache) -> list[SequenceInput]:
        """One token per live sequence; the beams of a request form one group (shared prefix)."""
        position = len(self.prompt_token_ids) + self._num_generated() - 1
        # Every beam drops what its window left behind before any beam takes a new block.
        for name, tables in self.tables.items():
            for table in tables:
                cache[name].trim(table)
        inputs = []
        for i, token in enumerate(self.next_token_ids):
            slots = {name: cache[name].append_slots(tables[i], 1) for name, tables in self.tables.items()}
            block_tables = {name: tables[i].block_ids for name, tables in self.tables.items()}
            inputs.append(SequenceInput([token], position, block_tables, slots, group=self.request_id,
                                        **self._cross_fields()))
        return inputs

    def _num_generated(self) -> int:
        if self.beam is not None:
            return self.beam.num_generated_tokens
        return len(self.output_token_ids)

    # -- consuming a step --------------------------------------------------------------------------
    def advance(self, logits: torch.Tensor, cache: KVCache) -> None:
        """Consume this request's rows of the step's logits ([num_live, vocab], float32).

        Called after every step the request took part in; a prefill chunk that did not finish
        the prompt has no token to choose yet.
        """
        if not self.prompt_done:
            return
        if self.beam is not None:
            self._advance_beams(logits, cache)
        else:
            banned = self._ends_too_early()
            if self.suppress_token_ids or self._forcing_eos() or banned:  # as HF's processors: on the logits
                logits = self._processed(logits.clone())
                logits[:, banned] = float("-inf")
            self._advance_sample(logits[0])
        if self.finish_reason is not None or (self.beam is not None and self.beam.done):
            self.release(cache)
            self.outputs = self._completions()

    def _advance_sample(self, logits: torch.Tensor) -> None:
        params = self.params
        token, logprob = sample_token(logits, params, self.generator)
        self.output_token_ids.append(token)
        self.next_token_ids = [token]
        self.cumulative_logprob += logprob
        num_new = len(self.output_token_ids)
        if num_new > params.min_new_tokens and (
            token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos)
        ):
            self.finish_reason = "stop"
        if self.tokenizer is not None:
            self.text = self.tokenizer.decode(self.output_token_ids, skip_special_tokens=True)
            cut = _stop_string_cut(self.text, params.stop)
            if cut is not None and self.finish_reason is None:
                self.text = self.text[:cut]
                self.finish_reason = "stop"
        if self.finish_reason is None and num_new >= self.admission.max_new_tokens:
            self.finish_reason = "length"

    def _advance_beams(self, logits: torch.Tensor, cache: KVCache) -> None:
        # HF's processors run after the log-softmax in beam search: no renormalisation
        # HF's forced EOS (on the last allowed token) overrides min_new_tokens' EOS ban
        result = self.beam.step(self._processed(torch.log_softmax(logits.float(), dim=-1)),
                                mask_min_length_eos=not self._forcing_eos())
        if self.beam.done:
            return
        # free -> fork here; the copy of a shared partial block happens when the next step appends.
        for name, tables in self.tables.items():
            self.tables[name] = cache[name].reorder(tables, result.parent_indices)
        self.next_token_ids = list(result.token_ids)
        if self.params.stop and self.tokenizer is not None:
            stopped = [i for i, token_ids in enumerate(self.beam.live_token_ids)
                       if _stop_string_cut(self.tokenizer.decode(token_ids, skip_special_tokens=True),
                                           self.params.stop) is not None]
            if stopped:
                self.beam.finish_live_beams(stopped)
                keep = [i for i in range(len(self.next_token_ids)) if i not in set(stopped)]
                for name, tables in self.tables.items():
                    for i in stopped:
                        cache[name].release(tables[i])
                    self.tables[name] = [tables[i] for i in keep]
                self.next_token_ids = [self.next_token_ids[i] for i in keep]

    def _ends_too_early(self) -> list[int]:
        """Token ids a sampled sequence may not produce yet: EOS (unless ignored) and stop token ids
        while fewer than `min_new_tokens` were generated, masked as transformers and vLLM do (not
        emitted and walked past). A forced EOS on the last allowed token overrides this, as in HF."""
        params = self.params
        if self._num_generated() >= params.min_new_tokens or self._forcing_eos():
            return []
        return sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids)))

    def _forcing_eos(self) -> bool:
        return self.forced_eos_token_id is not None and self._num_generated() == self.admission.max_new_tokens - 1

    def _processed(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores [rows, vocab] with suppressed tokens at -inf and, on the last token, only the forced EOS."""
        if self.suppress_token_ids:
            scores[:, list(self.suppress_token_ids)] = float("-inf")
        if self._forcing_eos():
            scores.fill_(float("-inf"))
            scores[:, self.forced_eos_token_id] = 0.0
        return scores

    def release(self, cache: KVCache) -> None:
        """Give back every block; safe to call twice (abort after finish)."""
        for name, tables in self.tables.items():
            for table in tables:
                if not table.released:
                    cache[name].release(table)
        if self.cross_table is not None and not self.cross_table.released:
            _cross_pool(cache)[1].release(self.cross_table)

    # -- results -----------------------------------------------------------------------------------
    def _completions(self) -> list[CompletionOutput]:
        if self.beam is None:
            return [CompletionOutput(0, self.text, list(self.output_token_ids), self.cumulative_logprob,
                                     self.finish_reason)]
        completions = []
        for index, hyp in enumerate(self.beam.finalize()):
            text = ""
            if self.tokenizer is not None:
                text = self.tokenizer.decode(hyp.token_ids, skip_special_tokens=True)
                cut = _stop_string_cut(text, self.params.stop)
                if cut is not None:
                    text = text[:cut]
            completions.append(CompletionOutput(index, text, list(hyp.token_ids), hyp.cumulative_logprob,
                                                hyp.finish_reason, hyp.score))
        return completions

    def partial_output(self) -> RequestOutput:
        """What the request has produced so far; for beam search, nothing until it finishes."""
        if self.finished:
            return self.output()
        completions = []
        if self.beam is None and self.output_token_ids:
            completions = [CompletionOutput(0, self.text, list(self.output_token_ids), self.cumulative_logprob, None)]
        return RequestOutput(self.request_id, self.prompt, self.source_token_ids, completions, False)

    @property
    def source_token_ids(self) -> list[int]:
        """What the user sent: the source of an encoder-decoder request, else the prompt."""
        return self.prompt_token_ids if self.encoder_token_ids is None else self.encoder_token_ids

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.source_token_ids, list(self.outputs or []),
                             self.finished,
                             peak_blocks={name: h.peak_held_blocks for name, h in self.holdings.items()},
                             required_blocks=dict(self.admission.required_blocks))


def _cross_pool(cache: KVCache) -> tuple[str, CrossAttentionManager]:
    for name, manager in cache.managers.items():
        if isinstance(manager, CrossAttentionManager):
            return name, manager
    raise ValueError("an encoder-decoder request needs a cross-attention pool")


def _stop_string_cut(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the earliest stop string starts in `text`, or None."""
    positions = [text.find(s) for s in stops if s in text]
    return min(positions) if positions else None
