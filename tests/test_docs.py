"""The documentation site builds from the sources with warnings as errors (mkdocs --strict):
a renamed argument, a missing docstring target or a broken link fails here, not in the docs.

The built pages are checked too, not only their sources: a list that Python-Markdown ran into
a paragraph (a bullet after a line of text with no blank line between, or nested content such
as a code block indented less than 4 spaces inside a list item) fails here, naming the page and
the text. README.md, which is not part of the site, is rendered with the site's extensions."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

# A line of a paragraph's text that starts like a list item: "- ", "* ", "1. ".
LIST_LINE = re.compile(r"^\s*(?:[-*]|\d+\.)\s")


def needs_the_docs_extra() -> None:
    pytest.importorskip("mkdocs", reason="the [docs] extra is not installed")
    pytest.importorskip("mkdocstrings_handlers.python", reason="the [docs] extra is not installed")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for this module's tests (about 3 seconds)."""
    needs_the_docs_extra()
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return out


class _Paragraphs(HTMLParser):
    """The text of each <p> of an HTML page, tags removed, line breaks kept."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self._open: list[list[str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "p":
            self._open.append([])

    def handle_endtag(self, tag: str) -> None:
        if tag == "p" and self._open:
            self.paragraphs.append("".join(self._open.pop()))

    def handle_data(self, data: str) -> None:
        if self._open:
            self._open[-1].append(data)


def lists_run_into_paragraphs(html: str) -> list[str]:
    """The paragraphs of ``html`` that hold a line starting like a list item."""
    parser = _Paragraphs()
    parser.feed(html)
    parser.close()
    return [p for p in parser.paragraphs if any(map(LIST_LINE.match, p.splitlines()))]


def render(markdown_text: str) -> str:
    """Markdown to HTML with the extensions and their options that mkdocs.yml configures (and
    those mkdocs always adds), as the site renders a page."""
    import markdown
    from mkdocs.config import load_config

    config = load_config(str(ROOT / "mkdocs.yml"))
    return markdown.Markdown(
        extensions=config.markdown_extensions, extension_configs=config.mdx_configs
    ).convert(markdown_text)


def report(found: dict[str, list[str]]) -> str:
    lines = (f"{page}: {text!r}" for page, texts in found.items() for text in texts)
    return (
        "lists rendered as a paragraph (indent what a list item nests by 4 spaces; put a blank "
        "line before a list):\n" + "\n".join(lines)
    )


def test_the_docs_site_builds_strict(site: Path) -> None:
    assert (site / "reference" / "writer" / "index.html").exists()
    page = (site / "reference" / "writer" / "index.html").read_text()
    assert "get_ready" in page  # the reference is generated from the docstrings


def test_no_list_of_the_site_renders_as_a_paragraph(site: Path) -> None:
    """Every built page, the reference generated from the docstrings included."""
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 20 and (site / "TIERS" / "index.html") in pages
    found = {}
    for page in pages:
        broken = lists_run_into_paragraphs(page.read_text())
        if broken:
            name = page.relative_to(site)
            source = Path("docs", *name.parent.parts).with_suffix(".md")
            # Its source (a reference page's text comes from the docstrings its ::: names).
            found[f"{name} ({source})" if (ROOT / source).is_file() else str(name)] = broken
    assert not found, report(found)


def test_no_list_of_the_readme_renders_as_a_paragraph() -> None:
    needs_the_docs_extra()
    broken = lists_run_into_paragraphs(render((ROOT / "README.md").read_text()))
    assert not broken, report({"README.md": broken})


def test_the_check_finds_a_list_run_into_a_paragraph() -> None:
    """What TIERS.md once had: a code block indented 2 spaces in a list item ran the items
    after it into one paragraph; 4 spaces keep them a list. A list right after a line of text
    runs into it too."""
    needs_the_docs_extra()
    item = "- first item, with an example:\n\n{fence}\n- second item\n- third item\n"
    code = "```python\nx = 1\n```"
    two, four = (textwrap.indent(code, " " * n) for n in (2, 4))
    broken = lists_run_into_paragraphs(render(item.format(fence=two)))
    assert len(broken) == 1 and "\n- second item\n- third item" in broken[0], broken
    assert lists_run_into_paragraphs(render(item.format(fence=four + "\n"))) == []
    assert lists_run_into_paragraphs(render("Some text:\n1. one\n2. two\n"))
    assert lists_run_into_paragraphs(render("Some text:\n\n1. one\n2. two\n")) == []
