"""The docs stay references: current, self-contained, with links that resolve.

- no file of the repository refers to an issue number, a machine path, or a
  design document outside the repository (the design document is docs/DESIGN.md),
  and every ``docs/<name>.md`` a file names exists;
- the reference docs hold no lab-notebook leftovers (superseded results, the
  host's slow minutes, people);
- every relative link in README.md, CHANGELOG.md and docs/*.md points at a file
  that exists, and a ``#anchor`` into a markdown file at one of its headings;
- the README's CI test commands are one line each (``.ci/run`` reads them from there);
- docs/DESIGN.md's tables that mirror code (operations,
  includes, settings) and DEPLOY's (environment variables, metrics) equal what
  ``scripts/doc_tables.py`` generates from the code, and the known limits live in
  one place, docs/RELIABILITY.md.

Code files (redisbal/, tests/, scripts/) that still break a rule are listed in
``CODE_ALLOWED`` until their lines are fixed; docs and README get no allowance.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
from support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()

TEXT_SUFFIXES = {".py", ".md", ".lua", ".toml", ".yml", ".yaml", ".json", ".txt", ".cfg", ".sh"}
TEXT_NAMES = {"Dockerfile", "run", ".gitignore", ".dockerignore"}
SKIP_DIRS = {
    ".git",
    ".venv",
    "venv",
    "build",
    "dist",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".mypy_cache",
    ".hypothesis",
}
CODE_DIRS = ("redisbal/", "tests/", "scripts/")

# (rule, pattern); patterns are assembled so that this file does not match itself
RULES: list[tuple[str, re.Pattern[str]]] = [
    ("issue number", re.compile(r"(?<![\w&/])#\d+\b")),
    ("issue number", re.compile(r"\bissues?\s+#?\d+\b", re.I)),
    ("machine path", re.compile(r"(?<![\w.])/(?:" + "work|root|home|Users" + r")/")),
    (
        "design document outside the repository",
        re.compile(r"\b(?:design|the)\s+" + "brief\\b", re.I),
    ),
    ("design document outside the repository", re.compile(r"\bshared/" + "DESIGN")),
]
TMP_PATH = re.compile(r"(?<![\w.])/" + r"tmp/\S*")
DESIGN_MD = re.compile(r"(?:[\w./-]*/)?" + "DESIGN" + r"\.md")
DOC_REF = re.compile(r"\bdocs/([\w.-]+\.md)\b")
# lab-notebook leftovers, in the reference docs only
DOC_ONLY_RULES: list[tuple[str, re.Pattern[str]]] = [
    ("history in a reference doc", re.compile(r"\bsuperseded\b|^#+\s*Earlier\b", re.I | re.M)),
    ("speculation about the host", re.compile(r"\bslow minutes?\b", re.I)),
    ("people", re.compile(r"\bengineers?\b", re.I)),
]

# Violations in code files that other work is fixing: (path, rule, matched text).
# Empty this as the lines are fixed; a stale entry fails the test, so it cannot rot.
CODE_ALLOWED: frozenset[tuple[str, str, str]] = frozenset()


def repo_files() -> list[str]:
    """Relative paths of the repository's text files (git's view when there is one)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.splitlines()
        paths = [p for p in out if (ROOT / p).is_file()]
    except (OSError, subprocess.SubprocessError):
        paths = [
            str(p.relative_to(ROOT))
            for p in ROOT.rglob("*")
            if p.is_file()
            and not SKIP_DIRS.intersection(p.relative_to(ROOT).parts)
            and not any(part.endswith(".egg-info") for part in p.relative_to(ROOT).parts)
        ]
    return sorted(
        p
        for p in paths
        if (Path(p).suffix in TEXT_SUFFIXES or Path(p).name in TEXT_NAMES)
        and (ROOT / p).resolve() != THIS
    )


def doc_files() -> list[Path]:
    """The reference docs: README.md, CHANGELOG.md and docs/*.md (not docs/pending/)."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    if (ROOT / "CHANGELOG.md").exists() or (ROOT / ".git").exists():
        files.append(ROOT / "CHANGELOG.md")
    return files


def violations(rel: str, text: str) -> list[tuple[str, str, int, str]]:
    """(rule, matched text, line number, line) for every rule ``text`` breaks."""
    found = []
    lines = text.splitlines()

    def add(rule: str, m: re.Match[str]) -> None:
        n = text.count("\n", 0, m.start()) + 1
        found.append((rule, m.group(0), n, lines[n - 1].strip() if lines else ""))

    for rule, pat in RULES:
        for m in pat.finditer(text):
            add(rule, m)
    in_docs = rel.startswith("docs/") and "/" not in rel[len("docs/") :]
    for m in DESIGN_MD.finditer(text):
        ref = m.group(0)
        if ref.endswith("docs/DESIGN.md") or (in_docs and ref == "DESIGN.md"):
            continue  # the repository's own design document
        add("design document outside the repository", m)
    for m in DOC_REF.finditer(text):
        if not (ROOT / "docs" / m.group(1)).exists():
            add("missing doc", m)
    if rel.startswith("docs/plots/"):  # data: where a run wrote its files is the machine's
        for m in TMP_PATH.finditer(text):
            add("machine path", m)
    if rel.endswith(".md") and (ROOT / rel) in doc_files():
        for rule, pat in DOC_ONLY_RULES:
            if rule == "history in a reference doc" and rel == "CHANGELOG.md":
                continue  # where history belongs
            for m in pat.finditer(text):
                add(rule, m)
    return found


def test_design_doc_exists() -> None:
    assert (ROOT / "docs" / "DESIGN.md").is_file()


def test_no_file_refers_to_issues_machine_paths_or_outside_documents() -> None:
    problems, used = [], set()
    files = repo_files()
    assert "README.md" in files and "docs/DESIGN.md" in files, files[:20]
    for rel in files:
        try:
            text = (ROOT / rel).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for rule, match, line_no, line in violations(rel, text):
            key = (rel, rule, match)
            if rel.startswith(CODE_DIRS) and key in CODE_ALLOWED:
                used.add(key)
                continue
            problems.append(f"{rel}:{line_no}: {rule}: {match!r} in {line!r}")
    stale = sorted(CODE_ALLOWED - used)
    assert not problems, "\n".join(problems)
    assert not stale, f"CODE_ALLOWED entries that no longer match (remove them): {stale}"


def test_the_rules_catch_what_they_are_for() -> None:
    """The patterns above, on samples: each bad line is caught, each good one passes."""
    design = "DESIGN" + ".md"
    bad = {
        "see #12": "issue number",
        "as issue 7 asks": "issue number",
        "ran /" + "work/venv/bin/python": "machine path",
        f"as {design} says": "design document outside the repository",
        "where the design " + "brief is silent": "design document outside the repository",
        "docs/NOPE.md": "missing doc",
    }
    for sample, rule in bad.items():
        assert rule in [v[0] for v in violations("redisbal/x.py", sample)], sample
    good = [
        f"docs/{design}",
        "vLLM PR 21617 and the vllm-21617 policy",
        "python scripts/local_cluster.py --dir /tmp/rc",
        "`#ARGV` and color #1f77b4",
    ]
    for sample in good:
        assert violations("redisbal/x.py", sample) == [], sample
    tmp = '{"json": "/' + 'tmp/rb/out.json"}'
    assert [v[0] for v in violations("docs/plots/x.json", tmp)] == ["machine path"]
    assert violations("docs/BENCHMARKS.md", f"[design]({design})") == []
    assert [v[0] for v in violations("README.md", "this was superseded")] == [
        "history in a reference doc"
    ]
    assert violations("CHANGELOG.md", "this was superseded") == []


# -- links -----------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_links(doc: Path) -> list[str]:
    """The relative links of ``doc`` (outside code) whose file or heading is missing."""
    text = INLINE_CODE.sub("", FENCE.sub("", doc.read_text(encoding="utf-8")))
    broken = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (doc.parent / path_part).resolve() if path_part else doc
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor})")
    return broken


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = broken_links(doc)
    assert not broken, f"{doc.relative_to(ROOT)}: " + ", ".join(broken)


def test_link_check_catches_broken_links(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("## A `code_name` heading: yes\n", encoding="utf-8")
    doc = tmp_path / "x.md"
    doc.write_text(
        "# Real heading\n[a](nope.md) [b](#missing) [c](#real-heading)\n"
        "[d](other.md#a-code_name-heading-yes) [e](other.md#no) ![f](img.png)\n"
        "[g](https://example.com/x) `[h](inline.md)`\n```\n[i](fenced.md)\n```\n",
        encoding="utf-8",
    )
    assert broken_links(doc) == [
        "nope.md (no such file)",
        "#missing (no heading #missing)",
        "other.md#no (no heading #no)",
        "img.png (no such file)",
    ]


def test_readme_ci_commands_are_one_line_each() -> None:
    """.ci/run runs the one line in each block after a ci:test-command marker, in order:
    the fast tier, the slow tier (on two xdist workers, one test file each), the server
    matrix."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"<!-- ci:test-command -->\s*```[a-z]*\n(.*?)```", text, re.S)
    commands = [[ln for ln in block.splitlines() if ln.strip()] for block in blocks]
    assert all(len(lines) == 1 for lines in commands), commands
    assert [lines[0].split("&& ")[-1] for lines in commands] == [
        "pytest",
        "pytest -m slow -n 2 --dist loadfile",
        "pytest -m servers",
    ]


# -- docs/DESIGN.md and the generated tables ---------------------------------------------------


def doc_tables() -> ModuleType:
    return load_script("doc_tables")


def test_generated_tables_equal_the_code() -> None:
    """Every generated table is in a doc and equals what the code says now."""
    stale = doc_tables().stale()
    assert not stale, "\n".join(stale) + "\nrun: python scripts/doc_tables.py"


def test_generated_tables_catch_drift() -> None:
    """A table edited by hand (or code changed under it) is caught, and so is a
    missing or unknown table."""
    tables = doc_tables()
    text = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    assert tables.render(text, "DESIGN.md") == text
    edited = text.replace("| `report.lua` |", "| `report.lua` (edited) |", 1)
    assert edited != text and tables.render(edited, "DESIGN.md") == text
    ops = tables.operations()
    for name in ("report_many.lua", "suspect.lua", "recovered.lua", "lease.lua"):
        assert f"`{name}`" in ops, name  # every operation, not a hand-kept subset
    assert "`marks.lua`" in tables.includes() and "`settings.lua`" in tables.includes()
    with pytest.raises(SystemExit, match="unknown generated table"):
        tables.render(tables.BEGIN.format("nope") + "\n" + tables.END.format("nope"), "x.md")


def test_known_limits_live_in_reliability_only() -> None:
    """One list of known limits (docs/RELIABILITY.md); DESIGN's section points there."""
    design = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    section = design.split("## Known limits", 1)[1].split("\n## ", 1)[0]
    assert "RELIABILITY.md#known-limits" in section
    assert not re.search(r"^- ", section, re.M), "DESIGN.md lists limits of its own"
    for doc in doc_files():
        if doc.name != "RELIABILITY.md" and doc.exists():
            body = doc.read_text(encoding="utf-8")
            assert not re.search(r"^#+ Known limits\s*\n+- ", body, re.M), doc.name
