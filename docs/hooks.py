"""MkDocs hooks: the site is built from the repository as it is, with nothing copied by hand.

- The README is the home page, the notebooks (``notebooks/*.ipynb``, with their stored outputs) are pages, and
  one API page per public module of ``sidejax`` is generated (``api/<module>.md``: mkdocstrings renders the
  module's docstrings).
- A relative link in any page is resolved against the page's place in the repository (as on a code host and
  in ``tests/test_readme.py``, which checks that every such link resolves): a link to a page becomes a link
  to that page in the site, and a link to any other file of the repository (a module, a preset, a test, a
  folder) to a verbatim copy of it under ``_repo/`` (a folder gets a generated listing page), so the site
  stands alone.
"""

from __future__ import annotations

import pkgutil
import posixpath
import re
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files, InclusionLevel

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
REPO = "_repo"
LINK = re.compile(r"(?P<head>!?\[[^\]]*\]\()(?P<target>[^)\s#]+)(?P<anchor>#[^)\s]*)?(?P<tail>\))")
SKIP_PARTS = {"__pycache__", ".ipynb_checkpoints"}
#: folders of docs/ that are not pages (exclude_docs in mkdocs.yml): published as repository files
NOT_PAGES = (DOCS / "measurements",)


def api_modules() -> list[str]:
    """The public modules of ``sidejax`` (no ``_private`` ones), packages first."""
    import sidejax

    names = ["sidejax"]
    for info in pkgutil.walk_packages(sidejax.__path__, "sidejax."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return sorted(names)


def _repo_path(file: File) -> Path:
    """Where a page's source lies in the repository."""
    return Path(file.abs_src_path)


def site_path(path: Path) -> str:
    """The site path (a ``src_uri``) that a repository file is published under."""
    rel = path.relative_to(ROOT).as_posix()
    if rel == "README.md":
        return "index.md"
    if DOCS in path.parents and path.is_file() and not any(d == path or d in path.parents for d in NOT_PAGES):
        return rel[len("docs/") :]
    if rel.startswith("notebooks/") and rel.endswith(".ipynb"):
        return rel
    if path.is_dir():
        return f"{REPO}/{rel}/index.md"
    return f"{REPO}/{rel}"


def _targets(markdown: str, page_dir: Path) -> list[Path]:
    out = []
    for m in LINK.finditer(markdown):
        target = m.group("target")
        if "://" in target or target.startswith(("mailto:", "/")):
            continue
        path = (page_dir / target).resolve()
        if path.exists() and ROOT in path.parents:
            out.append(path)
    return out


def _listing(folder: Path) -> str:
    """A generated page listing a folder's files, each linked where the site publishes it."""
    rel = folder.relative_to(ROOT).as_posix()
    here = posixpath.dirname(site_path(folder))
    entries = sorted(p for p in folder.iterdir() if p.name not in SKIP_PARTS and not p.name.startswith("."))
    lines = [f"# `{rel}/`", "", f"The files of `{rel}/` in the repository.", ""]
    for p in entries:
        name = p.name + ("/" if p.is_dir() else "")
        lines.append(f"- [`{name}`]({posixpath.relpath(site_path(p), here)})")
    return "\n".join(lines) + "\n"


def on_config(config):
    """The API reference in the navigation: one entry per public module."""
    config.nav.append({"API reference": [{name: f"api/{name}.md"} for name in api_modules()]})
    return config


@event_priority(100)  # before mkdocs-jupyter turns the notebooks into pages
def on_files(files: Files, config) -> Files:
    def add(src_uri: str, **kw) -> None:
        if files.get_file_from_path(src_uri) is None:
            files.append(File.generated(config, src_uri, **kw))

    add("index.md", abs_src_path=str(ROOT / "README.md"))
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):  # a plain file of the repository's root
        files.append(File(f"notebooks/{nb.name}", str(ROOT), config.site_dir, config.use_directory_urls))
    for name in api_modules():
        add(f"api/{name}.md", content=f"# `{name}`\n\n::: {name}\n")
    # every repository file a page links to, and every file of a linked folder
    pages = [ROOT / "README.md", *DOCS.rglob("*.md")]
    todo = [t for page in pages for t in _targets(page.read_text(), page.parent)]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        uri = site_path(path)
        if not uri.startswith(REPO + "/"):
            continue  # a page or a notebook, already in the site
        if path.is_dir():
            add(uri, content=_listing(path), inclusion=InclusionLevel.NOT_IN_NAV)
            todo += [p for p in path.iterdir() if p.name not in SKIP_PARTS and not p.name.startswith(".")]
        elif path.suffix == ".md":  # another Markdown file: published as a page, its links rewritten too
            add(uri, abs_src_path=str(path), inclusion=InclusionLevel.NOT_IN_NAV)
        else:
            add(uri, abs_src_path=str(path))
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    """Rewrites each relative link from the page's place in the repository to its place in the site."""
    if page.file.generated_by and page.file.abs_src_path is None:
        return markdown  # generated API and listing pages link within the site already
    page_dir = _repo_path(page.file).parent
    here = posixpath.dirname(page.file.src_uri)

    def rewrite(m: re.Match) -> str:
        target = m.group("target")
        if "://" in target or target.startswith(("mailto:", "/")):
            return m.group(0)
        path = (page_dir / target).resolve()
        if not path.exists() or ROOT not in path.parents:
            return m.group(0)  # left for MkDocs to report
        new = posixpath.relpath(site_path(path), here or ".")
        return f"{m.group('head')}{new}{m.group('anchor') or ''}{m.group('tail')}"

    return LINK.sub(rewrite, markdown)
