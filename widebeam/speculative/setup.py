"""Starting speculative decoding: the drafter of a `SpeculativeConfig`, and for a draft model its
worker, whose pools ("draft", "draft/sliding_w") the engine sizes beside the target's."""

from __future__ import annotations

import torch

from widebeam.config import SpeculativeConfig
from widebeam.errors import InvalidParameterError
from widebeam.layout import DRAFT_PREFIX
from widebeam.model.loading.build import load_model, load_tokenizer
from widebeam.model.loading.sources import resolve_model
from widebeam.speculative.drafter import ModelDrafter, NgramDrafter
from widebeam.worker import Worker


def start_drafter(spec: SpeculativeConfig, target_arch, target_tokenizer, target_model_name: str,
                  dtype: str, device: torch.device,
                  kv_cache_dtype: str = "auto") -> tuple[ModelDrafter | NgramDrafter, Worker | None]:
    """(drafter, the draft model's worker or None); refuses an encoder-decoder target or draft and a
    draft whose token ids mean something else, naming the option."""
    if target_arch.is_encoder_decoder:
        raise InvalidParameterError("speculative_method", "speculative decoding runs decoder-only models; "
                                    "this model is an encoder-decoder")
    if spec.method == "ngram":
        return NgramDrafter(), None
    draft_source = resolve_model(spec.model)
    draft_model = load_model(draft_source, spec.dtype or dtype, device)
    if not same_token_ids(target_tokenizer, load_tokenizer(draft_source), target_arch.vocab_size,
                          draft_model.arch.vocab_size):
        raise InvalidParameterError(
            "speculative_model", "{speculative_model} {value!r} must share the target's tokenizer (the same "
            "token ids): its vocabulary differs from {model!r}'s", value=spec.model, model=target_model_name)
    if draft_model.arch.is_encoder_decoder:
        raise InvalidParameterError("speculative_model", "{speculative_model} {value!r} must be a "
                                    "decoder-only model", value=spec.model)
    worker = Worker("draft", draft_model, spec.dtype or dtype, prefix=DRAFT_PREFIX,
                    kv_cache_dtype=kv_cache_dtype)
    return ModelDrafter(worker, min(target_arch.vocab_size, draft_model.arch.vocab_size)), worker


def same_token_ids(target_tokenizer, draft_tokenizer, target_vocab_size: int, draft_vocab_size: int) -> bool:
    """Whether a draft's token ids mean what the target's do: the same tokenizer vocabulary, or,
    for two models without a tokenizer (token-id prompts only), the same vocabulary size."""
    if target_tokenizer is None and draft_tokenizer is None:
        return target_vocab_size == draft_vocab_size
    if target_tokenizer is None or draft_tokenizer is None:
        return False
    return target_tokenizer.get_vocab() == draft_tokenizer.get_vocab()
