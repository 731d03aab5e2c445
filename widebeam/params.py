"""Request parameters. Validation errors name the field and its allowed range."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from widebeam.errors import InvalidParameterError
from widebeam.structured.formats import schema_of

GREEDY_TEMPERATURE = 1e-5  # below this, sampling is argmax
# Scores divide by generated_len ** length_penalty: within this range they stay finite for any length
# an engine allows (float64 up to 2**1024 > (2**20) ** 10), where HF's own arithmetic overflows beyond it.
MAX_ABS_LENGTH_PENALTY = 10.0
# patience keeps round(beam_width * patience) finished hypotheses: a bound keeps that list small
MAX_PATIENCE = 16.0


def _check_response_format(params) -> None:
    """The format's shape and caps (structured/formats.py), and the options a grammar cannot honour:
    the grammar allows the end-of-sequence token only once the JSON value is complete and nothing after
    it, so generating past it (`ignore_eos`) or withholding it for a minimum count (`min_new_tokens`,
    which may exceed the value's length) has no valid continuation."""
    if schema_of(params.response_format) is None:
        return
    _require(not params.ignore_eos, "ignore_eos", "and {response_format} exclude each other: the output "
             "ends where the JSON value does")
    _require(not params.min_new_tokens, "min_new_tokens", "and {response_format} exclude each other: the "
             "output ends where the JSON value does, which may come before {min_new_tokens} tokens")


def _require(condition: bool, param: str, message: str, **values) -> None:
    """Raise `InvalidParameterError` for `param` unless `condition`. `message` follows the parameter's
    name and is a template (see `widebeam.errors`): other parameters in braces, the offending value as
    `{value!r}` from `values`, so a caller can render the message with its own parameter names."""
    if not condition:
        raise InvalidParameterError(param, "{" + param + "} " + message, **values)


def _as_tuple(params, name: str, kind: type) -> None:
    value = getattr(params, name)
    if value is None:
        value = ()
    elif isinstance(value, (str, int)):
        value = (value,)
    elif not isinstance(value, (list, tuple)):
        raise InvalidParameterError(name, "{" + name + "} must be a list of " + kind.__name__
                                    + " values, got {value!r}", value=value)
    value = tuple(value)
    for item in value:
        _require(isinstance(item, kind) and not isinstance(item, bool), name,
                 f"must hold only {kind.__name__} values, got {{value!r}}", value=item)
    object.__setattr__(params, name, value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and not math.isnan(value))


def _as_float(params, name: str) -> None:
    """Store a validated number as a float: torch cannot divide a tensor by a Python int past int64
    (temperature=2**70 raised OverflowError in the step), and a float of that size is just large."""
    value = getattr(params, name)
    try:
        converted = float(value)
    except OverflowError:
        converted = math.inf
    _require(math.isfinite(converted), name, "must be a finite number, got {value!r}", value=value)
    object.__setattr__(params, name, converted)


MAX_ABS_PRESENCE_FREQUENCY_PENALTY = 2.0  # OpenAI's range
# A seen token's score is divided or multiplied by repetition_penalty in float32, and sampling then
# divides by a temperature down to GREEDY_TEMPERATURE (1e-5): within [1/100, 100] a logit as large as
# 1e20 stays finite through both (1e20 * 100 / 1e-5 = 1e27 < float32's 3.4e38), where 1e-300 rounds
# to 0 in float32 and made every score inf (nan probabilities). Past 100 a seen token is banned in
# effect already, so the range takes nothing useful away.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0


def _check_penalties(params) -> None:
    """repetition_penalty in [MIN, MAX]_REPETITION_PENALTY (1 = off); presence_penalty and
    frequency_penalty in [-2, 2] (0 = off): both keep the float32 arithmetic finite."""
    _require(_is_number(params.repetition_penalty)
             and MIN_REPETITION_PENALTY <= params.repetition_penalty <= MAX_REPETITION_PENALTY,
             "repetition_penalty",
             "must be a number in [{low}, {high}] (1 = off, > 1 discourages repeats), got {value!r}",
             low=MIN_REPETITION_PENALTY, high=MAX_REPETITION_PENALTY, value=params.repetition_penalty)
    _as_float(params, "repetition_penalty")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        _require(_is_number(value) and abs(value) <= MAX_ABS_PRESENCE_FREQUENCY_PENALTY, name,
                 "must be a number in [-{limit}, {limit}] (0 = off), got {value!r}",
                 limit=MAX_ABS_PRESENCE_FREQUENCY_PENALTY, value=value)


def _check_decoder_start(params) -> None:
    """`decoder_prefix`: token ids (or text, tokenized by the engine without special tokens) the
    decoder starts from; `forced_bos_token_id`: None or a token id >= 0 (the vocabulary bound is the
    engine's check)."""
    if isinstance(params.decoder_prefix, str):
        _require(bool(params.decoder_prefix), "decoder_prefix", "must not be an empty string")
    else:
        _as_tuple(params, "decoder_prefix", int)
        _require(all(t >= 0 for t in params.decoder_prefix), "decoder_prefix",
                 "must hold only token ids >= 0, got {value!r}", value=params.decoder_prefix)
    _require(params.forced_bos_token_id is None
             or (_is_int(params.forced_bos_token_id) and params.forced_bos_token_id >= 0),
             "forced_bos_token_id", "must be None or a token id >= 0, got {value!r}",
             value=params.forced_bos_token_id)


def _check_bans(params) -> None:
    """`no_repeat_ngram_size`: 0 (off) or the n-gram length no row may repeat; `bad_words_ids`: token
    sequences that may never appear (transformers' semantics, decoding/bans.py), each non-empty."""
    _require(_is_int(params.no_repeat_ngram_size) and params.no_repeat_ngram_size >= 0,
             "no_repeat_ngram_size", "must be an integer >= 0 (0 = off), got {value!r}",
             value=params.no_repeat_ngram_size)
    value = params.bad_words_ids
    if value is None:
        value = ()
    _require(isinstance(value, (list, tuple)), "bad_words_ids",
             "must be a list of token-id lists, got {value!r}", value=value)
    sequences = []
    for sequence in value:
        _require(isinstance(sequence, (list, tuple)) and len(sequence) > 0
                 and all(_is_int(t) and t >= 0 for t in sequence), "bad_words_ids",
                 "must hold non-empty lists of token ids >= 0, got {value!r}", value=sequence)
        sequences.append(tuple(sequence))
    object.__setattr__(params, "bad_words_ids", tuple(sequences))


def _check_max_input_length(params) -> None:
    """`max_input_length`: None (off: a prompt too long is refused) or the most prompt tokens kept."""
    _require(params.max_input_length is None
             or (_is_int(params.max_input_length) and params.max_input_length >= 1),
             "max_input_length", "must be None (off) or an integer >= 1, got {value!r}",
             value=params.max_input_length)


def _check_combinations(params) -> None:
    """The options refused together, said once: each names the option that cannot apply and why."""
    if schema_of(params.response_format) is not None:
        # JSON repeats its punctuation n-grams ('", "'): the grammar's only continuation may be banned
        _require(not params.no_repeat_ngram_size, "no_repeat_ngram_size",
                 "and {response_format} exclude each other: JSON repeats its own n-grams (\", \"), so "
                 "a ban can leave no valid continuation")
    if not isinstance(params, BeamSearchParams):
        return
    if params.prefix_bias_beta:
        _require(bool(params.decoder_prefix), "prefix_bias_beta", "needs a {decoder_prefix} to bias towards")
        _require(params.forced_bos_token_id is None, "prefix_bias_beta", "and {forced_bos_token_id} exclude "
                 "each other: the soft prefix says what comes first")
    if params.min_alternative_expansion_prob:
        _require(params.return_alternatives, "min_alternative_expansion_prob", "needs {return_alternatives}")
    if params.return_alternatives:
        # no beam search runs: the alternatives are expanded once, then each goes on greedily
        for name, off in (("patience", 1.0), ("prefix_bias_beta", 0.0), ("early_stopping", False)):
            _require(getattr(params, name) == off, name, "does not apply with {return_alternatives}: no beam "
                     "search runs (each alternative is continued greedily)")
        _require(not params.constrained, "return_alternatives", "and {catalogue} exclude each other: a "
                 "catalogue search returns items, not alternatives at one position")
        for name, off in (("beam_width_schedule", params.beam_width_schedule is None),
                          ("num_beam_groups", params.num_beam_groups == 1),
                          ("return_tree", not params.return_tree)):
            _require(off, name, "does not apply with {return_alternatives}: no beam search runs (each "
                     "alternative is continued greedily)")
    if params.patience != 1.0:
        _require(params.beam_width > 1, "patience", "needs {beam_width} > 1: beam_width 1 is greedy "
                 "search, which the first end-of-sequence token ends")
        _require(params.num_beam_groups == 1, "patience", "and {num_beam_groups} > 1 exclude each other: "
                 "group beam search stops by transformers' rule per group")


# alternatives per token at most (vLLM's default max_logprobs; OpenAI chat's top_logprobs limit)
MAX_LOGPROBS = 20


def _check_logprobs(params) -> None:
    """`logprobs` / `prompt_logprobs`: None (off) or how many most likely alternatives to report with
    each token's own log-prob, in [0, MAX_LOGPROBS] (see widebeam/logprobs.py for what they are)."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        _require(value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS), name,
                 "must be None (off) or an integer in [0, {limit}] (alternatives per token), got {value!r}",
                 limit=MAX_LOGPROBS, value=value)


def _check_stop_token_ids(token_ids: tuple[int, ...]) -> None:
    """Negative ids are wrong in every mode; the upper bound (the vocabulary) is the engine's check."""
    _require(all(t >= 0 for t in token_ids), "stop_token_ids", "must hold only token ids >= 0, got {value!r}",
             value=token_ids)


@dataclass(frozen=True)
class SamplingParams:
    """Greedy (`temperature=0`) or sampled decoding of one sequence.

    `max_new_tokens=None` means up to the engine's `max_seq_len` minus the prompt.
    """

    max_new_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_new_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Log-probs (widebeam/logprobs.py): None = off, k = each token's log-prob and the k most likely
    # alternatives; `prompt_logprobs` the same for every prompt token (computed in the prefill).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Encoder-decoder models: the decoder starts from these tokens after its start token (NLLB's target
    # language, a T5 task prefix, a forced partial translation): its prompt, never scored nor returned.
    # Decoder-only models: appended to the prompt. Text is tokenized without special tokens.
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
    # Structured output: OpenAI's response_format (widebeam/structured/: JSON mode, JSON schema).
    response_format: object = field(default=None, compare=False)

    def __post_init__(self) -> None:
        _as_tuple(self, "stop", str)
        _as_tuple(self, "stop_token_ids", int)
        _require(self.max_new_tokens is None or (_is_int(self.max_new_tokens) and self.max_new_tokens >= 1),
                 "max_new_tokens", "must be an integer >= 1 or None, got {value!r}",
                 value=self.max_new_tokens)
        _require(_is_number(self.temperature) and 0 <= self.temperature < math.inf, "temperature",
                 "must be a finite number >= 0, got {value!r}", value=self.temperature)
        _as_float(self, "temperature")
        _require(_is_int(self.top_k) and self.top_k >= -1, "top_k",
                 "must be -1 or 0 (off) or a positive integer, got {value!r}", value=self.top_k)
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1], got {value!r}",
                 value=self.top_p)
        _require(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**64), "seed",
                 "must be an integer in [-2**63, 2**64) (torch's seeds) or None, got {value!r}",
                 value=self.seed)
        _require(isinstance(self.ignore_eos, bool), "ignore_eos", "must be true or false, got {value!r}",
                 value=self.ignore_eos)
        _require(_is_int(self.min_new_tokens) and self.min_new_tokens >= 0, "min_new_tokens",
                 "must be an integer >= 0, got {value!r}", value=self.min_new_tokens)
        _require(self.max_new_tokens is None or self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
                 "must be <= {max_new_tokens} ({limit}), got {value}", limit=self.max_new_tokens,
                 value=self.min_new_tokens)
        _require(all(s for s in self.stop), "stop", "must not contain empty strings")
        _check_stop_token_ids(self.stop_token_ids)
        _check_penalties(self)
        _check_logprobs(self)
        _check_response_format(self)
        _check_decoder_start(self)
        _check_bans(self)
        _check_max_input_length(self)
        _check_combinations(self)

    @property
    def greedy(self) -> bool:
        # dividing logits by a temperature this small overflows float32: it is greedy in effect
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def beam_width(self) -> int:
        return 1

    def replace(self, **changes) -> SamplingParams:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return type(self)(**values)


DEFAULT_BEAM_WIDTH = 4
MAX_DIVERSITY_PENALTY = 1e4  # subtracted from float32 log-probs: far past any useful value, still finite


def _check_groups(params) -> None:
    """`num_beam_groups` divides `beam_width`; `diversity_penalty` > 0 exactly when it is above 1
    (transformers' rules); no schedule, stop strings, log-probs or search tree beside groups."""
    groups = params.num_beam_groups
    _require(_is_int(groups) and 1 <= groups <= params.beam_width and params.beam_width % groups == 0,
             "num_beam_groups", "must be an integer in [1, {beam_width}] dividing {beam_width} ({width}), "
             "got {value!r}", width=params.beam_width, value=groups)
    penalty = params.diversity_penalty
    _require(_is_number(penalty) and 0 <= penalty <= MAX_DIVERSITY_PENALTY, "diversity_penalty",
             "must be a number in [0, {limit}], got {value!r}", limit=MAX_DIVERSITY_PENALTY, value=penalty)
    _require((penalty > 0) == (groups > 1), "diversity_penalty",
             "must be > 0 with {num_beam_groups} > 1 and 0 without (the penalty is between groups), "
             "got {value!r}", value=penalty)
    if groups > 1:
        for name, off in (("beam_width_schedule", params.beam_width_schedule is None),
                          ("stop", not params.stop), ("logprobs", params.logprobs is None),
                          ("return_tree", not params.return_tree)):
            _require(off, name, "is not supported with {num_beam_groups} > 1")


def _check_item_filters(params) -> None:
    """`allowed_items` / `excluded_items`: None or 1-D integer item indices >= 0 (the engine checks the
    upper bound, the catalogue's size); `catalogue_subset`: a name registered beside `catalogue`. All
    need a catalogue."""
    import numpy as np

    for name in ("allowed_items", "excluded_items"):
        value = getattr(params, name)
        if value is None:
            continue
        try:
            array = np.asarray(value)
        except (ValueError, TypeError):
            array = np.asarray([None])
        if array.size == 0:
            array = array.astype(np.int64)
        _require(array.ndim == 1 and array.dtype.kind in "iu" and (array.size == 0 or int(array.min()) >= 0),
                 name, "must be a list of item indices (integers >= 0) into the catalogue, got {value!r}",
                 value=value if array.size < 8 else f"{array.size} values")
        object.__setattr__(params, name, array.astype(np.int64, copy=False))
    subset = params.catalogue_subset
    _require(subset is None or (isinstance(subset, str) and bool(subset)), "catalogue_subset",
             "must be the name of a subset registered with the catalogue, got {value!r}", value=subset)
    _require(subset is None or params.catalogue is not None, "catalogue_subset",
             "needs {catalogue}: a subset is registered beside a catalogue")
    for name in ("allowed_items", "excluded_items"):
        _require(getattr(params, name) is None or params.constrained, name,
                 "needs {catalogue} (or {allowed_sequences}): it filters a catalogue's items")
# A schedule entry above this is surely a mistake (the engine's max_beam_width bounds it anyway).
MAX_SCHEDULE_WIDTH = 2**20


def _check_schedule(params) -> None:
    """`beam_width_schedule`: None, or a non-empty list of integer widths >= 1 with at most
    `max_new_tokens` entries; stored as a tuple, and `beam_width` set to its widest step (a
    `beam_width` given beside it must be that width, or left at its default)."""
    schedule = params.beam_width_schedule
    if schedule is None:
        return
    _require(isinstance(schedule, (list, tuple)) and len(schedule) >= 1, "beam_width_schedule",
             "must be a non-empty list of integer widths >= 1 (e.g. [64, 256, 1024]), got {value!r}",
             value=schedule)
    for width in schedule:
        _require(_is_int(width) and 1 <= width <= MAX_SCHEDULE_WIDTH, "beam_width_schedule",
                 "must hold only integer widths in [1, {limit}], got {value!r}", limit=MAX_SCHEDULE_WIDTH,
                 value=width)
    schedule = tuple(schedule)
    _require(params.max_new_tokens is None or len(schedule) <= params.max_new_tokens, "beam_width_schedule",
             "has {length} entries, more than {max_new_tokens} ({limit}): one width per generated token "
             "at most (the last one repeats)", length=len(schedule), limit=params.max_new_tokens)
    widest = max(schedule)
    _require(params.beam_width in (DEFAULT_BEAM_WIDTH, widest), "beam_width",
             "and {beam_width_schedule} disagree: with a schedule {beam_width} is its widest step "
             "({limit}); leave it out, got {value!r}", limit=widest, value=params.beam_width)
    object.__setattr__(params, "beam_width_schedule", schedule)
    object.__setattr__(params, "beam_width", widest)


@dataclass(frozen=True)
class BeamSearchParams:
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

    beam_width: int = DEFAULT_BEAM_WIDTH
    max_new_tokens: int | None = 16
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int | None = None
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    catalogue: str | None = None
    allowed_sequences: object = field(default=None, compare=False, repr=False)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Per beam: each token's log-prob and the k most likely alternatives of its parent at that step.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Encoder-decoder models: the decoder starts from these tokens after its start token (NLLB's target
    # language, a T5 task prefix, a forced partial translation): its prompt, never scored nor returned.
    # Decoder-only models: appended to the prompt. Text is tokenized without special tokens.
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
    # Structured output: every beam inside the grammar, its matcher forked with the beam.
    response_format: object = field(default=None, compare=False)
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
        _as_tuple(self, "stop", str)
        _as_tuple(self, "stop_token_ids", int)
        _require(isinstance(self.beam_width, int) and not isinstance(self.beam_width, bool)
                 and self.beam_width >= 1, "beam_width", "must be an integer >= 1, got {value!r}",
                 value=self.beam_width)
        _check_schedule(self)
        _check_item_filters(self)
        _check_groups(self)
        _require(self.catalogue is None or (isinstance(self.catalogue, str) and bool(self.catalogue)),
                 "catalogue",
                 "must be the name of a registered catalogue, got {value!r}", value=self.catalogue)
        _require(self.catalogue is None or self.allowed_sequences is None, "allowed_sequences",
                 "and {catalogue} exclude each other: give one")
        _require(not (self.constrained and self.ignore_eos), "ignore_eos",
                 "must be false with a catalogue: a beam ends its item with the end-of-sequence token")
        _require(self.max_new_tokens is None or (isinstance(self.max_new_tokens, int)
                                                 and not isinstance(self.max_new_tokens, bool)
                                                 and self.max_new_tokens >= 1),
                 "max_new_tokens", "must be an integer >= 1 or None, got {value!r}",
                 value=self.max_new_tokens)
        _require(isinstance(self.length_penalty, (int, float)) and not isinstance(self.length_penalty, bool)
                 and abs(self.length_penalty) <= MAX_ABS_LENGTH_PENALTY
                 and math.isfinite(self.length_penalty),
                 "length_penalty",
                 "must be a finite number in [-{limit}, {limit}] (> 0 favours longer hypotheses), "
                 "got {value!r}", limit=MAX_ABS_LENGTH_PENALTY, value=self.length_penalty)
        _require(self.early_stopping is True or self.early_stopping is False
                 or (isinstance(self.early_stopping, str) and self.early_stopping == "never"),
                 "early_stopping", "must be True, False or \"never\", got {value!r}",
                 value=self.early_stopping)
        if self.num_return_sequences is None:
            object.__setattr__(self, "num_return_sequences", self.final_beam_width)
        num_return = self.num_return_sequences
        width_name = "{beam_width_schedule}'s final width" if self.beam_width_schedule else "{beam_width}"
        _require(isinstance(num_return, int) and not isinstance(num_return, bool)
                 and 1 <= num_return <= self.final_beam_width, "num_return_sequences",
                 "must be an integer in [1, " + width_name + "={width}] or None, got {value!r}",
                 width=self.final_beam_width, value=self.num_return_sequences)
        _require(isinstance(self.min_new_tokens, int) and not isinstance(self.min_new_tokens, bool)
                 and self.min_new_tokens >= 0, "min_new_tokens",
                 "must be an integer >= 0, got {value!r}", value=self.min_new_tokens)
        _require(self.max_new_tokens is None or self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
                 "must be <= {max_new_tokens} ({limit}), got {value}", limit=self.max_new_tokens,
                 value=self.min_new_tokens)
        _check_stop_token_ids(self.stop_token_ids)
        _require(all(s for s in self.stop), "stop", "must not contain empty strings")
        _require(isinstance(self.ignore_eos, bool), "ignore_eos", "must be true or false, got {value!r}",
                 value=self.ignore_eos)
        _require(isinstance(self.return_tree, bool), "return_tree", "must be true or false, got {value!r}",
                 value=self.return_tree)
        _check_penalties(self)
        _check_logprobs(self)
        _check_response_format(self)
        _require(_is_number(self.patience) and 1.0 <= self.patience <= MAX_PATIENCE, "patience",
                 "must be a number in [1, {limit}] (1 = off), got {value!r}", limit=MAX_PATIENCE,
                 value=self.patience)
        _as_float(self, "patience")
        _require(_is_number(self.prefix_bias_beta) and 0.0 <= self.prefix_bias_beta < 1.0, "prefix_bias_beta",
                 "must be a number in [0, 1) (0 = off), got {value!r}", value=self.prefix_bias_beta)
        _as_float(self, "prefix_bias_beta")
        _require(isinstance(self.return_alternatives, bool), "return_alternatives",
                 "must be true or false, got {value!r}", value=self.return_alternatives)
        threshold = self.min_alternative_expansion_prob
        _require(_is_number(threshold) and 0.0 <= threshold <= 1.0, "min_alternative_expansion_prob",
                 "must be a probability in [0, 1], got {value!r}", value=threshold)
        _as_float(self, "min_alternative_expansion_prob")
        _check_decoder_start(self)
        _check_bans(self)
        _check_max_input_length(self)
        _check_combinations(self)
        _require(not (self.constrained and schema_of(self.response_format) is not None), "response_format",
                 "and {catalogue} exclude each other: a catalogue already fixes every beam's tokens")
        if self.constrained:
            # A stop string or stop token can end a beam inside an item ("yoga" of "yoga mat"), and a
            # catalogue promises whole items only: refused rather than filtered, so nothing is lost silently.
            constraint = "catalogue" if self.catalogue is not None else "allowed_sequences"
            for name in ("stop", "stop_token_ids"):
                _require(not getattr(self, name), name,
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
        """A copy with `changes` applied. A `num_return_sequences` equal to the final width (the
        default, all beams) follows a changed `beam_width` or schedule unless it is given too."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        widths = {"beam_width", "beam_width_schedule"}
        if (widths & changes.keys() and "num_return_sequences" not in changes
                and self.num_return_sequences == self.final_beam_width):
            values["num_return_sequences"] = None
        if changes.get("beam_width_schedule") is not None and "beam_width" not in changes:
            values["beam_width"] = DEFAULT_BEAM_WIDTH  # the new schedule's widest step
        values.update(changes)
        return type(self)(**values)

