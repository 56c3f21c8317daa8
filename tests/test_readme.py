"""The README is also the package index's page: short, and every link in it works there (so
absolute, to the repository) as well as on the repository. The docs it links to link among
themselves by relative paths, which work on the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = sorted((ROOT / "docs").glob("*.md"))
REPOSITORY = "https://github.com/OWNER/pytest-vram"
RAW = "https://raw.githubusercontent.com/OWNER/pytest-vram/main/"

# [text](target) and ![alt](target); the target up to a space or the closing parenthesis.
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^ *(```|~~~)")


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks and code spans."""
    lines, inside = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            lines.append(line)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", "\n".join(lines))


def _links(text: str) -> list[str]:
    return _LINK.findall(_prose(text))


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose_keeping_spans(path.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _prose_keeping_spans(text: str) -> str:
    lines, inside = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            inside = not inside
        elif not inside:
            lines.append(line)
    return "\n".join(lines)


def _check_target(path: Path, anchor: str, where: str) -> None:
    assert path.exists(), f"{where}: {path.relative_to(ROOT)} does not exist"
    if anchor:
        assert path.suffix == ".md", f"{where}: an anchor into {path.name}"
        assert anchor in _anchors(path), f"{where}: {path.name} has no heading #{anchor}"


def test_the_readme_is_the_short_path() -> None:
    assert len(README.splitlines()) <= 400
    headings = re.findall(r"^## (.+)$", _prose_keeping_spans(README), flags=re.M)
    # Install and the developer set-up come before the first test's details.
    assert headings[:3] == ["Install", "Develop", "A first test"], headings
    assert {"What is measured", "Baselines and CI", "Options", "Documentation"} <= set(headings)


def test_every_readme_link_is_absolute_and_points_at_something_that_exists() -> None:
    links = _links(README)
    assert len(links) >= 20
    for link in links:
        # A relative link, or an anchor of this page, breaks on the package index's page.
        assert link.startswith("https://"), f"README links to {link!r}"
        target, _, anchor = link.partition("#")
        if target.startswith(RAW):
            _check_target(ROOT / target.removeprefix(RAW), "", link)
            continue
        if not target.startswith(REPOSITORY):
            continue
        rest = target.removeprefix(REPOSITORY).strip("/")
        if not rest:
            _check_target(ROOT / "README.md", anchor, link)
            continue
        kind, branch, path = [*rest.split("/", 2), "", ""][:3]
        if kind in ("blob", "tree"):
            assert branch == "main", link
            _check_target(ROOT / path, anchor, link)
            assert (ROOT / path).is_dir() == (kind == "tree"), link


def test_every_page_of_the_docs_is_reachable_from_the_readme() -> None:
    linked = {
        link.partition("#")[0].removeprefix(f"{REPOSITORY}/blob/main/") for link in _links(README)
    }
    missing = [str(p.relative_to(ROOT)) for p in DOCS if str(p.relative_to(ROOT)) not in linked]
    assert not missing, f"the README links to no {missing}"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_the_docs_relative_links_work(page: Path) -> None:
    for link in _links(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        _check_target(path, anchor, f"{page.name}: {link}")


def _owner_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "pyproject.toml", *DOCS]
    return files + sorted((ROOT / "docs" / "workflows").glob("*.yml"))


def test_owner_is_one_placeholder_explained_once() -> None:
    for path in _owner_files():
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"(?<![\w$])OWNER(?!\w)", text):
            line = text[: match.end()].splitlines()[-1]
            around = text[match.start() - len("github.com/") : match.end() + len("/pytest-vram")]
            if around == "github.com/OWNER/pytest-vram":
                continue
            if around.endswith("tent.com/OWNER/pytest-vram"):  # raw.githubusercontent.com
                continue
            if path == ROOT / "README.md" and line.endswith("`OWNER"):
                continue  # the one sentence that says what it stands for
            if path.name == "pyproject.toml" and line == "# OWNER":
                continue
            raise AssertionError(f"{path.name}: OWNER outside a repository URL: {line!r}")
    explained = re.findall(r"^`OWNER` stands for", README, flags=re.M)
    assert len(explained) == 1
    # Where a user first meets it: the install commands, just above.
    assert README.index("github.com/OWNER") < README.index("`OWNER` stands for")
    assert README.index("`OWNER` stands for") < README.index("## Develop")


def test_the_readme_says_why_the_first_test_needs_96_mib() -> None:
    prose = _prose(README)
    assert "cuBLAS workspaces" in prose and "32 MiB each" in prose
    # The budget failure names them as their own category.
    assert "at the peak: cuBLAS workspaces 64.00 MiB" in README


def test_the_developer_set_up_installs_the_cpu_build_of_torch() -> None:
    develop = README[README.index("## Develop") : README.index("## A first test")]
    commands = [line for line in develop.splitlines() if line.startswith("pip install torch")]
    assert commands, develop
    for command in commands:
        assert "--index-url https://download.pytorch.org/whl/cpu" in command


def test_the_options_table_names_real_options(pytestconfig: pytest.Config) -> None:
    table = README[README.index("## Options") :]
    rows = [
        [cell.strip().strip("`") for cell in line.strip("|").split("|")]
        for line in table.splitlines()
        if line.startswith("| ")
    ]
    options = {row[0].split()[0] for row in rows if row[0].startswith("--vram")}
    ini = {row[1] for row in rows if row[1].startswith("vram_")}
    assert {"--vram-gate", "--vram-report"} <= options
    assert {"vram_gate", "vram_min_change"} <= ini
    for option in options:
        pytestconfig.getoption(option.split("=")[0])  # ValueError for an unknown option
    for name in ini:
        pytestconfig.getini(name)
