"""Tiny random T5-family models (T5ForConditionalGeneration, MT5ForConditionalGeneration) saved as
safetensors the way their published checkpoints are laid out, for the T5 parity tests.

Variants: "t5" (v1.0: ReLU, LM head tied to the embeddings, decoder output scaled by d_model**-0.5),
"t5-v1_1" and "mt5" (gated GELU, an LM head of their own, no scaling). transformers 5 always ties
T5's head when it builds one, so an untied variant is made by giving the in-memory model its own
head and writing the checkpoint and config.json as google/t5-v1_1 and google/mt5 ship them
(`lm_head.weight` stored, `tie_word_embeddings: false`); the returned model is the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

T5_PAD = 0  # also the decoder start token, as in every T5 checkpoint
T5_EOS = 1

TINY_T5 = {
    "vocab_size": 96, "d_model": 32, "d_kv": 16, "num_heads": 3,  # inner 48 != d_model: d_kv is its own
    "d_ff": 40, "num_layers": 3, "num_decoder_layers": 2,  # (more decoder layers trip HF's cache)
    # few buckets and a short max distance, so the sources (up to 37 tokens) reach the log buckets
    "relative_attention_num_buckets": 8, "relative_attention_max_distance": 20,
    "layer_norm_epsilon": 1e-6, "dropout_rate": 0.0,
}
# t5-small's shape (d_model 512, 8 heads of 64, d_ff 2048, 32128 tokens, 32 buckets up to 128) at 2 layers.
T5_SMALL_SHAPE = {
    "vocab_size": 32128, "d_model": 512, "d_kv": 64, "num_heads": 8, "d_ff": 2048, "num_layers": 2,
    "num_decoder_layers": 2, "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
    "layer_norm_epsilon": 1e-6, "dropout_rate": 0.0,
}
# variant: (model_type, feed_forward_proj, tied head, (vocab_std, eos_feature, eos_boost), seed); the EOS
# settings chosen so that beams end on EOS at several lengths and others run to the length limit.
VARIANTS = {
    "t5": ("t5", "relu", True, (0.3, 4.0, 4.0), 0),
    "t5-v1_1": ("t5", "gated-gelu", False, (0.3, 2.0, 12.0), 0),
    "mt5": ("mt5", "gated-gelu", False, (0.3, 2.0, 12.0), 1),
}


def save_tiny_t5(path, variant: str = "t5", shape: dict | None = None):
    """Build, randomise, save (safetensors + config.json + generation_config.json); return the HF model."""
    from safetensors.torch import save_file
    from transformers import (
        GenerationConfig,
        MT5Config,
        MT5ForConditionalGeneration,
        T5Config,
        T5ForConditionalGeneration,
    )

    model_type, feed_forward_proj, tied, (vocab_std, eos_feature, eos_boost), seed = VARIANTS[variant]
    config_class, model_class = ((T5Config, T5ForConditionalGeneration) if model_type == "t5"
                                 else (MT5Config, MT5ForConditionalGeneration))
    config = config_class(**(shape or TINY_T5), feed_forward_proj=feed_forward_proj, tie_word_embeddings=tied,
                          pad_token_id=T5_PAD, eos_token_id=T5_EOS, decoder_start_token_id=T5_PAD)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    if not tied:
        model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.shared.weight))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layer_norm" in name:
                param.uniform_(0.5, 1.5)  # a skipped or misplaced norm changes the outputs
            elif "relative_attention_bias" in name:
                param.normal_(0, 1.0)  # large enough that a wrong bucket or direction shows
            else:
                param.normal_(0, 0.3 if param.shape[0] != config.vocab_size else vocab_std)
        _boost_eos(model, eos_boost, eos_feature)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.contiguous() for name, tensor in model.state_dict().items()
               if name not in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
               and (not tied or name != "lm_head.weight")}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    saved = config.to_dict()
    saved["tie_word_embeddings"] = tied  # as the published configs say it
    saved.pop("scale_decoder_outputs", None)  # not in published configs: tie_word_embeddings says it
    (path / "config.json").write_text(json.dumps(saved, indent=1))
    GenerationConfig(decoder_start_token_id=T5_PAD, eos_token_id=T5_EOS, pad_token_id=T5_PAD).save_pretrained(
        str(path))
    assert (model.lm_head.weight is model.shared.weight) == tied
    return model


def _boost_eos(model, boost: float, feature: float) -> None:
    """So beams do finish: hidden dimension 0 holds a positive constant through the decoder (its
    embedding column is constant and no layer writes it), and the EOS row of the head reads it."""
    model.shared.weight[:, 0] = feature
    for name, param in model.decoder.named_parameters():
        if name.endswith((".o.weight", ".wo.weight")):
            param[0] = 0.0
    model.decoder.final_layer_norm.weight[0] = 1.0
    head = model.lm_head.weight
    if head is model.shared.weight:
        head[T5_EOS, 0] = feature + boost  # also the EOS embedding's; harmless (EOS ends a beam)
    else:
        head[:, 0] = 0.0
        head[T5_EOS, 0] = boost


def save_tiny_t5_tokenizer(path):
    """A T5Tokenizer over a tiny SentencePiece unigram model trained here on task-prefixed sentences,
    laid out as T5's: <pad> = 0, </s> = 1, <unk> = 2, then the pieces (no sentinel ids). Returns it."""
    import io

    import sentencepiece as spm
    from transformers import T5Tokenizer

    sentences = ["translate English to German: the cat sat on the mat", "summarize: a dog runs in the park",
                 "translate English to French: beam search finds good translations", "hello world",
                 "the quick brown fox jumps over the lazy dog"] * 20
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=proto, vocab_size=80,
                                   model_type="unigram", character_coverage=1.0, pad_id=T5_PAD, eos_id=T5_EOS,
                                   unk_id=2, bos_id=-1, hard_vocab_limit=False, minloglevel=2)
    processor = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    vocab = [(processor.id_to_piece(i), processor.get_score(i)) for i in range(processor.get_piece_size())]
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=0)
    tokenizer.save_pretrained(str(path))
    return tokenizer
