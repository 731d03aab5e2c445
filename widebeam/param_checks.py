"""Validation of request parameters, shared by params.py and score_params.py: each check names the
field and its allowed range (`InvalidParameterError`), and normalises what it accepts (lists to
tuples, numbers to floats)."""

from __future__ import annotations

import math

from widebeam.errors import InvalidParameterError
from widebeam.response_format import schema_of

GREEDY_TEMPERATURE = 1e-5  # below this, sampling is argmax
# Scores divide by generated_len ** length_penalty: within this range they stay finite for any length
# an engine allows (float64 up to 2**1024 > (2**20) ** 10), where HF's own arithmetic overflows beyond it.
MAX_ABS_LENGTH_PENALTY = 10.0
# patience keeps round(beam_width * patience) finished hypotheses: a bound keeps that list small
MAX_PATIENCE = 16.0


def check_response_format(params) -> None:
    """The format's shape and caps (response_format.py), and the options a grammar cannot honour:
    the grammar allows the end-of-sequence token only once the JSON value is complete and nothing after
    it, so generating past it (`ignore_eos`) or withholding it for a minimum count (`min_new_tokens`,
    which may exceed the value's length) has no valid continuation."""
    if schema_of(params.response_format) is None:
        return
    require(not params.ignore_eos, "ignore_eos", "and {response_format} exclude each other: the output "
             "ends where the JSON value does")
    require(not params.min_new_tokens, "min_new_tokens", "and {response_format} exclude each other: the "
             "output ends where the JSON value does, which may come before {min_new_tokens} tokens")


def require(condition: bool, param: str, message: str, **values) -> None:
    """Raise `InvalidParameterError` for `param` unless `condition`. `message` follows the parameter's
    name and is a template (see `widebeam.errors`): other parameters in braces, the offending value as
    `{value!r}` from `values`, so a caller can render the message with its own parameter names."""
    if not condition:
        raise InvalidParameterError(param, "{" + param + "} " + message, **values)


def as_tuple(params, name: str, kind: type) -> None:
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
        require(isinstance(item, kind) and not isinstance(item, bool), name,
                 f"must hold only {kind.__name__} values, got {{value!r}}", value=item)
    object.__setattr__(params, name, value)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and not math.isnan(value))


def as_float(params, name: str) -> None:
    """Store a validated number as a float: torch cannot divide a tensor by a Python int past int64
    (temperature=2**70 raised OverflowError in the step), and a float of that size is just large."""
    value = getattr(params, name)
    try:
        converted = float(value)
    except OverflowError:
        converted = math.inf
    require(math.isfinite(converted), name, "must be a finite number, got {value!r}", value=value)
    object.__setattr__(params, name, converted)


MAX_ABS_PRESENCE_FREQUENCY_PENALTY = 2.0  # OpenAI's range
# A seen token's score is divided or multiplied by repetition_penalty in float32, and sampling then
# divides by a temperature down to GREEDY_TEMPERATURE (1e-5): within [1/100, 100] a logit as large as
# 1e20 stays finite through both (1e20 * 100 / 1e-5 = 1e27 < float32's 3.4e38), where 1e-300 rounds
# to 0 in float32 and made every score inf (nan probabilities). Past 100 a seen token is banned in
# effect already, so the range takes nothing useful away.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0


def check_penalties(params) -> None:
    """repetition_penalty in [MIN, MAX]_REPETITION_PENALTY (1 = off); presence_penalty and
    frequency_penalty in [-2, 2] (0 = off): both keep the float32 arithmetic finite."""
    require(is_number(params.repetition_penalty)
             and MIN_REPETITION_PENALTY <= params.repetition_penalty <= MAX_REPETITION_PENALTY,
             "repetition_penalty",
             "must be a number in [{low}, {high}] (1 = off, > 1 discourages repeats), got {value!r}",
             low=MIN_REPETITION_PENALTY, high=MAX_REPETITION_PENALTY, value=params.repetition_penalty)
    as_float(params, "repetition_penalty")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        require(is_number(value) and abs(value) <= MAX_ABS_PRESENCE_FREQUENCY_PENALTY, name,
                 "must be a number in [-{limit}, {limit}] (0 = off), got {value!r}",
                 limit=MAX_ABS_PRESENCE_FREQUENCY_PENALTY, value=value)


def check_decoder_start(params) -> None:
    """`decoder_prefix`: token ids (or text, tokenized by the engine without special tokens) the
    decoder starts from; `forced_bos_token_id`: None or a token id >= 0 (the vocabulary bound is the
    engine's check)."""
    if isinstance(params.decoder_prefix, str):
        require(bool(params.decoder_prefix), "decoder_prefix", "must not be an empty string")
    else:
        as_tuple(params, "decoder_prefix", int)
        require(all(t >= 0 for t in params.decoder_prefix), "decoder_prefix",
                 "must hold only token ids >= 0, got {value!r}", value=params.decoder_prefix)
    require(params.forced_bos_token_id is None
             or (is_int(params.forced_bos_token_id) and params.forced_bos_token_id >= 0),
             "forced_bos_token_id", "must be None or a token id >= 0, got {value!r}",
             value=params.forced_bos_token_id)


def check_bans(params) -> None:
    """`no_repeat_ngram_size`: 0 (off) or the n-gram length no row may repeat; `bad_words_ids`: token
    sequences that may never appear (transformers' semantics, decoding/bans.py), each non-empty."""
    require(is_int(params.no_repeat_ngram_size) and params.no_repeat_ngram_size >= 0,
             "no_repeat_ngram_size", "must be an integer >= 0 (0 = off), got {value!r}",
             value=params.no_repeat_ngram_size)
    value = params.bad_words_ids
    if value is None:
        value = ()
    require(isinstance(value, (list, tuple)), "bad_words_ids",
             "must be a list of token-id lists, got {value!r}", value=value)
    sequences = []
    for sequence in value:
        require(isinstance(sequence, (list, tuple)) and len(sequence) > 0
                 and all(is_int(t) and t >= 0 for t in sequence), "bad_words_ids",
                 "must hold non-empty lists of token ids >= 0, got {value!r}", value=sequence)
        sequences.append(tuple(sequence))
    object.__setattr__(params, "bad_words_ids", tuple(sequences))


def check_bans_leave_a_token(params, vocab_size: int, eos_token_ids, suppress_token_ids=()) -> None:
    """Refuse bans that leave no token for the first step (the engine's check, at admission: it knows
    the vocabulary): the one-token `bad_words_ids` (less the end ids, which they never ban), the model's
    suppressed tokens and, before `min_new_tokens`, the end ids (EOS unless ignored, `stop_token_ids`)
    covering all `vocab_size` ids. A ban that runs out only while decoding (an n-gram rule, a
    multi-token word) ends the sequence instead (finish reason "banned", decoding/decoders.py)."""
    bad_words = getattr(params, "bad_words_ids", ())
    stop_ids = set(getattr(params, "stop_token_ids", ()))
    if not bad_words and not stop_ids:
        return
    ends = stop_ids | (set() if params.ignore_eos else set(eos_token_ids))
    singles = {s[0] for s in bad_words if len(s) == 1} - (set(eos_token_ids) | stop_ids)
    banned = {t for t in singles | set(suppress_token_ids) if 0 <= t < vocab_size}
    if len(banned) >= vocab_size:
        raise InvalidParameterError("bad_words_ids", "{bad_words_ids} bans every one of the model's {size} "
                                    "tokens: leave at least one token that may be generated", size=vocab_size)
    withheld = banned | {t for t in ends if 0 <= t < vocab_size} if params.min_new_tokens else banned
    if len(withheld) < vocab_size:
        return
    # only the end ids are left, and min_new_tokens withholds them
    if bad_words:
        raise InvalidParameterError(
            "bad_words_ids", "{bad_words_ids} bans every token but the end ids {ends}, which "
            "{min_new_tokens} ({value}) withholds: no token could be generated first. Leave at least one "
            "other token unbanned, or lower {min_new_tokens} to 0", ends=sorted(ends),
            value=params.min_new_tokens)
    raise InvalidParameterError(
        "stop_token_ids", "{stop_token_ids} with the end-of-sequence ids cover all {size} tokens, which "
        "{min_new_tokens} ({value}) withholds: no token could be generated first. List fewer stop ids, "
        "or lower {min_new_tokens} to 0", size=vocab_size, value=params.min_new_tokens)


def check_max_input_length(params) -> None:
    """`max_input_length`: None (off: a prompt too long is refused) or the most prompt tokens kept."""
    require(params.max_input_length is None
             or (is_int(params.max_input_length) and params.max_input_length >= 1),
             "max_input_length", "must be None (off) or an integer >= 1, got {value!r}",
             value=params.max_input_length)


def check_combinations(params) -> None:
    """The options refused together, said once: each names the option that cannot apply and why."""
    if schema_of(params.response_format) is not None:
        # JSON repeats its punctuation n-grams ('", "'): the grammar's only continuation may be banned
        require(not params.no_repeat_ngram_size, "no_repeat_ngram_size",
                 "and {response_format} exclude each other: JSON repeats its own n-grams (\", \"), so "
                 "a ban can leave no valid continuation")
    if not hasattr(params, "beam_width_schedule"):  # the beam-search options below
        return
    if params.prefix_bias_beta:
        require(bool(params.decoder_prefix), "prefix_bias_beta", "needs a {decoder_prefix} to bias towards")
        require(params.forced_bos_token_id is None, "prefix_bias_beta", "and {forced_bos_token_id} exclude "
                 "each other: the soft prefix says what comes first")
    if params.min_alternative_expansion_prob:
        require(params.return_alternatives, "min_alternative_expansion_prob", "needs {return_alternatives}")
    if params.return_alternatives:
        # no beam search runs: the alternatives are expanded once, then each goes on greedily
        for name, off in (("patience", 1.0), ("prefix_bias_beta", 0.0), ("early_stopping", False)):
            require(getattr(params, name) == off, name, "does not apply with {return_alternatives}: no beam "
                     "search runs (each alternative is continued greedily)")
        require(not params.constrained, "return_alternatives", "and {catalogue} exclude each other: a "
                 "catalogue search returns items, not alternatives at one position")
        for name, off in (("beam_width_schedule", params.beam_width_schedule is None),
                          ("num_beam_groups", params.num_beam_groups == 1),
                          ("return_tree", not params.return_tree)):
            require(off, name, "does not apply with {return_alternatives}: no beam search runs (each "
                     "alternative is continued greedily)")
    if params.patience != 1.0:
        require(params.beam_width > 1, "patience", "needs {beam_width} > 1: beam_width 1 is greedy "
                 "search, which the first end-of-sequence token ends")
        require(params.num_beam_groups == 1, "patience", "and {num_beam_groups} > 1 exclude each other: "
                 "group beam search stops by transformers' rule per group")


# alternatives per token at most (vLLM's default max_logprobs; OpenAI chat's top_logprobs limit)
MAX_LOGPROBS = 20


def check_logprobs(params) -> None:
    """`logprobs` / `prompt_logprobs`: None (off) or how many most likely alternatives to report with
    each token's own log-prob, in [0, MAX_LOGPROBS] (see widebeam/logprobs.py for what they are)."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        require(value is None or (is_int(value) and 0 <= value <= MAX_LOGPROBS), name,
                 "must be None (off) or an integer in [0, {limit}] (alternatives per token), got {value!r}",
                 limit=MAX_LOGPROBS, value=value)


def check_stop_token_ids(token_ids: tuple[int, ...]) -> None:
    """Negative ids are wrong in every mode; the upper bound (the vocabulary) is the engine's check."""
    require(all(t >= 0 for t in token_ids), "stop_token_ids", "must hold only token ids >= 0, got {value!r}",
             value=token_ids)




DEFAULT_BEAM_WIDTH = 4
MAX_DIVERSITY_PENALTY = 1e4  # subtracted from float32 log-probs: far past any useful value, still finite


def check_groups(params) -> None:
    """`num_beam_groups` divides `beam_width`; `diversity_penalty` > 0 exactly when it is above 1
    (transformers' rules); no schedule, stop strings, log-probs or search tree beside groups."""
    groups = params.num_beam_groups
    require(is_int(groups) and 1 <= groups <= params.beam_width and params.beam_width % groups == 0,
             "num_beam_groups", "must be an integer in [1, {beam_width}] dividing {beam_width} ({width}), "
             "got {value!r}", width=params.beam_width, value=groups)
    penalty = params.diversity_penalty
    require(is_number(penalty) and 0 <= penalty <= MAX_DIVERSITY_PENALTY, "diversity_penalty",
             "must be a number in [0, {limit}], got {value!r}", limit=MAX_DIVERSITY_PENALTY, value=penalty)
    require((penalty > 0) == (groups > 1), "diversity_penalty",
             "must be > 0 with {num_beam_groups} > 1 and 0 without (the penalty is between groups), "
             "got {value!r}", value=penalty)
    if groups > 1:
        for name, off in (("beam_width_schedule", params.beam_width_schedule is None),
                          ("stop", not params.stop), ("logprobs", params.logprobs is None),
                          ("return_tree", not params.return_tree)):
            require(off, name, "is not supported with {num_beam_groups} > 1")


def check_item_filters(params) -> None:
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
        require(array.ndim == 1 and array.dtype.kind in "iu" and (array.size == 0 or int(array.min()) >= 0),
                 name, "must be a list of item indices (integers >= 0) into the catalogue, got {value!r}",
                 value=value if array.size < 8 else f"{array.size} values")
        object.__setattr__(params, name, array.astype(np.int64, copy=False))
    subset = params.catalogue_subset
    require(subset is None or (isinstance(subset, str) and bool(subset)), "catalogue_subset",
             "must be the name of a subset registered with the catalogue, got {value!r}", value=subset)
    require(subset is None or params.catalogue is not None, "catalogue_subset",
             "needs {catalogue}: a subset is registered beside a catalogue")
    for name in ("allowed_items", "excluded_items"):
        require(getattr(params, name) is None or params.constrained, name,
                 "needs {catalogue} (or {allowed_sequences}): it filters a catalogue's items")
# A schedule entry above this is surely a mistake (the engine's max_beam_width bounds it anyway).
MAX_SCHEDULE_WIDTH = 2**20


def check_schedule(params) -> None:
    """`beam_width_schedule`: None, or a non-empty list of integer widths >= 1 with at most
    `max_new_tokens` entries; stored as a tuple, and `beam_width` set to its widest step (a
    `beam_width` given beside it, i.e. not None, must be that width)."""
    schedule = params.beam_width_schedule
    if schedule is None:
        return
    require(isinstance(schedule, (list, tuple)) and len(schedule) >= 1, "beam_width_schedule",
             "must be a non-empty list of integer widths >= 1 (e.g. [64, 256, 1024]), got {value!r}",
             value=schedule)
    for width in schedule:
        require(is_int(width) and 1 <= width <= MAX_SCHEDULE_WIDTH, "beam_width_schedule",
                 "must hold only integer widths in [1, {limit}], got {value!r}", limit=MAX_SCHEDULE_WIDTH,
                 value=width)
    schedule = tuple(schedule)
    require(params.max_new_tokens is None or len(schedule) <= params.max_new_tokens, "beam_width_schedule",
             "has {length} entries, more than {max_new_tokens} ({limit}): one width per generated token "
             "at most (the last one repeats)", length=len(schedule), limit=params.max_new_tokens)
    widest = max(schedule)
    # None is "not given"; any width given (the default's value too) must be the widest step
    require(params.beam_width is None or params.beam_width == widest, "beam_width",
             "and {beam_width_schedule} disagree: with a schedule {beam_width} is its widest step "
             "({limit}); give that or leave {beam_width} out, got {value!r}", limit=widest,
             value=params.beam_width)
    object.__setattr__(params, "beam_width_schedule", schedule)
    object.__setattr__(params, "beam_width", widest)
