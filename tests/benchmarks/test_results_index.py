"""benchmarks/results/ stays readable: every result file is either cited by a guide, the README or a
benchmark script, or listed in benchmarks/results/README.md (which says what it backs), and the index
lists no file that is gone. A citation may name a file with a path, brace alternatives
(`bench_peers_{float32,int8}.json`) or a glob with a stem (`beam_vs_hf*.json`)."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
INDEX = RESULTS / "README.md"
# A file name as the guides and scripts write it: word characters, dots, slashes, braces, commas, stars.
_CITATION = re.compile(r"[\w{},*./-]+\.(?:json|md|png|\{[\w,]+\})")
_INDEX_LINE = re.compile(r"^- `([^`]+)`", re.MULTILINE)


def _expand_braces(name: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", name)
    if match is None:
        return [name]
    return [expanded for alternative in match.group(1).split(",")
            for expanded in _expand_braces(name[:match.start()] + alternative + name[match.end():])]


def result_files() -> list[str]:
    """Paths relative to benchmarks/results/, the index and unfinished writes (*.tmp) aside."""
    return sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*")
                  if p.is_file() and p != INDEX and p.suffix != ".tmp")


def cited_files(files: list[str]) -> set[str]:
    sources = [*ROOT.glob("docs/**/*.md"), ROOT / "README.md", *ROOT.glob("benchmarks/*.py"),
               *ROOT.glob("benchmarks/*.sh")]
    cited = set()
    for source in sources:
        for token in _CITATION.findall(source.read_text()):
            for name in _expand_braces(token):
                name = name.split("results/")[-1]
                if "*" in name and len(name.split("*")[0]) < 3:
                    continue  # `*.md` says where a kind of file goes, not which file backs what
                cited |= {f for f in files if name in (f, f.rsplit("/", 1)[-1]) or fnmatch.fnmatch(f, name)}
    return cited


def indexed_files() -> list[str]:
    return _INDEX_LINE.findall(INDEX.read_text())


def test_every_result_file_is_cited_or_indexed():
    files = result_files()
    orphans = set(files) - cited_files(files) - set(indexed_files())
    assert not orphans, (f"benchmarks/results/ files cited by no guide, README or benchmark script and not "
                         f"in benchmarks/results/README.md: {sorted(orphans)}")


def test_the_index_lists_existing_files_once():
    listed = indexed_files()
    assert listed, "benchmarks/results/README.md lists no file"
    assert len(listed) == len(set(listed)), [name for name in listed if listed.count(name) > 1]
    missing = [name for name in listed if not (RESULTS / name).is_file()]
    assert not missing, f"benchmarks/results/README.md lists files that do not exist: {missing}"


def test_citations_expand_braces_and_globs():
    files = ["bench_peers_float32.json", "bench_peers_int8.json", "beam_vs_hf_rerun.json", "genrec.md"]
    assert _expand_braces("a_{x,y}.{json,md}") == ["a_x.json", "a_x.md", "a_y.json", "a_y.md"]
    assert {f for f in files if fnmatch.fnmatch(f, "beam_vs_hf*.json")} == {"beam_vs_hf_rerun.json"}
