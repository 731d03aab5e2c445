"""Request parameters. Validation errors name the field and its allowed range."""

from __future__ import annotations

from dataclasses import dataclass, fields

from widebeam.errors import InvalidParameterError


def _require(condition: bool, param: str, message: str) -> None:
    if not condition:
        raise InvalidParameterError(param, f"{param} {message}")


def _as_tuple(params, name: str, kind: type) -> None:
    value = getattr(params, name)
    if value is None:
        value = ()
    elif isinstance(value, (str, int)):
        value = (value,)
    value = tuple(value)
    for item in value:
        _require(isinstance(item, kind) and not isinstance(item, bool), name,
                 f"must hold only {kind.__name__} values, got {item!r}")
    object.__setattr__(params, name, value)


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

    def __post_init__(self) -> None:
        _as_tuple(self, "stop", str)
        _as_tuple(self, "stop_token_ids", int)
        _require(self.max_new_tokens is None or (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1),
                 "max_new_tokens", f"must be an integer >= 1 or None, got {self.max_new_tokens!r}")
        _require(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _require(isinstance(self.top_k, int) and self.top_k >= -1, "top_k",
                 f"must be -1 or 0 (off) or a positive integer, got {self.top_k!r}")
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(isinstance(self.min_new_tokens, int) and self.min_new_tokens >= 0, "min_new_tokens",
                 f"must be an integer >= 0, got {self.min_new_tokens!r}")
        _require(self.max_new_tokens is None or self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
                 f"must be <= max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}")
        _require(all(s for s in self.stop), "stop", "must not contain empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def beam_width(self) -> int:
        return 1

    def replace(self, **changes) -> SamplingParams:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return type(self)(**values)
