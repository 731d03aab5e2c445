"""CTranslate2 as a peer in `widebeam bench`: the same weights, converted once, the same prompt tokens.

CTranslate2 is the C++ engine people pick for beam search on a CPU (int8, translation). The bench's
model directory (the safetensors widebeam loads) is converted with CTranslate2's own Transformers
converter into `<cache>/ct2/<name>-<hash>-<quantization>` once, then run with `generate_batch`:
`beam_size` = W, `min_length` = `max_length` = N generated tokens (the prompt not counted), the
same thread count, the best hypothesis compared with widebeam's best beam. The optional dependency
is `pip install ctranslate2`; `--peers ctranslate2` without it is an error naming the package.

Each generator runs in a process of its own (spawned; timed inside it): CTranslate2 ships its own
OpenMP runtime, and once it had run in the bench's process every later widebeam run there was
1.3-1.8x slower (int8, W=1: 1.35-2.0 s before its first run, 2.2-2.7 s after), which made the
comparison measure the neighbour, not the engines.
"""

from __future__ import annotations

import hashlib
import importlib.util
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
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
        ctranslate2.converters.TransformersConverter(str(model_dir)).convert(
            str(out), quantization=quantization, force=True)
    return out


_model = None  # the worker process's CTranslate2 model: a Generator or a Translator


def _load(kind: str, model_dir: Path, compute_type: str, threads: int, cache_dir: Path) -> None:
    """The worker's initializer: `kind` is "Generator" (decoder-only) or "Translator" (encoder-decoder)."""
    import ctranslate2

    global _model
    path = converted_dir(model_dir, compute_type, cache_dir)
    _model = getattr(ctranslate2, kind)(str(path), device="cpu", compute_type=compute_type, inter_threads=1,
                                        intra_threads=threads)


class _WorkerPeer:
    """A CTranslate2 model of one compute type in a spawned worker process of its own."""

    kind = ""

    def __init__(self, model_dir: Path, compute_type: str, threads: int, cache_dir: Path, tokenizer):
        # only looked for here: the library itself is loaded, and the model converted, in the worker
        if importlib.util.find_spec("ctranslate2") is None:
            raise RuntimeError("the CTranslate2 peer needs CTranslate2: pip install ctranslate2")
        self.compute_type = compute_type
        self.tokenizer = tokenizer
        self._worker = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                           initializer=_load,
                                           initargs=(self.kind, Path(model_dir), compute_type, threads,
                                                     Path(cache_dir)))

    def close(self) -> None:
        self._worker.shutdown()


def _generate(tokens: list[str], width: int, new_tokens: int, end: str) -> tuple[float, list[int]]:
    start = time.perf_counter()
    (result,) = _model.generate_batch([tokens], beam_size=width, num_hypotheses=1, max_length=new_tokens,
                                      min_length=new_tokens, end_token=end,
                                      include_prompt_in_result=False, return_scores=True)
    return time.perf_counter() - start, list(result.sequences_ids[0])


class CT2Peer(_WorkerPeer):
    """One CTranslate2 generator (a compute type) over the bench's model, in a worker process."""

    kind = "Generator"

    def run(self, prompt_ids: list[int], width: int, new_tokens: int, eos_id: int) -> dict:
        tokens = self.tokenizer.convert_ids_to_tokens(prompt_ids)
        end = self.tokenizer.convert_ids_to_tokens(eos_id)
        elapsed, best = self._worker.submit(_generate, tokens, width, new_tokens, end).result()
        return {"wall_s": elapsed, "best": best}



# Encoder-decoder models (benchmarks/seq2seq.py): a `ctranslate2.Translator` in a worker of its own, for
# the same reason; the worker also reports its own peak RSS, since its memory is not the bench's.
def _translate(sources: list[list[str]], width: int, new_tokens: int,
               max_batch_size: int) -> tuple[float, int, list[list[str]]]:
    from widebeam import memstats

    memstats.reset_peak_rss(trim_heap=True)
    start = time.perf_counter()
    results = _model.translate_batch(sources, beam_size=width, num_hypotheses=1,
                                     min_decoding_length=new_tokens, max_decoding_length=new_tokens,
                                     max_batch_size=max_batch_size)
    elapsed = time.perf_counter() - start
    return elapsed, memstats.rss_bytes("VmHWM") or 0, [r.hypotheses[0] for r in results]


class CT2TranslatorPeer(_WorkerPeer):
    """One CTranslate2 translator (a compute type) over an encoder-decoder model dir, in a worker process."""

    kind = "Translator"

    def run(self, sources: list[list[int]], width: int, new_tokens: int, max_batch_size: int = 0) -> dict:
        """Every source translated with `new_tokens` tokens (min = max decoding length), `max_batch_size`
        sources at a time (0: all at once); the best hypothesis of each as token ids."""
        tokens = [self.tokenizer.convert_ids_to_tokens(ids) for ids in sources]
        elapsed, peak_rss, best = self._worker.submit(_translate, tokens, width, new_tokens,
                                                      max_batch_size).result()
        return {"wall_s": elapsed, "peak_rss_bytes": peak_rss,
                "best": [self.tokenizer.convert_tokens_to_ids(h) for h in best]}
