"""Marian (MarianMTModel, the Helsinki-NLP opus-mt translation models): the BART family's layers
(bart_family.py) with their defaults, which are Marian's: post-norm layers, sinusoidal positions
(sines | cosines halves, computed, never stored), embeddings scaled by sqrt(d_model), one shared
embedding matrix and a `final_logits_bias`. Kept as names for the callers that import them."""

from __future__ import annotations

from widebeam.model.bart_family import ACTIVATIONS, Seq2SeqConfig, Seq2SeqLM, sinusoidal_table

MarianConfig = Seq2SeqConfig
MarianMTModel = Seq2SeqLM

__all__ = ["ACTIVATIONS", "MarianConfig", "MarianMTModel", "sinusoidal_table"]
