"""The two decoders behind one interface: `advance(logits) -> Advance(parents, tokens)`.

A decoder owns a request's token choice and nothing else: it sees its rows of a step's float32
logits (one row per live sequence), runs its logits processors, and says which live sequence each
next sequence continues and with which token. The request applies that to its KV (`reorder`) and
its output; a finished decoder says so with `done`.

A decoder with processors owns one history of its live sequences (decoding/context.py) and moves it
with each step's choice (and the rows that finish on a stop string); each step its processors get a
`StepContext` over it. The request sees the same surface on both decoders: `advance`,
`num_generated_tokens`, `live_token_ids`, `stop`, `done`, `batched_greedy`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from widebeam.beam.group import GroupBeamSearchState
from widebeam.beam.search import BANNED, BeamSearchState, Hypothesis
from widebeam.decoding.context import StepContext, TokenHistory, drop_rows
from widebeam.decoding.logprobs import PromptLogprobs, token_logprobs
from widebeam.decoding.processors import (
    LogitsProcessor,
    StepProcessor,
    allowed_pairs,
    apply_processors,
    forcing_eos,
    step_processors,
)
from widebeam.logprobs import TokenLogprobs
from widebeam.params import BeamSearchParams, SamplingParams
from widebeam.sampling import verify_draft_token


class RowScores:
    """One request's rows of a step: logits [rows, vocab] (float32), their log-softmax when someone
    reads it (computed once, on first read: a beam search without processors ranks the logits
    themselves and never needs it whole), and for a batched greedy request its argmax token and
    that token's log-prob, read once for the batch."""

    def __init__(self, logits: torch.Tensor, logprobs: torch.Tensor | None = None,
                 greedy: tuple[int, float] | None = None):
        self.logits = logits
        self._logprobs = logprobs
        self.greedy = greedy

    @property
    def logprobs(self) -> torch.Tensor:
        if self._logprobs is None:
            self._logprobs = torch.log_softmax(self.logits, dim=-1)
        return self._logprobs

    @property
    def has_logprobs(self) -> bool:
        """Whether the log-softmax was already computed (then ranking it costs no more than the logits)."""
        return self._logprobs is not None


class StepScores:
    """A step's float32 logits for every request, with what several decoders need computed once
    over all rows: the argmax of every greedy request without logits processors and its log-prob
    (one host read for all of them instead of one per request). The log-softmax is per request and
    only where read (`RowScores.logprobs`): its values per row are the whole tensor's, bit for bit.
    Beam top-k stays per request: widths and candidate counts differ, and one request's top-k
    already spans its beams."""

    def __init__(self, logits: torch.Tensor, greedy_rows: Sequence[int] = ()):
        self.logits = logits
        self.greedy: dict[int, tuple[int, float]] = {}
        if greedy_rows:
            rows = torch.tensor(list(greedy_rows), device=logits.device)
            greedy_logits = logits.index_select(0, rows)  # [num_greedy, vocab]
            tokens = greedy_logits.argmax(dim=-1)
            logprobs = torch.log_softmax(greedy_logits, dim=-1).gather(1, tokens[:, None])[:, 0]
            self.greedy = dict(zip(greedy_rows, zip(tokens.tolist(), logprobs.tolist())))

    def select(self, rows: Sequence[int]) -> RowScores:
        """These rows (a request's sequences, in order); a view when they are contiguous, as they
        are for a step without drafts."""
        start = rows[0]
        if list(rows) == list(range(start, start + len(rows))):
            logits = self.logits[start:start + len(rows)]
        else:
            logits = self.logits.index_select(0, torch.tensor(list(rows), device=self.logits.device))
        return RowScores(logits, greedy=self.greedy.get(start) if len(rows) == 1 else None)


def any_token_left(scores: torch.Tensor) -> list[bool]:
    """Per row of processed scores [rows, vocab]: whether any token is still allowed (a score above
    -inf; a nan row, from a log-softmax of nothing, allows none). One host read."""
    return (scores > float("-inf")).any(dim=-1).tolist()


@dataclass(frozen=True)
class Advance:
    """Sequence i of the next step continues live sequence `parent_indices[i]` with `token_ids[i]`."""

    parent_indices: list[int]
    token_ids: list[int]


def _prompt_logprobs(params, prompt_token_ids: Sequence[int]) -> PromptLogprobs | None:
    """The collector the step fills during the prefill (`worker.py: execute_step`), if asked for."""
    if params.prompt_logprobs is None:
        return None
    return PromptLogprobs(prompt_token_ids, params.prompt_logprobs)


class SamplingDecoder:
    """Greedy or sampled decoding of one sequence. With `params.logprobs`, `logprobs` holds one entry
    per generated token (widebeam/logprobs.py: the raw log-softmax of the row that chose it)."""

    def __init__(self, params: SamplingParams, max_new_tokens: int, eos_token_ids: frozenset[int],
                 processors: Sequence[LogitsProcessor | StepProcessor],
                 prompt_token_ids: Sequence[int] = ()):
        self.params = params
        self.max_new_tokens = max_new_tokens
        self.eos_token_ids = eos_token_ids
        self.processors = step_processors(processors)
        # Without processors nobody reads a history: none is kept (the batched greedy path stays bare).
        self.history = TokenHistory(prompt_token_ids) if self.processors else None
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.token_ids: list[int] = []
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprobs] | None = None if params.logprobs is None else []
        self.prompt_logprobs = _prompt_logprobs(params, prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def live_token_ids(self) -> list[list[int]]:
        """Each live sequence's generated tokens: the one sequence's."""
        return [self.token_ids]

    @property
    def batched_greedy(self) -> bool:
        """Whether the step may choose this request's token in the batch (greedy, nothing to edit)."""
        return self.params.greedy and not self.processors

    def advance(self, scores: RowScores, drafted: Sequence[Sequence[int]] = ()) -> Advance:
        """One row -> the next token; sets `finish_reason` on a stop token or the length limit.
        `drafted`: the tokens drafted after the row (a chain: at most one), verified by speculative
        rejection sampling (`verify_draft_token`), so the token's distribution is the same with or
        without a draft: speculation changes speed, not output."""
        draft_token = drafted[0][0] if drafted and drafted[0] else None
        if scores.greedy is not None:  # chosen in the batch: the argmax a verification would take
            token, logprob = scores.greedy
            return self._record(token, logprob, scores)
        logits = scores.logits
        if self.processors:  # as HF's processors: on the logits, before sampling
            logits = apply_processors(self.processors, logits.clone(), self._context(scores))
            if not any_token_left(logits)[0]:
                # nothing left to take: end here, never a banned token (argmax of -inf) nor nan
                # probabilities
                self.finish_reason = BANNED
                return Advance([], [])
        token, logprob, _ = verify_draft_token(logits[0], self.params, self.generator, draft_token,
                                               None if self.processors else scores.logprobs[0])
        return self._record(token, logprob, scores)

    def _context(self, scores: RowScores) -> StepContext:
        return self.history.context(1, self.num_generated_tokens, scores.logits.device)

    def _record(self, token: int, logprob: float, scores: RowScores) -> Advance:
        if self.logprobs is not None:
            self.logprobs.extend(token_logprobs(scores.logprobs, [0], [token], self.params.logprobs))
        self.token_ids.append(token)
        if self.history is not None:
            self.history.move([0], [token])
        self.cumulative_logprob += logprob
        params = self.params
        if self.num_generated_tokens > params.min_new_tokens and (
            token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos)
        ):
            self.finish_reason = "stop"
        elif self.num_generated_tokens >= self.max_new_tokens:
            self.finish_reason = "length"
        return Advance([0], [token])

    def stop(self, seq_indices: Sequence[int] = (0,)) -> None:
        """The text hit a stop string (the one live sequence, 0, finishes)."""
        if 0 in seq_indices:
            self.finish_reason = "stop"


class BeamDecoder:
    """Beam search (transformers-exact, see beam/search.py) over the request's live beams. With
    `params.logprobs`, each hypothesis' `annotations` are its tokens' log-prob entries: the raw
    log-softmax of its parent's row at each step (widebeam/logprobs.py)."""

    def __init__(self, params: BeamSearchParams, max_new_tokens: int, eos_token_ids: frozenset[int],
                 processors: Sequence[LogitsProcessor | StepProcessor],
                 prompt_token_ids: Sequence[int] = ()):
        self.params = params
        self.processors = step_processors(processors)
        self.history = TokenHistory(prompt_token_ids) if self.processors else None
        # groups of diverse beams (transformers 4.46's group beam search) or one search
        search_class = GroupBeamSearchState if params.num_beam_groups > 1 else BeamSearchState
        self.search = search_class(params, max_new_tokens, eos_token_ids)
        self.prompt_logprobs = _prompt_logprobs(params, prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return self.search.num_generated_tokens

    @property
    def tree(self):
        """The search tree (`return_tree`: beam/tree.py's `SearchTree`), or None."""
        return self.search.tree

    @property
    def done(self) -> bool:
        return self.search.done

    @property
    def batched_greedy(self) -> bool:
        """Never: beam search ranks its own candidates (see `SamplingDecoder.batched_greedy`)."""
        return False

    @property
    def live_token_ids(self) -> list[list[int]]:
        """Each live beam's generated tokens, in the order of the next step's rows."""
        return self.search.live_token_ids

    def advance(self, scores: RowScores, drafted: Sequence[Sequence[int]] = ()) -> Advance:
        """One row per live beam -> the next live beams (none when the search ended). Drafts
        change nothing: the step is exact on the target's scores, inside a drafted tree or not."""
        num_generated = self.num_generated_tokens
        annotate = None
        if self.params.logprobs is not None:
            raw, num_top = scores.logprobs, self.params.logprobs
            annotate = lambda rows, tokens: token_logprobs(raw, rows, tokens, num_top)
        context = None
        if self.processors:
            context = self.history.context(scores.logits.shape[0], num_generated, scores.logits.device)
        allowed = allowed_pairs(self.processors, context) if context is not None else None
        if allowed is not None:
            # A processor alone offers the only pairs it allows (a catalogue): rank just those, no
            # masked copy of the rows.
            result = self.search.step(scores.logprobs, allowed=allowed, annotate=annotate)
        else:
            # HF's processors run after the log-softmax in beam search: no renormalisation. A forced
            # EOS (the last allowed token) overrides min_new_tokens' EOS ban, as in HF.
            normalize = False
            if self.processors and self.params.beam_width == 1:
                # W=1 is HF's greedy search, whose processors see the logits (a repetition penalty
                # divides or multiplies those); the log-softmax after them leaves the choice HF's and
                # makes the score the log-prob of the distribution chosen from, as SamplingDecoder's.
                logits = apply_processors(self.processors, scores.logits.clone(), context)
                # (a row with every token banned turns nan here: the search reads it as allowing nothing)
                ranked = torch.log_softmax(logits, dim=-1)
            elif self.processors:
                ranked = apply_processors(self.processors, scores.logprobs.clone(), context)
            elif scores.has_logprobs:  # already written (logprobs asked for): ranking it is free
                ranked = scores.logprobs
            else:  # the search ranks the logits' log-softmax without writing it whole
                ranked, normalize = scores.logits, True
            forced = context is not None and forcing_eos(self.processors, context)
            result = self.search.step(ranked, mask_min_length_eos=not forced, annotate=annotate,
                                      normalize=normalize)
        if self.history is not None:  # the one history follows the beams
            self.history.move(result.parent_indices, result.token_ids)
        return Advance(list(result.parent_indices), list(result.token_ids))

    def stop(self, seq_indices: Sequence[int] | None = None) -> None:
        """These live beams' text hit a stop string (None: every live beam): they finish now, the
        others renumber in order."""
        num_live = self.search.num_live_beams
        if seq_indices is None:
            seq_indices = range(num_live)
        seq_indices = list(seq_indices)
        self.search.finish_live_beams(seq_indices)
        if self.history is not None:
            self.history.keep(drop_rows(num_live, seq_indices))

    def finalize(self) -> list[Hypothesis]:
        return self.search.finalize()
