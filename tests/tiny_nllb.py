"""A tiny NLLB-shaped model (M2M100 architecture, NLLB's tokenizer class) for translation tests.

The tokenizer is NLLB's own class over a SentencePiece model trained here on a few sentences, with
three language codes as special tokens: a source encodes as `[src_lang] pieces </s>`, and a target
language code is one token (`fra_Latn`), as in facebook/nllb-200-*. The model is a random M2M100
(pre-norm, sinusoidal positions with the padding offset, scaled embeddings) of that vocabulary,
saved as safetensors with a generation config that states NLLB's decoder start (`</s>`) and bans PAD.
"""

from __future__ import annotations

import io
import json

import torch

NLLB_LANGUAGES = ("eng_Latn", "fra_Latn", "deu_Latn")
_SENTENCES = ("the quick brown fox jumps over the lazy dog", "a translation test sentence",
              "hello world", "beam search at any width", "wide beams share one prompt")


def save_tiny_nllb_tokenizer(path):
    import sentencepiece as spm
    from transformers import AutoTokenizer

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_SENTENCES * 40), model_writer=model,
                                   vocab_size=64, model_type="unigram", character_coverage=1.0,
                                   hard_vocab_limit=False, minloglevel=2)
    path.mkdir(parents=True, exist_ok=True)
    (path / "sentencepiece.bpe.model").write_bytes(model.getvalue())
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "NllbTokenizer"}))
    tokenizer = AutoTokenizer.from_pretrained(str(path), extra_special_tokens=list(NLLB_LANGUAGES),
                                              src_lang="eng_Latn")
    (path / "sentencepiece.bpe.model").unlink()  # tokenizer.json carries it all
    tokenizer.save_pretrained(str(path))
    return tokenizer


def save_tiny_nllb(path, vocab_size: int = 64):
    """Tokenizer + random M2M100 model in `path`; returns (hf model, tokenizer)."""
    from transformers import GenerationConfig, M2M100Config, M2M100ForConditionalGeneration

    tokenizer = save_tiny_nllb_tokenizer(path)
    assert len(tokenizer) <= vocab_size, len(tokenizer)
    config = M2M100Config(vocab_size=vocab_size, d_model=32, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                          decoder_ffn_dim=64, max_position_embeddings=128, scale_embedding=True,
                          pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.eos_token_id,
                          activation_function="relu", dropout=0.0, attention_dropout=0.0,
                          activation_dropout=0.0)
    torch.manual_seed(0)
    model = M2M100ForConditionalGeneration(config).eval()
    with torch.no_grad():  # sharpen the near-uniform random init so choices are well separated
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.3)
    # PAD is banned on both sides: transformers' M2M100 gives a generated PAD the padding position,
    # which a paged decoder does not (docs/translation-families.md)
    model.generation_config = GenerationConfig(decoder_start_token_id=tokenizer.eos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id,
                                               bos_token_id=tokenizer.bos_token_id,
                                               bad_words_ids=[[tokenizer.pad_token_id]])
    model.save_pretrained(str(path), safe_serialization=True)
    return model, tokenizer
