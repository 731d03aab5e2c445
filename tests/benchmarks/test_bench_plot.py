"""The bench's plot draws every engine a row measured: widebeam, transformers and both CTranslate2
compute types (they were in the JSON but not drawn), and skips an engine's point it did not time."""

from __future__ import annotations

from widebeam.bench import measured_engines, plot


def row(width: int, **engines) -> dict:
    return {"beam_width": width, "prompt_len": 64, **{k: ({"wall_s": v} if v else {"skipped": "KV"})
                                                      for k, v in engines.items()}}


def test_every_measured_engine_is_drawn(tmp_path):
    names = {"widebeam": 1.0, "transformers": 2.0, "ctranslate2 float32": 1.5, "ctranslate2 int8": 1.2}
    rows = [row(1, **names), row(4, **{**names, "transformers": None})]
    assert measured_engines(rows) == ["widebeam", "transformers", "ctranslate2 float32", "ctranslate2 int8"]
    labels = plot(rows, tmp_path / "bench.png", "tiny", 8)
    assert labels == [f"{name} P=64" for name in measured_engines(rows)]
    assert (tmp_path / "bench.png").stat().st_size > 0
