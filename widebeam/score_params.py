"""Forced-decoding (scoring) request parameters: `ScoreParams`, checked like the others (params.py's
helpers: errors name the field)."""

from __future__ import annotations

from dataclasses import dataclass

from widebeam.errors import InvalidParameterError
from widebeam.param_checks import check_decoder_start, check_max_input_length, is_int, require


@dataclass(frozen=True)
class ScoreParams:
    """Forced decoding (scoring): the log-prob of each given continuation of one prompt, token by token,
    under the model's raw log-softmax (no logits processor: what transformers' log-softmax of the
    forced sequence gives, and CTranslate2's `score_batch`). `continuations`: token-id sequences or
    text (tokenized without special tokens; add an end-of-sequence token yourself to score it).

    The prompt is computed once and the continuations share its blocks as beams do: the engine's
    decoder forks rows from the prompt along the continuations' prefix tree (decoding/scoring.py).
    Options that choose tokens make no sense here and do not exist on this class.
    """

    continuations: tuple[tuple[int, ...] | str, ...]
    decoder_prefix: tuple[int, ...] | str = ()
    max_input_length: int | None = None
    # What every request's params answer and forced decoding never sets (the engine reads them).
    stop = ()
    stop_token_ids = ()
    bad_words_ids = ()
    forced_bos_token_id = None
    logprobs = None
    prompt_logprobs = None
    response_format = None
    min_new_tokens = 0

    def __post_init__(self) -> None:
        value = self.continuations
        require(isinstance(value, (list, tuple)) and len(value) > 0, "continuations",
                 "must be a non-empty list of token-id lists or texts, got {value!r}", value=value)
        items = []
        for item in value:
            if isinstance(item, str):
                require(bool(item), "continuations", "must not hold an empty text")
                items.append(item)
                continue
            require(isinstance(item, (list, tuple)) and len(item) > 0
                     and all(is_int(t) and t >= 0 for t in item), "continuations",
                     "must hold non-empty token-id lists (ids >= 0) or texts, got {value!r}", value=item)
            items.append(tuple(item))
        object.__setattr__(self, "continuations", tuple(items))
        check_decoder_start(self)
        check_max_input_length(self)

    @property
    def token_continuations(self) -> tuple[tuple[int, ...], ...]:
        """The continuations as token ids (the engine tokenizes text ones first: `tokenized`)."""
        if any(isinstance(c, str) for c in self.continuations):
            raise ValueError("text continuations are tokenized by the engine first")
        return self.continuations

    @property
    def beam_width(self) -> int:
        """The most rows one step holds: the distinct prefixes of the continuations at one depth."""
        items = self.token_continuations
        depth = max(len(c) for c in items)
        return max(1, max(len({c[:d] for c in items if len(c) > d}) for d in range(depth)))

    @property
    def max_new_tokens(self) -> int:
        return max(len(c) for c in self.token_continuations)

    def tokenized(self, tokenizer, vocab_size: int) -> ScoreParams:
        """These params with every continuation as token ids within [0, vocab_size)."""
        items = []
        for item in self.continuations:
            if isinstance(item, str):
                if tokenizer is None:
                    raise InvalidParameterError("continuations", "this model directory has no tokenizer: "
                                                "pass token ids as the {continuations}")
                item = tuple(tokenizer.encode(item, add_special_tokens=False))
                require(bool(item), "continuations", "holds a text that encodes to no token")
            require(all(t < vocab_size for t in item), "continuations",
                     "must hold token ids in [0, {vocab_size}), got {value!r}", vocab_size=vocab_size,
                     value=list(item))
            items.append(item)
        return ScoreParams(tuple(items), self.decoder_prefix, self.max_input_length)
