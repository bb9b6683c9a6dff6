# SPDX-License-Identifier: Apache-2.0
"""The docs cannot drift from the code: every flag a command in README.md or docs/*.md passes to
one of our scripts exists in that script's ``--help``, the main job's flag table lists exactly
the flags of ``launch/run.py --help``, and every relative link points to an existing file (and,
for a Markdown page, to an existing heading).  The reference pages stay current and short: no
work-period labels (`_PERIOD`) in any doc, README.md, docs/BENCHMARKS.md and
docs/DESIGN.md within their line limits, and DESIGN.md's module map naming every module of
``offload/`` and ``launch/`` by a path that exists.

A command is a fenced code block's line (``\\`` continuations joined) or an inline code span
that names ``launch/run.py``, ``launch/prefix_reload.py`` or ``scripts/<name>.py`` (or
``scripts/run_job.sh`` / ``scripts/two_nodes.sh``, which pass their arguments to
``launch/run.py``); the flags are the ``--words`` after that name, up to the end of the command.
Each script's ``--help`` runs once, all of them side by side.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# a script named in a command -> the script whose --help holds its flags
_SCRIPT = re.compile(r"(?<![\w/.-])((?:launch/)?prefix_reload\.py|launch/run\.py"
                     r"|scripts/(?:run_job|two_nodes)\.sh|scripts/[\w-]+\.py)")
_WRAPPERS = {"scripts/run_job.sh": "launch/run.py", "scripts/two_nodes.sh": "launch/run.py",
             "prefix_reload.py": "launch/prefix_reload.py"}
_FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
# argparse's option lines: every spelling before the help text ("--x, --no-x" included)
_OPTION_LINE = re.compile(r"^ {2}(-[^\n]*?)(?: {2,}|$)", re.M)
_LONG = re.compile(r"--[A-Za-z][\w-]*")
_END = re.compile(r"\||;|&&|\s#")  # a table cell, the next command, a shell comment
_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
_SPAN = re.compile(r"`([^`]+)`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")


def _rel(doc: Path) -> str:
    return doc.relative_to(ROOT).as_posix()


def _commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) for every fenced line and inline code span of ``text``."""
    found: list[tuple[int, str]] = []
    for block in _FENCE.finditer(text):
        first = text.count("\n", 0, block.start()) + 1
        joined, start = "", None
        for offset, line in enumerate(block.group(0).splitlines()[1:-1], start=1):
            start = first + offset if start is None else start
            if line.rstrip().endswith("\\"):
                joined += line.rstrip()[:-1] + " "
                continue
            found.append((start, joined + line))
            joined, start = "", None
    prose = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for span in _SPAN.finditer(prose):
        found.append((prose.count("\n", 0, span.start()) + 1, " ".join(span.group(1).split())))
    return found


def doc_flags(doc: Path) -> list[tuple[int, str, str]]:
    """(line, name, flag) for every flag a command in ``doc`` passes to one of our scripts
    (``name`` as the doc writes it; `_script` gives the script whose ``--help`` holds it)."""
    out = []
    for line, command in _commands(doc.read_text()):
        names = list(_SCRIPT.finditer(command))
        for i, name in enumerate(names):
            end = names[i + 1].start() if i + 1 < len(names) else len(command)
            args = command[name.end():end]
            stop = _END.search(args)
            args = args[:stop.start()] if stop else args
            out += [(line, name.group(1), flag) for flag in _FLAG.findall(args)]
    return out


def _script(name: str) -> str:
    return _WRAPPERS.get(name, name)


@functools.cache
def help_flags() -> dict[str, frozenset[str] | str]:
    """Every script the docs name -> the flags of its ``--help`` (or why there is none)."""
    scripts = sorted({_script(name) for doc in DOCS for _, name, _ in doc_flags(doc)}
                     | {"launch/run.py"})
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def run(script: str) -> frozenset[str] | str:
        if not (ROOT / script).is_file():
            return "the script does not exist"
        proc = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            return f"its --help exited {proc.returncode}: {proc.stderr.strip()[-200:]}"
        return frozenset(flag for line in _OPTION_LINE.findall(proc.stdout)
                         for flag in _LONG.findall(line))

    with ThreadPoolExecutor(len(scripts)) as pool:
        return dict(zip(scripts, pool.map(run, scripts), strict=True))


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_flag_shown_exists(doc: Path) -> None:
    known = help_flags()
    bad = []
    for line, name, flag in doc_flags(doc):
        script = _script(name)
        flags = known[script]
        shown = name if script == name else f"{name} (-> {script})"
        if isinstance(flags, str):
            problem = f"{_rel(doc)}:{line}: {shown} is shown with flags, but {flags}"
            bad += [] if problem in bad else [problem]
        elif flag not in flags:
            bad.append(f"{_rel(doc)}:{line}: {shown} has no {flag} "
                       f"(not in `python {script} --help`)")
    assert not bad, "; ".join(bad)


def test_main_job_table_lists_every_flag() -> None:
    """docs/MAIN_JOB.md's flag table holds exactly the flags of ``launch/run.py --help``."""
    text = (ROOT / "docs" / "MAIN_JOB.md").read_text()
    table = {flag for row in text.splitlines() if row.startswith("| `--")
             for flag in _FLAG.findall(row.split("|")[1])}
    flags = help_flags()["launch/run.py"]
    assert isinstance(flags, frozenset), flags
    shown = flags - {"--help"}
    assert not table - shown, (f"docs/MAIN_JOB.md lists {sorted(table - shown)}, which "
                               "launch/run.py --help does not have")
    assert not shown - table, (f"docs/MAIN_JOB.md's flag table lacks {sorted(shown - table)} "
                               "from launch/run.py --help")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page."""
    seen: dict[str, int] = {}
    text = _FENCE.sub("", page.read_text())
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_relative_links_resolve(doc: Path) -> None:
    prose = _FENCE.sub("", doc.read_text())
    bad = []
    for target in _LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        page = (doc.parent / path).resolve() if path else doc
        if not page.exists():
            bad.append(f"{_rel(doc)}: link {target} -> no such file")
        elif anchor and page.suffix == ".md" and anchor not in _anchors(page):
            bad.append(f"{_rel(doc)}: link {target} -> no heading #{anchor} in "
                       f"{page.relative_to(ROOT).as_posix()}")
    assert not bad, "; ".join(bad)


# ---------------------------------------------------------------------------------------------
# Reference pages stay current and short
# ---------------------------------------------------------------------------------------------

# NOTE: a doc cites a figure by its date and machine; a label naming a work period (a session,
# a device call, a turn or a lease by its number or letter) means nothing to a reader who was
# not there.
_PERIOD = re.compile(r"\b[Ss]essions? \d"
                     r"|\b[Cc]alls? [A-Z](?:\b|-[A-Z]\b)"
                     r"|\b[Cc]alls? \d+(?![\d-])\b(?!\s*(?:ms|us|s)\b)"
                     r"|\bturn-\d|\b[Ll]ease \d")
_MAX_LINES = {"README.md": 200, "docs/BENCHMARKS.md": 500, "docs/DESIGN.md": 700}


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_no_work_period_labels(doc: Path) -> None:
    lines = enumerate(doc.read_text().splitlines(), start=1)
    bad = [f"{_rel(doc)}:{n}: {m.group(0)!r}" for n, line in lines for m in _PERIOD.finditer(line)]
    assert not bad, "name the date and machine instead: " + "; ".join(bad)


@pytest.mark.parametrize("name", sorted(_MAX_LINES))
def test_reference_pages_stay_short(name: str) -> None:
    lines = len((ROOT / name).read_text().splitlines())
    assert lines <= _MAX_LINES[name], (f"{name} has {lines} lines, over its {_MAX_LINES[name]}: "
                                       "history belongs in git, not on the page")


def _module_map() -> list[str]:
    """The paths in the first column of DESIGN.md's module map (section 1)."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    section = text.split("## 1. ", 1)[1].split("\n## ", 1)[0]
    rows = [row for row in section.splitlines() if row.startswith("| `")]
    return [path for row in rows for path in _SPAN.findall(row.split("|")[1])]


def test_module_map_names_real_paths() -> None:
    missing = [path for path in _module_map() if not (ROOT / path).exists()]
    assert not missing, f"docs/DESIGN.md's module map names paths that do not exist: {missing}"


def test_module_map_covers_every_module() -> None:
    """Every module of the package and the launcher is in the map, by name or by its folder."""
    named = _module_map()
    modules = sorted(p.relative_to(ROOT).as_posix()
                     for folder in ("offload", "launch") for p in (ROOT / folder).rglob("*")
                     if p.suffix in (".py", ".c") and p.name != "__init__.py")
    left = [m for m in modules
            if not any(m == n or (n.endswith("/") and m.startswith(n)) for n in named)]
    assert not left, f"docs/DESIGN.md's module map lacks {left}"
