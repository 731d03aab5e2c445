"""CTranslate2 as a peer in `widebeam bench`: the same weights, converted once, the same prompt tokens.

CTranslate2 is the C++ engine people pick for beam search on a CPU (int8, translation). The bench's
model directory (the safetensors widebeam loads) is converted with CTranslate2's own Transformers
converter into `<cache>/ct2/<name>-<hash>-<quantization>` once, then run with `generate_batch`:
`beam_size` = W, `min_length` = `max_length` = N generated tokens (the prompt not counted), the
same thread count, the best hypothesis compared with widebeam's best beam. The optional dependency
is `pip install ctranslate2`; `--peers ctranslate2` without it is an error naming the package.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

# CTranslate2's compute type per bench row: its own float32, and int8 weights (its fastest on x86)
COMPUTE_TYPES = ("float32", "int8")


def converted_dir(model_dir: Path, quantization: str, cache_dir: Path) -> Path:
    """The CTranslate2 model of `model_dir` with `quantization` weights, converted on first use."""
    import ctranslate2

    digest = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:12]
    out = cache_dir / "ct2" / f"{model_dir.name}-{digest}-{quantization}"
    if not (out / "model.bin").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        ctranslate2.converters.TransformersConverter(str(model_dir)).convert(str(out), quantization=quantization,
                                                                            force=True)
    return out


class CT2Peer:
    """One CTranslate2 generator (a compute type) over the bench's model."""

    def __init__(self, model_dir: Path, compute_type: str, threads: int, cache_dir: Path, tokenizer):
        try:
            import ctranslate2
        except ImportError:
            raise RuntimeError("--peers ctranslate2 needs CTranslate2: pip install ctranslate2") from None
        self.compute_type = compute_type
        self.tokenizer = tokenizer
        path = converted_dir(model_dir, compute_type, cache_dir)
        self.generator = ctranslate2.Generator(str(path), device="cpu", compute_type=compute_type,
                                               inter_threads=1, intra_threads=threads)

    def run(self, prompt_ids: list[int], width: int, new_tokens: int, eos_id: int) -> dict:
        tokens = self.tokenizer.convert_ids_to_tokens(prompt_ids)
        end = self.tokenizer.convert_ids_to_tokens(eos_id)
        start = time.perf_counter()
        (result,) = self.generator.generate_batch([tokens], beam_size=width, num_hypotheses=1,
                                                  max_length=new_tokens, min_length=new_tokens, end_token=end,
                                                  include_prompt_in_result=False, return_scores=True)
        elapsed = time.perf_counter() - start
        return {"wall_s": elapsed, "best": list(result.sequences_ids[0])}
