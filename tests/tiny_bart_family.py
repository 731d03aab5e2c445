"""Tiny random M2M100 (NLLB), BART and mBART models built with transformers and saved as safetensors,
for the BART-family parity tests (tests/parity/test_bart_family_parity.py) and the family table tests.

Every setting that changes transformers' outputs is stated in the saved generation config: the decoder
starts at EOS, PAD is banned (M2M100 gives a PAD token the padding position, which a paged decoder
does not reproduce; see docs/translation-families.md), no forced BOS or EOS.
"""

from __future__ import annotations

import torch

PAD, BOS, EOS = 1, 0, 2
# The small shape of every family: d_model 64, 4 heads, encoder and decoder layers of their own sizes.
_SMALL_SEQ2SEQ = {
    "vocab_size": 128, "d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 96,
    "decoder_ffn_dim": 80, "max_position_embeddings": 128, "pad_token_id": PAD, "bos_token_id": BOS,
    "eos_token_id": EOS, "decoder_start_token_id": EOS, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "tie_word_embeddings": True,
}
TINY_CONFIGS = {
    # NLLB-200's switches: relu, scaled embeddings (M2M100Config's defaults, stated)
    "m2m100": {**_SMALL_SEQ2SEQ, "model_type": "m2m_100", "activation_function": "relu",
               "scale_embedding": True, "encoder_attention_heads": 8},  # encoder heads of its own
    "bart": {**_SMALL_SEQ2SEQ, "model_type": "bart", "activation_function": "gelu", "scale_embedding": False},
    # mBART checkpoints scale their embeddings (MBartConfig's default does not)
    "mbart": {**_SMALL_SEQ2SEQ, "model_type": "mbart", "activation_function": "gelu",
              "scale_embedding": True},
}
# The real shapes at reduced depth (one encoder and one decoder layer).
NLLB_600M_SHAPE = {**TINY_CONFIGS["m2m100"], "vocab_size": 256206, "d_model": 1024, "encoder_layers": 1,
                   "decoder_layers": 1, "encoder_attention_heads": 16, "decoder_attention_heads": 16,
                   "encoder_ffn_dim": 4096, "decoder_ffn_dim": 4096, "max_position_embeddings": 1024}
BART_BASE_SHAPE = {**TINY_CONFIGS["bart"], "vocab_size": 50265, "d_model": 768, "encoder_layers": 1,
                   "decoder_layers": 1, "encoder_attention_heads": 12, "decoder_attention_heads": 12,
                   "encoder_ffn_dim": 3072, "decoder_ffn_dim": 3072, "max_position_embeddings": 1024}
# Everything in HF's generation config that changes outputs, stated for `generate`.
HF_SETTINGS = {"do_sample": False, "eos_token_id": EOS, "pad_token_id": PAD, "decoder_start_token_id": EOS,
               "bad_words_ids": [[PAD]], "forced_bos_token_id": None, "forced_eos_token_id": None,
               "no_repeat_ngram_size": 0, "repetition_penalty": 1.0}


# Per family: enough that beams finish on EOS within a dozen tokens, not so much that they stop at once.
EOS_LOGIT_BIAS = {"m2m_100": 1.0, "bart": 4.0, "mbart": 4.0}


def hf_class(model_type: str):
    import transformers

    return {"m2m_100": transformers.M2M100ForConditionalGeneration,
            "bart": transformers.BartForConditionalGeneration,
            "mbart": transformers.MBartForConditionalGeneration}[model_type]


def save_tiny_seq2seq(path, config: dict, eos_bias: float | None = None, std: float = 0.3,
                      embed_std: float = 0.1):
    """Build the HF model of `config` with sharpened random weights (so greedy and beam choices are
    well separated), random LayerNorms (so a misplaced norm shows), and an EOS preference (so beams do
    finish): final_logits_bias where the family has one, else the decoder's final layer_norm bias along
    the EOS embedding. Saves it as safetensors with its generation config; returns it."""
    from transformers import AutoConfig, GenerationConfig
    from transformers.initialization import no_init_weights

    config = dict(config)
    model_type = config.pop("model_type")
    eos_bias = EOS_LOGIT_BIAS[model_type] if eos_bias is None else eos_bias
    torch.manual_seed(0)
    # every parameter is drawn below: HF's own init would only cost time (~40 s at NLLB's vocabulary)
    with no_init_weights():
        model = hf_class(model_type)(AutoConfig.for_model(model_type, **config)).eval()
    model.tie_weights()  # skipped with the init: encoder, decoder and LM head share one matrix
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5) if name.endswith("weight") else param.normal_(0, 0.1)
            else:
                param.normal_(0, embed_std if "shared" in name or "embed" in name else std)
        if hasattr(model, "final_logits_bias"):
            model.final_logits_bias.normal_(0, 0.5)
            model.final_logits_bias[0, EOS] += eos_bias
        else:
            eos_row = model.model.shared.weight[EOS]
            model.model.decoder.layer_norm.bias.add_(eos_bias * eos_row / eos_row.norm() ** 2)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=BOS,
        bad_words_ids=[[PAD]], forced_bos_token_id=None, forced_eos_token_id=None, num_beams=1)
    model.save_pretrained(str(path), safe_serialization=True)
    return model
