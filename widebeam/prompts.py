"""A request's prompt as the engine counts it: text or token ids checked and tokenized, a chat
message in the model's template, and the generation settings (EOS ids, an encoder-decoder's start
token) read beside the model."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from widebeam.errors import InvalidParameterError
from widebeam.model.families.table import GenerationSettings, generation_settings
from widebeam.model.loading.sources import ModelSource, load_config
from widebeam.score_params import ScoreParams


def tokenize_prompt(prompt: str | dict | list[int], tokenizer,
                    vocab_size: int) -> tuple[str | None, list[int]]:
    """(the text or None, the token ids) of a prompt given as text, token ids or
    `{"prompt_token_ids": [...]}`; every id in [0, vocab_size)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" not in prompt:
            raise InvalidParameterError("prompt", "a dict {prompt} needs 'prompt_token_ids'")
        prompt = prompt["prompt_token_ids"]
    if isinstance(prompt, list):
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt):
            raise InvalidParameterError("prompt", "{prompt} token ids must be integers in [0, {vocab_size})",
                                        vocab_size=vocab_size)
        return None, list(prompt)
    if not isinstance(prompt, str):
        raise InvalidParameterError("prompt", "{prompt} must be a string or token ids, got {kind}",
                                    kind=type(prompt).__name__)
    if not prompt:
        raise InvalidParameterError("prompt", "{prompt} is empty: give at least one token")
    if not prompt.isascii():
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone UTF-16 surrogate: valid JSON, not text
            raise InvalidParameterError("prompt", "{prompt} is not valid Unicode text: it holds a lone "
                                        "surrogate {char!r} at character {position}",
                                        char=prompt[exc.start], position=exc.start) from None
    if tokenizer is None:
        raise InvalidParameterError("prompt", "this model directory has no tokenizer: pass token ids "
                                    "(prompt_token_ids) as the {prompt}")
    token_ids = tokenizer.encode(prompt, add_special_tokens=True)
    if any(t >= vocab_size for t in token_ids):  # a tokenizer larger than the model's vocabulary
        raise InvalidParameterError("prompt", "{prompt} encodes to token ids outside the model's vocabulary "
                                    "[0, {vocab_size})", vocab_size=vocab_size)
    return prompt, token_ids


def truncate_prompt(token_ids: list[int], max_input_length: int | None,
                    decoder_start_token_id: int | None) -> list[int]:
    """The prompt cut to `max_input_length` tokens (None: unchanged; a longer prompt is then refused at
    admission). An encoder-decoder's source keeps its first tokens, as CTranslate2's `max_input_length`
    truncates; a decoder-only prompt keeps its last, the ones its continuation follows (vLLM's
    `truncate_prompt_tokens`). Special tokens the tokenizer added count as tokens."""
    if max_input_length is None or len(token_ids) <= max_input_length:
        return token_ids
    if decoder_start_token_id is not None:
        return token_ids[:max_input_length]
    return token_ids[-max_input_length:]


def prefix_token_ids(decoder_prefix: tuple[int, ...] | str, tokenizer, vocab_size: int) -> tuple[int, ...]:
    """A decoder prefix as token ids in [0, vocab_size): text is tokenized without special tokens."""
    if isinstance(decoder_prefix, str):
        if tokenizer is None:
            raise InvalidParameterError("decoder_prefix", "this model directory has no tokenizer: pass "
                                        "token ids as the {decoder_prefix}")
        decoder_prefix = tuple(tokenizer.encode(decoder_prefix, add_special_tokens=False))
    if any(t >= vocab_size for t in decoder_prefix):
        raise InvalidParameterError("decoder_prefix", "{decoder_prefix} must hold token ids in "
                                    "[0, {vocab_size}), got {value!r}", vocab_size=vocab_size,
                                    value=next(t for t in decoder_prefix if t >= vocab_size))
    return tuple(decoder_prefix)


def split_prompt(token_ids: list[int], decoder_prefix: tuple[int, ...] | str, tokenizer, vocab_size: int,
                 decoder_start_token_id: int | None) -> tuple[list[int] | None, list[int]]:
    """(the encoder's source or None, the decoder's prompt). An encoder-decoder model encodes the
    prompt and starts its decoder from its start token and `decoder_prefix`; a decoder-only model
    continues the prompt, and refuses a (hard) prefix as it refuses `forced_bos_token_id`. A text
    prefix is tokenized without special tokens."""
    decoder_prefix = prefix_token_ids(decoder_prefix, tokenizer, vocab_size)
    if decoder_start_token_id is None:
        if decoder_prefix:  # refused, as forced_bos_token_id is: appending it silently hid the mistake
            raise InvalidParameterError("decoder_prefix", "{decoder_prefix} applies to encoder-decoder "
                                        "models; this one continues its prompt: put the tokens at the end "
                                        "of the prompt")
        return None, list(token_ids)
    if not token_ids:
        raise InvalidParameterError("prompt", "the source is empty: give at least one token")
    return token_ids, [decoder_start_token_id, *decoder_prefix]


@dataclass(frozen=True)
class PromptRules:
    """What the model says about prompts: its tokenizer and vocabulary, and for an encoder-decoder its
    decoder's start token and the token it forces first (None: a decoder-only model / none)."""
    tokenizer: object
    vocab_size: int
    decoder_start_token_id: int | None = None
    forced_bos_token_id: int | None = None
    # the engine's max_seq_len: a decoder prefix or a scored continuation past it is refused by name
    # here (admission's own check would blame the prompt or max_new_tokens); None: admission alone
    max_seq_len: int | None = None


@dataclass(frozen=True)
class PreparedPrompt:
    """A request's prompt as the engine runs it."""
    text: str | None  # the prompt's text, None when given as token ids
    token_ids: list[int]  # the decoder's prompt (decoder-only: the prompt; else start token and prefix)
    encoder_token_ids: list[int] | None  # an encoder-decoder's source, else None
    soft_prefix: tuple[int, ...]  # a prefix generated under a bias (prefix_bias_beta), not given
    forced_bos_token_id: int | None  # forced as the first generated token


def prepare_prompt(prompt: str | dict | list[int], params, rules: PromptRules) -> PreparedPrompt:
    """Tokenize, truncate (`max_input_length`) and split a request's prompt into source and decoder
    prompt with its decoder prefix, and check every token id the params name against the vocabulary.
    Raises `InvalidParameterError` naming the parameter; nothing is allocated here."""
    check_token_ids(params, rules.vocab_size)
    text, token_ids = tokenize_prompt(prompt, rules.tokenizer, rules.vocab_size)
    token_ids = truncate_prompt(token_ids, params.max_input_length, rules.decoder_start_token_id)
    # a soft prefix (prefix_bias_beta) is generated under a bias, not given: the decoder starts bare
    soft = getattr(params, "prefix_bias_beta", 0.0) > 0.0
    hard_prefix = () if soft else params.decoder_prefix
    encoder_token_ids, token_ids = split_prompt(token_ids, hard_prefix, rules.tokenizer, rules.vocab_size,
                                                rules.decoder_start_token_id)
    soft_prefix = prefix_token_ids(params.decoder_prefix, rules.tokenizer, rules.vocab_size) if soft else ()
    if rules.max_seq_len is not None:
        check_decoder_length(token_ids, encoder_token_ids is not None, params, rules.max_seq_len)
    return PreparedPrompt(text, token_ids, encoder_token_ids, soft_prefix, forced_bos_token_id(params, rules))


def check_decoder_length(token_ids: list[int], encoder_decoder: bool, params, max_seq_len: int) -> None:
    """Name the field at fault when the decoder's sequence cannot fit `max_seq_len`: an encoder-decoder's
    `decoder_prefix` (its decoder's prompt is the start token and the prefix), or a scored continuation
    (scoring has no max_new_tokens: the longest continuation is what it generates). A prompt too long by
    itself is admission's to refuse, naming the prompt."""
    if encoder_decoder and params.decoder_prefix and len(token_ids) >= max_seq_len:
        raise InvalidParameterError("decoder_prefix", "{decoder_prefix} has {count} tokens; after the "
                                    "decoder's start token it leaves no room to generate within max_seq_len "
                                    "({limit}): give at most {most} tokens", count=len(token_ids) - 1,
                                    limit=max_seq_len, most=max_seq_len - 2)
    if isinstance(params, ScoreParams) and len(token_ids) < max_seq_len:
        longest = params.max_new_tokens
        if len(token_ids) + longest > max_seq_len:
            held = "the decoder's start token and prefix" if encoder_decoder else "the prompt"
            raise InvalidParameterError("continuations", "{continuations} holds one of {longest} tokens; "
                                        "after {held} ({count} tokens) at most {most} fit within max_seq_len "
                                        "({limit})", longest=longest, held=held, count=len(token_ids),
                                        most=max_seq_len - len(token_ids), limit=max_seq_len)


def check_token_ids(params, vocab_size: int) -> None:
    """`stop_token_ids` and `bad_words_ids` within the vocabulary (params.py checked their shape)."""
    out_of_vocab = [t for t in params.stop_token_ids if t >= vocab_size]
    if out_of_vocab:
        raise InvalidParameterError("stop_token_ids", "{stop_token_ids} must hold token ids in "
                                    "[0, {vocab_size}), got {value!r}", vocab_size=vocab_size,
                                    value=out_of_vocab[0])
    for sequence in params.bad_words_ids:
        if any(t >= vocab_size for t in sequence):
            raise InvalidParameterError("bad_words_ids", "{bad_words_ids} must hold token ids in "
                                        "[0, {vocab_size}), got {value!r}", vocab_size=vocab_size,
                                        value=list(sequence))


def forced_bos_token_id(params, rules: PromptRules) -> int | None:
    """The request's, else the model's; as in HF, only for an encoder-decoder decoder that starts
    from its start token alone (a decoder prefix already says what comes first)."""
    requested = params.forced_bos_token_id
    if requested is not None:
        if rules.decoder_start_token_id is None:
            raise InvalidParameterError("forced_bos_token_id", "{forced_bos_token_id} applies to "
                                        "encoder-decoder models; this one continues its prompt: put the "
                                        "token at the end of the prompt")
        if requested >= rules.vocab_size:
            raise InvalidParameterError("forced_bos_token_id", "{forced_bos_token_id} must be a token "
                                        "id in [0, {vocab_size}), got {value}",
                                        vocab_size=rules.vocab_size, value=requested)
    if rules.decoder_start_token_id is None or params.decoder_prefix:
        return None
    return requested if requested is not None else rules.forced_bos_token_id


def chat_prompt(tokenizer, message: str) -> str:
    """One user message in the model's chat template, ready for the assistant's answer."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InvalidParameterError("chat", "this model has no chat template")
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)


def read_generation_settings(source: ModelSource, tokenizer) -> GenerationSettings:
    """EOS ids (the tokenizer's added), and an encoder-decoder's start token, suppressed tokens
    and forced EOS, as the model family reads them."""
    path = source.path / "generation_config.json"
    generation_config = json.loads(path.read_text()) if path.exists() else {}
    settings = generation_settings(load_config(source), generation_config)
    if tokenizer is not None and isinstance(tokenizer.eos_token_id, int):
        settings = replace(settings, eos_token_ids=settings.eos_token_ids | {tokenizer.eos_token_id})
    return settings
