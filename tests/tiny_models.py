"""Tiny random models built with transformers and saved as safetensors, for tests.

A module of its own (not conftest.py): tests/ and tests/e2e/ both have a conftest, so
`from conftest import ...` would be ambiguous.
"""

from __future__ import annotations

import torch


def save_tiny_model(path, model_type: str = "llama", random_norms: bool = False, **overrides):
    """Build a tiny random model of a family transformers ships, save it as safetensors, return it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
    }
    base.update(overrides)
    config = AutoConfig.for_model(model_type, **base)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Random init is near-uniform; sharpen the distribution so greedy choices are well separated.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.2)
            elif random_norms:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


# Marian's generation config bans the pad token (which is also the decoder start token); the tiny
# model keeps that, and states every other setting that changes HF's outputs, so the parity
# tests compare like with like.
TINY_MARIAN_PAD = 127
TINY_MARIAN_EOS = 2


def save_tiny_marian(path, eos_logit_bias: float = 3.5, vocab_size: int = 128, pad: int = TINY_MARIAN_PAD,
                     eos: int = TINY_MARIAN_EOS, forced_eos: bool = False, **overrides):
    """A tiny random MarianMTModel (opus-mt layout: swish, scaled embeddings, shared embeddings,
    sinusoidal positions), saved as safetensors with its generation config; returns it."""
    from transformers import GenerationConfig, MarianConfig, MarianMTModel

    base = {
        "vocab_size": vocab_size, "decoder_vocab_size": vocab_size, "d_model": 64, "encoder_layers": 2,
        "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
        "encoder_ffn_dim": 96,
        "decoder_ffn_dim": 80, "max_position_embeddings": 128, "pad_token_id": pad, "eos_token_id": eos,
        "decoder_start_token_id": pad, "forced_eos_token_id": eos if forced_eos else None,
        "activation_function": "swish",
        "scale_embedding": True, "share_encoder_decoder_embeddings": True, "tie_word_embeddings": True,
    }
    base.update(overrides)
    torch.manual_seed(0)
    model = MarianMTModel(MarianConfig(**base)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # the sinusoidal tables are (frozen) parameters too, but never saved: leave them exact
            if "norm" not in name and "embed_positions" not in name:
                param.normal_(0, 0.2)
        model.final_logits_bias.normal_(0, 0.5)
        model.final_logits_bias[0, eos] += eos_logit_bias  # so beams do finish on EOS
    model.generation_config = GenerationConfig(
        decoder_start_token_id=pad, eos_token_id=eos, pad_token_id=pad, bad_words_ids=[[pad]],
        forced_eos_token_id=eos if forced_eos else None, num_beams=1,
    )
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def save_tiny_marian_tokenizer(path):
    """A MarianTokenizer over a tiny SentencePiece model trained here on a few English sentences (same
    model for source and target, as opus-mt ships two); returns it. Its vocabulary: </s> = 0, <unk> = 1,
    the pieces, then <pad> last."""
    import io
    import json
    from pathlib import Path

    import sentencepiece as spm
    from transformers import MarianTokenizer

    sentences = ["the cat sat on the mat", "a dog runs in the park", "hello world",
                 "translate this sentence please",
                 "beam search finds good translations", "the quick brown fox jumps over the lazy dog"] * 20
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=proto, vocab_size=60,
                                   model_type="unigram", character_coverage=1.0, bos_id=-1, eos_id=-1,
                                   unk_id=0, pad_id=-1, hard_vocab_limit=False, minloglevel=2)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for name in ("source.spm", "target.spm"):
        (path / name).write_bytes(proto.getvalue())
    processor = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    vocab = {"</s>": 0, "<unk>": 1}
    for i in range(processor.get_piece_size()):
        vocab.setdefault(processor.id_to_piece(i), len(vocab))
    vocab["<pad>"] = len(vocab)
    (path / "vocab.json").write_text(json.dumps(vocab))
    tokenizer = MarianTokenizer(str(path / "source.spm"), str(path / "target.spm"), str(path / "vocab.json"))
    tokenizer.save_pretrained(str(path))
    return tokenizer


def save_tiny_model_with_norms(path, model_type: str, **overrides):
    """`save_tiny_model`, but the RMSNorm weights (q_norm and k_norm included) are random around 1
    too, so a model that skips or misplaces a norm, or loads it into the wrong slot, gets different
    logits. Returns the transformers model."""
    return save_tiny_model(path, model_type, random_norms=True, **overrides)

def save_noisy_copy(source_dir, path, noise: float, seed: int = 1):
    """The model in `source_dir` with Gaussian noise (std `noise`) on every weight, saved to `path`:
    a draft that agrees with its target often but not always."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(source_dir), dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * noise)
    model.save_pretrained(str(path), safe_serialization=True)
    return model
