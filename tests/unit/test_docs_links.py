"""README.md and docs/*.md hold together: every relative link and #anchor resolves, and the quick commands
of their marked code blocks run.

- Links: each `[text](target)` and `![alt](target)` outside code, in the README and every guide. A
  relative target must exist in the repository (a file or a folder); a `#anchor` must be a heading of
  the target markdown file (or of the same file), under GitHub's slug rules: the heading's text
  lowercased, punctuation other than `-` and `_` dropped, spaces turned into `-`, and a repeated slug
  suffixed `-1`, `-2`, ... External links (http, https, mailto) are not fetched.
- Commands: a fenced block right after the line `<!-- docs-test: run -->` is run line by line (a `\\`
  continues a line, `#` starts a comment); every command in it must be a `widebeam plan ...` or end in
  `--help`, the ones that take a fraction of a second without weights. In README.md no unmarked block
  may hold such a command, so every quick command the front page shows is run here.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RUN_MARKER = "<!-- docs-test: run -->"
COMMAND_TIMEOUT_S = 60  # each takes well under a second alone; the margin is for a loaded 2-core host

FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:


def documents() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def split_blocks(text: str) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """(the lines outside fenced code, each blank inside; [(line index of the opening fence, the
    block's lines)])."""
    prose, blocks, block, start = [], [], None, 0
    for number, line in enumerate(text.splitlines()):
        if FENCE.match(line.strip()):
            if block is None:
                block, start = [], number
            else:
                blocks.append((start, block))
                block = None
            prose.append("")
        elif block is not None:
            block.append(line)
            prose.append("")
        else:
            prose.append(line)
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's markdown text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors_of(text: str) -> set[str]:
    prose, _ = split_blocks(text)
    seen: dict[str, int] = {}
    anchors = set()
    for line in prose:
        anchors.update(HTML_ANCHOR.findall(line))
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading[1])
            count = seen.get(base, 0)
            seen[base] = count + 1
            anchors.add(base if count == 0 else f"{base}-{count}")
    return anchors


@cache
def anchors_in(path: Path) -> frozenset[str]:
    return frozenset(anchors_of(path.read_text()))


def links_of(text: str) -> list[str]:
    prose, _ = split_blocks(text)
    # whole paragraphs: a link's text may wrap onto the next line
    paragraphs = "\n".join(prose).split("\n\n")
    return [target for paragraph in paragraphs
            for target in LINK.findall(re.sub(r"`[^`]*`", "", paragraph))]  # code spans: examples


def link_problem(source: Path, target: str) -> str | None:
    """Why `target`, linked from the file `source`, does not resolve; None when it does."""
    if EXTERNAL.match(target):
        return None
    path_part, _, anchor = target.partition("#")
    resolved = (source.parent / path_part).resolve() if path_part else source
    if ROOT not in (resolved, *resolved.parents):
        return f"{target}: outside the repository"
    if not resolved.exists():
        return f"{target}: no file or folder {resolved.relative_to(ROOT)}"
    if anchor:
        if resolved.suffix != ".md":
            return f"{target}: an anchor into {resolved.name}, which is not markdown"
        if anchor not in anchors_in(resolved):
            return f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}"
    return None


def commands_of(lines: list[str]) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped."""
    joined, current = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        joined.append(current + line)
        current = ""
    if current:
        joined.append(current)
    commands = []
    for line in joined:
        words = shlex.split(line, comments=True)
        if words:
            commands.append(shlex.join(words))
    return commands


def is_quick(command: str) -> bool:
    return command.startswith("widebeam plan") or command.endswith("--help")


def marked_blocks(text: str) -> tuple[list[list[str]], list[list[str]]]:
    """(the blocks right after a run marker, the other blocks)."""
    lines = text.splitlines()
    _, blocks = split_blocks(text)
    marked, unmarked = [], []
    for start, block in blocks:
        before = [line for line in lines[:start] if line.strip()]
        (marked if before and before[-1].strip() == RUN_MARKER else unmarked).append(block)
    return marked, unmarked


def run_commands() -> list[tuple[str, str]]:
    """(file name, command) for every command of every marked block."""
    out = []
    for doc in documents():
        marked, _ = marked_blocks(doc.read_text())
        out.extend((doc.relative_to(ROOT).as_posix(), command) for block in marked
                   for command in commands_of(block))
    return out


@pytest.mark.parametrize("doc", documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_anchor_resolves(doc):
    problems = [why for target in links_of(doc.read_text()) if (why := link_problem(doc, target))]
    assert not problems, f"{doc.relative_to(ROOT)} has broken links:\n" + "\n".join(problems)


def test_every_guide_is_reachable_from_the_readme():
    """A guide nobody links to is lost: each docs/*.md is reached from the front page, directly or
    through other guides (a new guide needs a line in the README's Guides or in a guide's section)."""
    reached, todo = {README.resolve()}, [README]
    while todo:
        doc = todo.pop()
        for target in links_of(doc.read_text()):
            path = (doc.parent / target.partition("#")[0]).resolve()
            if not EXTERNAL.match(target) and path.suffix == ".md" and path.exists() and path not in reached:
                reached.add(path)
                todo.append(path)
    orphans = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in reached]
    assert not orphans, f"no link from README.md (directly or through a guide) reaches {orphans}"


def test_marked_blocks_hold_only_quick_commands_and_the_readme_shows_none_unmarked():
    problems = []
    for doc in documents():
        marked, unmarked = marked_blocks(doc.read_text())
        name = doc.relative_to(ROOT).as_posix()
        for block in marked:
            commands = commands_of(block)
            if not commands:
                problems.append(f"{name}: a marked block with no command")
            problems += [f"{name}: marked but not a plan or --help command: {c}"
                         for c in commands if not is_quick(c)]
        if doc == README:
            problems += [f"README.md: a quick command outside a marked block: {c}"
                         for block in unmarked for c in commands_of(block)
                         if c.startswith("widebeam") and is_quick(c)]
    assert not problems, "\n".join(problems)
    assert any(doc == "README.md" for doc, _ in run_commands()), "the README has no marked block"


@pytest.mark.parametrize("doc,command", run_commands(), ids=[c for _, c in run_commands()])
def test_marked_commands_run(doc, command):
    words = shlex.split(command)
    assert words[0] == "widebeam", f"{doc}: {command} is not a widebeam command"
    proc = subprocess.run([sys.executable, "-m", "widebeam", *words[1:]], capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S, cwd=ROOT, check=False)
    assert proc.returncode == 0, f"{doc}: `{command}` exited {proc.returncode}:\n{proc.stderr[-2000:]}"
    assert proc.stdout.strip(), f"{doc}: `{command}` printed nothing"


def test_the_checker_catches_what_is_broken(tmp_path, monkeypatch):
    """The checks can fail: a missing file, a missing anchor, a code span and a fenced block that
    look like links, GitHub's slug of punctuation and repeated headings."""
    assert slug("Capacity plans: `widebeam plan`") == "capacity-plans-widebeam-plan"
    assert slug("A/B against the previous revision") == "ab-against-the-previous-revision"
    assert slug("Many requests at once: `LLMEngine`") == "many-requests-at-once-llmengine"
    assert slug("Rounds and speculative decoding, exact") == "rounds-and-speculative-decoding-exact"
    assert anchors_of("# Results\n## Results\n```\n# not a heading\n```\n") == {"results", "results-1"}
    assert commands_of(["widebeam plan --model x \\", "    --beam-width 4   # a comment", "", "# only"]) \
        == ["widebeam plan --model x --beam-width 4"]
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "guide.md").write_text("# Guide\n## Some section\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](guide.md#some-section) [top](#page) `[code](nowhere.md)`\n# Page\n[a wrapped\n"
                    "text](wrapped.md)\n\n"
                    "```\n[fenced](nowhere.md)\n```\n[bad](missing.md) [anchor](guide.md#no-such)\n")
    problems = [why for t in links_of(page.read_text()) if (why := link_problem(page, t))]
    assert problems == ["wrapped.md: no file or folder wrapped.md",
                        "missing.md: no file or folder missing.md",
                        "guide.md#no-such: no heading #no-such in guide.md"]
