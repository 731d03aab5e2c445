"""The model-family table: one torch-free entry per family widebeam runs.

An entry names the config `model_type`s it serves, the one function that parses such a config into
the architecture the KV layer needs (`ModelArch`) plus the family's own settings, how its checkpoint
names differ from the model's parameters, and the builder of the runtime model (imported on first
use, so `widebeam plan` never imports torch). `loading/arch.py: load_arch` (the plan) and
`widebeam.model.loading.build.build_model` (the engine) both go through `parse_config`.

Adding a family: write its parse function (decoder_config.py, seq2seq_config.py, t5_config.py),
point it at a builder (the unified decoder in decoder.py covers pre-norm RoPE decoders), and add a
row here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from widebeam.errors import ConfigError, UnsupportedModelError
from widebeam.model.families import decoder_config as fc
from widebeam.model.families import seq2seq_config
from widebeam.model.families.arch import ModelArch
from widebeam.model.families.t5_config import parse_t5


@dataclass(frozen=True)
class PackedWeight:
    """A checkpoint tensor holding several of the model's parameters stacked along dim 0 (rows)."""

    packed: str  # module path inside a layer, e.g. "self_attn.qkv_proj"
    parts: tuple[str, ...]  # the model's modules, in stacking order
    part_rows: Callable[[ModelArch], tuple[int, ...]]  # rows of each part


@dataclass(frozen=True)
class CheckpointLayout:
    """How a checkpoint's tensor names differ from the model's parameter names."""

    renamed_prefixes: tuple[tuple[str, str], ...] = ()  # (checkpoint prefix, model prefix), first match wins
    skipped_prefixes: tuple[str, ...] = ()  # tensors the model does not use (a vision tower)
    packed_weights: tuple[PackedWeight, ...] = ()


SAME_NAMES = CheckpointLayout()

# Gemma3ForConditionalGeneration: (old layout, transformers 5 layout) -> text-only names.
GEMMA3_MULTIMODAL_LAYOUT = CheckpointLayout(
    renamed_prefixes=(("model.language_model.", "model."), ("language_model.model.", "model."),
                      ("language_model.lm_head.", "lm_head.")),
    skipped_prefixes=("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                      "model.multi_modal_projector."),
)


def _qkv_rows(arch: ModelArch) -> tuple[int, int, int]:
    kv_rows = arch.num_kv_heads * arch.head_dim
    return arch.num_heads * arch.head_dim, kv_rows, kv_rows


def _gate_up_rows(arch: ModelArch) -> tuple[int, int]:
    return arch.intermediate_size, arch.intermediate_size


# Phi-3 checkpoints fuse q/k/v and gate/up (transformers' Phi3Attention slices q, k, v in that
# order; Phi3MLP chunks gate first); the decoder keeps them separate like every other family.
PHI3_LAYOUT = CheckpointLayout(packed_weights=(
    PackedWeight("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 _qkv_rows),
    PackedWeight("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"), _gate_up_rows),
))

_DECODER = "widebeam.model.families.decoder:build_decoder"


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    parse: Callable[[dict, str], tuple[ModelArch, Any]]
    builder: str  # "module:function" taking a ParsedConfig; imported on first build
    layouts: dict[str, CheckpointLayout] = field(default_factory=dict)  # by model type; absent: SAME_NAMES

    def build(self, parsed: ParsedConfig):
        module, function = self.builder.split(":")
        return getattr(importlib.import_module(module), function)(parsed)


@dataclass(frozen=True)
class ParsedConfig:
    """A config parsed once: what every consumer (plan, builder, engine settings) reads."""

    family: Family
    model_type: str
    arch: ModelArch
    settings: Any  # the family's dataclass (DecoderSettings, MarianSettings)

    @property
    def checkpoint_layout(self) -> CheckpointLayout:
        return self.family.layouts.get(self.model_type, SAME_NAMES)


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",), fc.parse_llama, _DECODER),
    Family("qwen2", ("qwen2",), fc.parse_qwen2, _DECODER),
    Family("mistral", ("mistral",), fc.parse_mistral, _DECODER),
    Family("gemma3", ("gemma3_text", "gemma3"), fc.parse_gemma3, _DECODER,
           layouts={"gemma3": GEMMA3_MULTIMODAL_LAYOUT}),
    Family("marian", ("marian",), seq2seq_config.parse_marian, "widebeam.model.loading.build:build_seq2seq"),
    Family("qwen3", ("qwen3",), fc.parse_qwen3, _DECODER),
    Family("phi3", ("phi3",), fc.parse_phi3, _DECODER, layouts={"phi3": PHI3_LAYOUT}),
    Family("t5", ("t5", "mt5"), parse_t5, "widebeam.model.families.t5:build_t5"),
    Family("m2m100", ("m2m_100",), seq2seq_config.parse_m2m100, "widebeam.model.loading.build:build_seq2seq"),
    Family("bart", ("bart",), seq2seq_config.parse_bart, "widebeam.model.loading.build:build_seq2seq"),
    Family("mbart", ("mbart",), seq2seq_config.parse_mbart, "widebeam.model.loading.build:build_seq2seq"),
)
SUPPORTED_MODEL_TYPES = tuple(t for family in FAMILIES for t in family.model_types)
_BY_MODEL_TYPE = {t: family for family in FAMILIES for t in family.model_types}


def family_for(config: dict) -> Family:
    model_type = config.get("model_type")
    family = _BY_MODEL_TYPE.get(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"model architecture {model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return family


def parse_config(config: dict, name: str | None = None) -> ParsedConfig:
    """The one parse of a Hugging Face config dict. ConfigError for a missing or mangled field,
    UnsupportedModelError for a family or feature widebeam does not run."""
    family = family_for(config)
    model_type = str(config["model_type"])
    name = name or str(config.get("_name_or_path") or model_type)
    try:
        arch, settings = family.parse(config, name)
    except (ConfigError, UnsupportedModelError):
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"config for {name!r} lacks or mangles a required field: {exc}") from None
    return ParsedConfig(family, model_type, arch, settings)


@dataclass(frozen=True)
class GenerationSettings:
    """What generation reads from config.json and generation_config.json beside the model."""

    decoder_start_token_id: int | None  # encoder-decoder models: the decoder's first token
    suppress_token_ids: tuple[int, ...]  # never generated (single-token bad_words_ids)
    forced_eos_token_id: int | None  # the last allowed token is this EOS (transformers' processor)
    eos_token_ids: frozenset[int]  # from the generation config and the model config (not the tokenizer)
    forced_bos_token_id: int | None = None  # the first generated token (BART: bos; mBART-50: a language)


def _token_ids(value) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


def generation_settings(config: dict, generation_config: dict) -> GenerationSettings:
    """`generation_config` is generation_config.json's dict ({} when the model has none).

    Decoder-only models: only EOS ids. Encoder-decoder models: the decoder start is the generation
    config's, else the model's (Marian: config decoder_start_token_id, else pad); single-token
    `bad_words_ids` are suppressed (longer banned sequences are not supported); as in transformers,
    a saved generation config is the whole story for `forced_eos_token_id` and `forced_bos_token_id`
    (a setting it leaves out is off), and only a model without one falls back to config.json.
    """
    eos = _token_ids(generation_config.get("eos_token_id")) | _token_ids(config.get("eos_token_id"))
    parsed = parse_config(config)
    if not parsed.arch.is_encoder_decoder:
        return GenerationSettings(None, (), None, frozenset(eos))
    start = generation_config.get("decoder_start_token_id")
    if start is None:
        start = parsed.settings.decoder_start_token_id
    bad_words = generation_config.get("bad_words_ids") or []
    suppress = tuple(sorted({ids[0] for ids in bad_words if len(ids) == 1}))
    forcing = generation_config if generation_config else config
    forced_eos, forced_bos = forcing.get("forced_eos_token_id"), forcing.get("forced_bos_token_id")
    return GenerationSettings(int(start), suppress, forced_eos if _is_token_id(forced_eos) else None,
                              frozenset(eos), forced_bos if _is_token_id(forced_bos) else None)


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
