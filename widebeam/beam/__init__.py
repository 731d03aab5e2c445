"""Beam search: a model-free state machine that scores exactly like Hugging Face `generate(num_beams=...)`."""

from widebeam.beam.hypothesis import Hypothesis, StepResult
from widebeam.beam.scores import hypothesis_score, length_normalizer
from widebeam.beam.search import BeamSearchState

__all__ = ["BeamSearchState", "Hypothesis", "StepResult", "hypothesis_score", "length_normalizer"]
