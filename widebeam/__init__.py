"""widebeam: beam search at any width, with exact, beam-aware KV-cache accounting.

Vocabulary: a *block* holds `tokens_per_block` (T) *slots*; a *pool* is the blocks of one KV kind;
*required blocks* are the most a request can ever hold in a pool; *capacity* is what the pool has.

    from widebeam import LLM, BeamSearchParams
    out = LLM().generate(["Translate to French: cheese"], BeamSearchParams(beam_width=8, max_new_tokens=32))
"""

from widebeam.errors import RequestTooLargeError

__version__ = "0.1.0"
__all__ = ["LLM", "BeamSearchParams", "LLMEngine", "RequestTooLargeError", "SamplingParams", "ScoreParams",
           "__version__"]

# The engine pulls in torch and transformers; `widebeam plan` should not pay for that.
_LAZY = {
    "LLM": "widebeam.llm",
    "LLMEngine": "widebeam.engine",
    "SamplingParams": "widebeam.params",
    "BeamSearchParams": "widebeam.params",
    "ScoreParams": "widebeam.score_params",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'widebeam' has no attribute {name!r}")
