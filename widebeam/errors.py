"""Errors widebeam raises to its users. Every message says what was wrong and what would fit."""

from __future__ import annotations


class WidebeamError(Exception):
    """Base class for widebeam's own errors."""


class InvalidParameterError(WidebeamError, ValueError):
    """A parameter is outside its allowed range; `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class RequestTooLargeError(WidebeamError, ValueError):
    """A request needs more blocks in some pool than that pool will ever have.

    Raised at admission, before anything is queued: such a request could never run, so waiting for
    blocks to free up would spin forever.
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
        super().__init__(self._message(detail))

    def _message(self, detail: str) -> str:
        msg = (
            f"request can never fit the KV cache: pool '{self.pool}' needs {self.required_blocks} blocks "
            f"but holds {self.capacity_blocks} blocks of {self.tokens_per_block} tokens "
            f"(prompt_len={self.prompt_len}, max_new_tokens={self.max_new_tokens}, "
            f"beam_width={self.beam_width})"
        )
        if detail:
            msg += f"; {detail}"
        hints = []
        if self.max_new_tokens_that_fit is not None:
            if self.max_new_tokens_that_fit >= 1:
                hints.append(
                    f"at beam_width={self.beam_width} it fits with max_new_tokens <= "
                    f"{self.max_new_tokens_that_fit}"
                )
            else:
                hints.append(f"at beam_width={self.beam_width} no max_new_tokens fits this prompt")
        if self.beam_width_that_fits is not None:
            if self.beam_width_that_fits >= 1:
                hints.append(
                    f"at max_new_tokens={self.max_new_tokens} it fits with beam_width <= "
                    f"{self.beam_width_that_fits}"
                )
            else:
                hints.append(f"at max_new_tokens={self.max_new_tokens} no beam_width fits this prompt")
        if hints:
            msg += "; " + "; ".join(hints)
        return msg


class CacheTooSmallError(WidebeamError, ValueError):
    """Start-up sizing cannot honour a setting (e.g. max_seq_len larger than the pool's token capacity)."""


class OutOfBlocksError(WidebeamError, RuntimeError):
    """A pool has no free block. Admission reserves worst cases, so this signals a bookkeeping bug."""


class BlockStateError(WidebeamError, RuntimeError):
    """A block was used after it was freed, or freed twice."""
