"""Errors widebeam raises to its users. Every message says what was wrong and what would fit.

The errors about parameters keep their message as a template that names parameters in braces
(`"{max_new_tokens} must be >= 1, got 0"`): `str(exc)` shows the engine's names, and
`exc.render(names)` the caller's own (the HTTP API says `max_tokens` where the engine says
`max_new_tokens`), so a front end builds its message instead of rewriting ours.
"""

from __future__ import annotations

import string
from collections.abc import Mapping

_FORMATTER = string.Formatter()


def render_template(template: str, names: Mapping[str, str] | None = None,
                    values: Mapping[str, object] | None = None) -> str:
    """`template` with each `{name}` replaced by `names.get(name, name)`, and each `{key}`,
    `{key!r}` or `{key:spec}` of `values` by that value, as `str.format` would (`{{` and `}}` are
    literal braces).

    A message that is not a template (a plain text holding braces that are no field) comes back as
    it is, so a message written before templates existed still reads right.
    """
    names = names or {}
    values = values or {}
    try:
        parts = []
        for literal, field, spec, conversion in _FORMATTER.parse(template):
            parts.append(literal)
            if field is None:
                continue
            if field in values:
                value = values[field]
                if conversion:
                    value = _FORMATTER.convert_field(value, conversion)
                parts.append(format(value, spec or ""))
            elif field.isidentifier() and not spec and not conversion:
                parts.append(names.get(field, field))
            else:
                return template
        return "".join(parts)
    except (ValueError, TypeError):  # an unpaired brace, or a format spec that does not apply
        return template


def _rebuild(cls, args: tuple, state: dict):
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class WidebeamError(Exception):
    """Base class for widebeam's own errors."""


class _TemplatedError(WidebeamError):
    """An error whose message is a template over parameter names (see `render_template`)."""

    template: str
    values: dict

    def render(self, names: Mapping[str, str] | None = None) -> str:
        """The message with each parameter called by `names` (missing ones keep the engine's name)."""
        return render_template(self.template, names, self.values)

    def __reduce__(self):  # the constructors take keywords: rebuild from the state, not from `args`
        return _rebuild, (type(self), self.args, dict(self.__dict__))


class InvalidParameterError(_TemplatedError, ValueError):
    """A parameter is outside its allowed range; `param` names it.

    `message` is a template: parameter names in braces (`"{max_new_tokens} must be >= 1, got 0"`),
    literal braces doubled. Values that may hold braces (anything a user typed) go in `values` and are
    named by their key: `InvalidParameterError("stop", "{stop} must not hold {item!r}", item=item)`.
    A message without braces is plain text.
    """

    def __init__(self, param: str, message: str, **values):
        self.param = param
        self.template = message
        self.values = values
        super().__init__(self.render())


class RequestTooLargeError(_TemplatedError, ValueError):
    """A request needs more blocks in some pool than that pool will ever have.

    Raised at admission, before anything is queued: such a request could never run, so waiting for
    blocks to free up would spin forever. Its message names `max_new_tokens` and `beam_width` as
    parameters: `render(names)` calls them as the caller does.
    """

    def __init__(
        self,
        *,
        pool: str,
        required_blocks: int,
        capacity_blocks: int,
        prompt_len: int,
        max_new_tokens: int,
        beam_width: int,
        tokens_per_block: int,
        max_new_tokens_that_fit: int | None = None,
        beam_width_that_fits: int | None = None,
        detail: str = "",
    ):
        self.pool = pool
        self.required_blocks = required_blocks
        self.capacity_blocks = capacity_blocks
        self.prompt_len = prompt_len
        self.max_new_tokens = max_new_tokens
        self.beam_width = beam_width
        self.tokens_per_block = tokens_per_block
        self.max_new_tokens_that_fit = max_new_tokens_that_fit
        self.beam_width_that_fits = beam_width_that_fits
        self.template = self._template(bool(detail))
        self.values = {"pool": pool, "detail": detail}
        super().__init__(self.render())

    def _template(self, has_detail: bool) -> str:
        msg = (
            f"request can never fit the KV cache: pool '{{pool}}' needs {self.required_blocks} blocks "
            f"but holds {self.capacity_blocks} blocks of {self.tokens_per_block} tokens "
            f"(prompt_len={self.prompt_len}, {{max_new_tokens}}={self.max_new_tokens}, "
            f"{{beam_width}}={self.beam_width})"
        )
        if has_detail:
            msg += "; {detail}"
        hints = []
        if self.max_new_tokens_that_fit is not None:
            if self.max_new_tokens_that_fit >= 1:
                hints.append(
                    f"at {{beam_width}}={self.beam_width} it fits with {{max_new_tokens}} <= "
                    f"{self.max_new_tokens_that_fit}"
                )
            else:
                hints.append(f"at {{beam_width}}={self.beam_width} no {{max_new_tokens}} fits this prompt")
        if self.beam_width_that_fits is not None:
            if self.beam_width_that_fits >= 1:
                hints.append(
                    f"at {{max_new_tokens}}={self.max_new_tokens} it fits with {{beam_width}} <= "
                    f"{self.beam_width_that_fits}"
                )
            else:
                hints.append(f"at {{max_new_tokens}}={self.max_new_tokens} no {{beam_width}} fits "
                             "this prompt")
        if hints:
            msg += "; " + "; ".join(hints)
        return msg


class QueueFullError(WidebeamError, RuntimeError):
    """The engine's waiting queue is at its bound (`max_waiting_requests`, `max_waiting_blocks`): the request
    was not queued (nothing of it is held). `retry_after_s`: when the queue should have room, estimated from
    the recent rate of finished requests (the server's 429 `Retry-After`)."""

    def __init__(self, message: str, retry_after_s: int, setting: str):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.setting = setting


class CacheTooSmallError(WidebeamError, ValueError):
    """Start-up sizing cannot honour a setting (e.g. max_seq_len larger than the pool's token capacity)."""


class OutOfBlocksError(WidebeamError, RuntimeError):
    """A pool has no free block. Admission reserves worst cases, so this signals a bookkeeping bug."""


class BlockStateError(WidebeamError, RuntimeError):
    """A block was used after it was freed, or freed twice."""


class ModelNotFoundError(WidebeamError, FileNotFoundError):
    """The `model=` string names nothing widebeam can find; the message says what would fit."""


class ModelFormatError(WidebeamError, ValueError):
    """The model's files exist but cannot be used as they are (pickle-only, bad checksum, bad GGUF)."""


class ConfigError(WidebeamError, ValueError):
    """A model config that is missing or cannot be read."""


class UnsupportedModelError(WidebeamError, ValueError):
    """A model or config feature widebeam does not implement; the message names what is supported."""
