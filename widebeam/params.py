"""Request parameters: what a request asks for (frozen dataclasses). Their checks live in
param_checks.py; each names the field and its allowed range."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Self

from widebeam.param_checks import (  # noqa: F401  (constants re-exported: callers read them here)
    DEFAULT_BEAM_WIDTH,
    GREEDY_TEMPERATURE,
    MAX_ABS_LENGTH_PENALTY,
    MAX_ABS_PRESENCE_FREQUENCY_PENALTY,
    MAX_DIVERSITY_PENALTY,
    MAX_LOGPROBS,
    MAX_PATIENCE,
    MAX_REPETITION_PENALTY,
    MAX_SCHEDULE_WIDTH,
    MIN_REPETITION_PENALTY,
    as_float,
    as_tuple,
    check_bans,
    check_combinations,
    check_decoder_start,
    check_groups,
    check_item_filters,
    check_logprobs,
    check_max_input_length,
    check_penalties,
    check_response_format,
    check_schedule,
    check_stop_token_ids,
    is_int,
    is_number,
    require,
)
from widebeam.response_format import schema_of


@dataclass(frozen=True, kw_only=True)
class DecodingParams:
    """The fields sampling and beam search share, written once. Each subclass adds its own and checks
    all of them in its `__post_init__` (in its own order: which error comes first is the subclass's).
    Keyword-only: the shared fields come first in the field order, so a positional argument would not
    mean what it meant when each class listed all of its fields."""

    # None: up to the engine's `max_seq_len` minus the prompt.
    max_new_tokens: int | None = 16
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Log-probs (widebeam/logprobs.py): None = off, k = each token's log-prob and the k most likely
    # alternatives (per beam: its parent's at that step); `prompt_logprobs` the same for every prompt
    # token (computed in the prefill).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Encoder-decoder models: the decoder starts from these tokens after its start token (NLLB's target
    # language, a T5 task prefix, a forced partial translation): its prompt, never scored nor returned.
    # Decoder-only models refuse it at admission (put the tokens in the prompt), as they refuse
    # forced_bos_token_id, except as beam search's soft prefix (prefix_bias_beta), generated under a
    # bias. Text is tokenized without special tokens.
    decoder_prefix: tuple[int, ...] | str = ()
    # HF `forced_bos_token_id`: the first generated token (mBART-50 / NLLB target language), scored 0.
    # None: the model's generation config's. Only without a decoder_prefix, as in HF.
    forced_bos_token_id: int | None = None
    # Bans read each row's history (decoding/bans.py, transformers' semantics): no n-gram of this many
    # tokens twice (0 = off); token sequences never generated (the last token of one is banned where the
    # rest was just generated).
    no_repeat_ngram_size: int = 0
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    # Truncate the prompt to this many tokens instead of refusing it (None = off): an encoder-decoder's
    # source keeps its first tokens (CTranslate2's max_input_length), a decoder-only prompt its last.
    max_input_length: int | None = None
    # Structured output: OpenAI's response_format (widebeam/structured/: JSON mode, JSON schema); with
    # beams, every beam stays inside the grammar, its matcher forked with the beam.
    response_format: object = field(default=None, compare=False)
    # Scheduling priority, vLLM's semantics: lower is served first (ties in arrival order); a request may
    # be overtaken only so often (sched/scheduler.py: MAX_OVERTAKES). It changes when a request runs, never
    # what it outputs.
    priority: int = 0

    def __post_init__(self) -> None:
        as_tuple(self, "stop", str)
        as_tuple(self, "stop_token_ids", int)
        require(is_int(self.priority), "priority", "must be an integer, got {value!r}", value=self.priority)

    def replace(self, **changes) -> Self:
        """A copy with `changes` applied, checked as a new one."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return type(self)(**values)


@dataclass(frozen=True, kw_only=True)
class SamplingParams(DecodingParams):
    """Greedy (`temperature=0`) or sampled decoding of one sequence.

    `max_new_tokens=None` means up to the engine's `max_seq_len` minus the prompt.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.max_new_tokens is None or (is_int(self.max_new_tokens) and self.max_new_tokens >= 1),
                 "max_new_tokens", "must be an integer >= 1 or None, got {value!r}",
                 value=self.max_new_tokens)
        require(is_number(self.temperature) and 0 <= self.temperature < math.inf, "temperature",
                 "must be a finite number >= 0, got {value!r}", value=self.temperature)
        as_float(self, "temperature")
        require(is_int(self.top_k) and self.top_k >= -1, "top_k",
                 "must be -1 or 0 (off) or a positive integer, got {value!r}", value=self.top_k)
        require(is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1], got {value!r}",
                 value=self.top_p)
        require(self.seed is None or (is_int(self.seed) and -2**63 <= self.seed < 2**64), "seed",
                 "must be an integer in [-2**63, 2**64) (torch's seeds) or None, got {value!r}",
                 value=self.seed)
        require(isinstance(self.ignore_eos, bool), "ignore_eos", "must be true or false, got {value!r}",
                 value=self.ignore_eos)
        require(is_int(self.min_new_tokens) and self.min_new_tokens >= 0, "min_new_tokens",
                 "must be an integer >= 0, got {value!r}", value=self.min_new_tokens)
        require(self.max_new_tokens is None or self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
                 "must be <= {max_new_tokens} ({limit}), got {value}", limit=self.max_new_tokens,
                 value=self.min_new_tokens)
        require(all(s for s in self.stop), "stop", "must not contain empty strings")
        check_stop_token_ids(self.stop_token_ids)
        check_penalties(self)
        check_logprobs(self)
        check_response_format(self)
        check_decoder_start(self)
        check_bans(self)
        check_max_input_length(self)
        check_combinations(self)

    @property
    def greedy(self) -> bool:
        # dividing logits by a temperature this small overflows float32: it is greedy in effect
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def beam_width(self) -> int:
        return 1


@dataclass(frozen=True, kw_only=True)
class BeamSearchParams(DecodingParams):
    """Deterministic beam search over `beam_width` beams, scored like Hugging Face `generate(num_beams=...)`.

    A finished hypothesis scores `cumulative_logprob / generated_len ** length_penalty`, where
    `generated_len` counts the generated tokens including the final end-of-sequence token.
    The search ends at `max_new_tokens`, or earlier once `beam_width` hypotheses are finished and
    `early_stopping` is True, or (False, and "never") the best live beam cannot beat the worst of them,
    scored at its current length (False) or, when `length_penalty > 0`, at `max_new_tokens` ("never").
    `beam_width=1` is greedy decoding, as in HF: the first end-of-sequence token ends it.
    `num_return_sequences=None` returns `beam_width` hypotheses.
    `max_new_tokens=None` means up to the engine's `max_seq_len` minus the prompt (with a catalogue:
    its longest item plus the end-of-sequence token).

    Catalogue-constrained search (generative retrieval): `catalogue` names one registered with
    `LLM.register_catalogue`, or `allowed_sequences` gives the items inline (token-id sequences, or a
    built `widebeam.catalogue.trie.Catalogue`). Every beam stays inside it; a beam finishes with an
    end-of-sequence token right after a complete item (the returned token ids are the item + EOS), and
    fewer than `num_return_sequences` come back when fewer items are reachable, never an invalid one.
    `stop` and `stop_token_ids` are refused with a catalogue (a stop could end a beam inside an item);
    the engine refuses, at admission, a `max_new_tokens` below the shortest item + EOS and a
    `min_new_tokens` past the longest item (either could only return nothing).

    Beam-width schedules (docs/generative-retrieval-schedules.md): `beam_width_schedule=[w1, w2, ...]`
    searches step k (the k-th generated token) with w_k beams, the last width repeating; any
    direction, at most `max_new_tokens` entries. `beam_width` becomes the widest step (what the
    engine's `max_beam_width` bounds); the finished hypotheses kept, the stopping rule and
    `num_return_sequences` (default: all) follow the final width.
    """

    # None: not given, resolved in __post_init__ to the schedule's widest step or DEFAULT_BEAM_WIDTH (an
    # int after construction, always); a given width beside a schedule must be its widest step.
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int | None = None
    catalogue: str | None = None
    allowed_sequences: object = field(default=None, compare=False, repr=False)
    # CTranslate2's patience (arXiv 2204.05424): the search keeps round(beam_width * patience) finished
    # hypotheses and stops only once that many finished (1.0: transformers' search, unchanged).
    patience: float = 1.0
    # CTranslate2's soft target prefix: with beta in (0, 1) the decoder_prefix is not given but favoured,
    # step t's distribution becoming (1 - beta) p + beta onehot(prefix[t]) (0 = off: a hard prefix).
    prefix_bias_beta: float = 0.0
    # CTranslate2's return_alternatives (decoding/alternatives.py): the beam_width most likely tokens at the
    # first free position (after the decoder prefix), those of probability >= min_alternative_expansion_prob
    # (the best always), each continued greedily; returned in the order of that token's probability.
    return_alternatives: bool = False
    min_alternative_expansion_prob: float = 0.0
    # The search tree (widebeam/beam/tree.py, docs/ui.md): every candidate each step kept, returned in
    # `RequestOutput.tree`. Off by default; its memory is counted, not capped: at most 2 x beam_width x
    # max_new_tokens nodes of 26 bytes (200 more per finished one) while searching (`tree["nbytes"]`),
    # more as JSON (docs/ui.md: W=1024, N=8).
    return_tree: bool = False
    # Per-step widths (w_1, ..., w_L); None: `beam_width` at every step.
    beam_width_schedule: tuple[int, ...] | None = None
    # Per-request item filters over the catalogue (catalogue/filters.py): item indices (the i-th item
    # given when it was built), or a subset registered beside it; stored as int64 arrays.
    allowed_items: object = field(default=None, compare=False, repr=False)
    excluded_items: object = field(default=None, compare=False, repr=False)
    catalogue_subset: str | None = None
    # Group (diverse) beam search, transformers 4.46's `_group_beam_search` (widebeam/beam/group.py):
    # `beam_width` beams in `num_beam_groups` groups, each penalised by `diversity_penalty` per
    # earlier group's beam that chose the same token at the same step.
    num_beam_groups: int = 1
    diversity_penalty: float = 0.0

    @property
    def constrained(self) -> bool:
        return self.catalogue is not None or self.allowed_sequences is not None

    def __post_init__(self) -> None:
        super().__post_init__()
        # what the caller gave, before None is resolved: `replace` re-resolves only what was not given
        object.__setattr__(self, "_given", frozenset(name for name in ("beam_width", "num_return_sequences")
                                                     if getattr(self, name) is not None))
        require(self.beam_width is None or (is_int(self.beam_width) and self.beam_width >= 1), "beam_width",
                 "must be an integer >= 1 (or None: the schedule's widest step, else "
                 f"{DEFAULT_BEAM_WIDTH}), got {{value!r}}", value=self.beam_width)
        check_schedule(self)
        if self.beam_width is None:
            object.__setattr__(self, "beam_width", DEFAULT_BEAM_WIDTH)
        check_item_filters(self)
        check_groups(self)
        require(self.catalogue is None or (isinstance(self.catalogue, str) and bool(self.catalogue)),
                 "catalogue",
                 "must be the name of a registered catalogue, got {value!r}", value=self.catalogue)
        require(self.catalogue is None or self.allowed_sequences is None, "allowed_sequences",
                 "and {catalogue} exclude each other: give one")
        require(not (self.constrained and self.ignore_eos), "ignore_eos",
                 "must be false with a catalogue: a beam ends its item with the end-of-sequence token")
        require(self.max_new_tokens is None or (isinstance(self.max_new_tokens, int)
                                                 and not isinstance(self.max_new_tokens, bool)
                                                 and self.max_new_tokens >= 1),
                 "max_new_tokens", "must be an integer >= 1 or None, got {value!r}",
                 value=self.max_new_tokens)
        require(isinstance(self.length_penalty, (int, float)) and not isinstance(self.length_penalty, bool)
                 and abs(self.length_penalty) <= MAX_ABS_LENGTH_PENALTY
                 and math.isfinite(self.length_penalty),
                 "length_penalty",
                 "must be a finite number in [-{limit}, {limit}] (> 0 favours longer hypotheses), "
                 "got {value!r}", limit=MAX_ABS_LENGTH_PENALTY, value=self.length_penalty)
        require(self.early_stopping is True or self.early_stopping is False
                 or (isinstance(self.early_stopping, str) and self.early_stopping == "never"),
                 "early_stopping", "must be True, False or \"never\", got {value!r}",
                 value=self.early_stopping)
        if self.num_return_sequences is None:
            object.__setattr__(self, "num_return_sequences", self.final_beam_width)
        num_return = self.num_return_sequences
        width_name = "{beam_width_schedule}'s final width" if self.beam_width_schedule else "{beam_width}"
        require(isinstance(num_return, int) and not isinstance(num_return, bool)
                 and 1 <= num_return <= self.final_beam_width, "num_return_sequences",
                 "must be an integer in [1, " + width_name + "={width}] or None, got {value!r}",
                 width=self.final_beam_width, value=self.num_return_sequences)
        require(isinstance(self.min_new_tokens, int) and not isinstance(self.min_new_tokens, bool)
                 and self.min_new_tokens >= 0, "min_new_tokens",
                 "must be an integer >= 0, got {value!r}", value=self.min_new_tokens)
        require(self.max_new_tokens is None or self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
                 "must be <= {max_new_tokens} ({limit}), got {value}", limit=self.max_new_tokens,
                 value=self.min_new_tokens)
        check_stop_token_ids(self.stop_token_ids)
        require(all(s for s in self.stop), "stop", "must not contain empty strings")
        require(isinstance(self.ignore_eos, bool), "ignore_eos", "must be true or false, got {value!r}",
                 value=self.ignore_eos)
        require(isinstance(self.return_tree, bool), "return_tree", "must be true or false, got {value!r}",
                 value=self.return_tree)
        check_penalties(self)
        check_logprobs(self)
        check_response_format(self)
        require(is_number(self.patience) and 1.0 <= self.patience <= MAX_PATIENCE, "patience",
                 "must be a number in [1, {limit}] (1 = off), got {value!r}", limit=MAX_PATIENCE,
                 value=self.patience)
        as_float(self, "patience")
        require(is_number(self.prefix_bias_beta) and 0.0 <= self.prefix_bias_beta < 1.0, "prefix_bias_beta",
                 "must be a number in [0, 1) (0 = off), got {value!r}", value=self.prefix_bias_beta)
        as_float(self, "prefix_bias_beta")
        require(isinstance(self.return_alternatives, bool), "return_alternatives",
                 "must be true or false, got {value!r}", value=self.return_alternatives)
        threshold = self.min_alternative_expansion_prob
        require(is_number(threshold) and 0.0 <= threshold <= 1.0, "min_alternative_expansion_prob",
                 "must be a probability in [0, 1], got {value!r}", value=threshold)
        as_float(self, "min_alternative_expansion_prob")
        check_decoder_start(self)
        check_bans(self)
        check_max_input_length(self)
        check_combinations(self)
        require(not (self.constrained and schema_of(self.response_format) is not None), "response_format",
                 "and {catalogue} exclude each other: a catalogue already fixes every beam's tokens")
        if self.constrained:
            # A stop string or stop token can end a beam inside an item ("yoga" of "yoga mat"), and a
            # catalogue promises whole items only: refused rather than filtered, so nothing is lost silently.
            constraint = "catalogue" if self.catalogue is not None else "allowed_sequences"
            for name in ("stop", "stop_token_ids"):
                require(not getattr(self, name), name,
                         "and {" + constraint + "} exclude each other: a stop could end a beam inside an "
                         "item, and every returned sequence must be a whole item (the end-of-sequence "
                         "token ends each); drop {" + name + "}")

    @property
    def final_beam_width(self) -> int:
        """The width of the last steps: the schedule's last entry, else `beam_width`."""
        return self.beam_width_schedule[-1] if self.beam_width_schedule else self.beam_width

    def width_at_step(self, step: int) -> int:
        """The width of step `step` >= 1 (the step choosing the step-th generated token)."""
        if not self.beam_width_schedule:
            return self.beam_width
        return self.beam_width_schedule[min(step, len(self.beam_width_schedule)) - 1]

    def replace(self, **changes) -> BeamSearchParams:
        """A copy with `changes` applied. What was not given (None: all beams returned, the schedule's
        widest step or the default width) follows a changed `beam_width` or schedule; what was given
        stays, and is checked against the change."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if {"beam_width", "beam_width_schedule"} & changes.keys():
            for name in ("num_return_sequences", "beam_width"):
                if name not in self._given:
                    values[name] = None
        if changes.get("beam_width_schedule") is not None and "beam_width" not in changes:
            values["beam_width"] = None  # the new schedule's widest step
        values.update(changes)
        return type(self)(**values)

