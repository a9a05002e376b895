"""The docs as a reader walks them, in order, in one clone: the home page leads to every page, the
pages that share the default database do not create the same population twice nor leave it in
the clone's root, and what the admin console says can change is what the server lets change."""

from __future__ import annotations

import re

import yaml

from orchestrator.populations.settings_changes import SAFE_TO_CHANGE
from tests.conftest import ROOT

DOCS = ROOT / "docs"
# Its own PostgreSQL database: its population names cannot collide with the SQLite pages'.
OWN_DATABASE = {"docs/tutorials/postgresql.md"}
_BLOCK = re.compile(r"^\s*```bash\n(.*?)^\s*```", re.MULTILINE | re.DOTALL)


def _nav_pages(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return []


def test_the_home_page_links_every_page_of_the_site() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = set(_nav_pages(config["nav"])) - {"index.md"}
    linked = set(re.findall(r"\]\(([^)#]+\.md)", (DOCS / "index.md").read_text()))

    assert pages - linked == set(), f"docs/index.md does not link {sorted(pages - linked)}"


def test_pages_followed_in_order_create_each_population_once() -> None:
    created: dict[str, str] = {}
    clashes = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        name = page.relative_to(ROOT).as_posix()
        if name in OWN_DATABASE:
            continue
        for block in _BLOCK.findall(page.read_text()):
            for population in re.findall(r"create-population ([A-Za-z0-9_.-]+)", block):
                if population in created:
                    clashes.append(f"{population!r} in {created[population]} and {name}")
                created.setdefault(population, name)

    assert clashes == []


def test_the_pages_that_serve_keep_the_database_out_of_the_clone_s_root() -> None:
    for page in (ROOT / "README.md", DOCS / "how-to" / "operate-the-orchestrator.md"):
        block = next(b for b in _BLOCK.findall(page.read_text()) if "./dev serve" in b)
        before = block.split("./dev serve")[0]
        assert "export ORCHESTRATOR_DATABASE_URL=sqlite:///runs/" in before, page
    assert (ROOT / ".gitignore").read_text().count("/runs/") == 1  # runs/ is never committed


def test_the_admin_console_lists_exactly_the_settings_that_can_change() -> None:
    text = (DOCS / "how-to" / "admin-console.md").read_text()
    paragraph = text.split("Only counts and times that each round reads when it opens can change:")[1]
    listed = set(re.findall(r"`([a-z_]+)`", paragraph.split(". ")[0])) - {"task_config"}

    assert listed == set(SAFE_TO_CHANGE)


def test_the_site_asks_nothing_of_the_internet_for_its_fonts() -> None:
    theme = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["theme"]

    assert theme["name"] == "material" and theme["font"] is False  # else it loads Google Fonts


def test_a_page_whose_commands_run_bare_python_says_to_activate_the_environment_first() -> None:
    # A fresh shell's `python` is the system's, without this project: `No module named ...`.
    bare = re.compile(r"^(?:[A-Z_]+=\S+ )*(?:python|openapi-python-client) ", re.MULTILINE)
    silent = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        text = page.read_text()
        blocks = [m for m in _BLOCK.finditer(text) if bare.search(m[1])]
        if blocks and "source .venv/bin/activate" not in text[: blocks[0].start()]:
            silent.append(page.relative_to(ROOT).as_posix())

    assert silent == []


def test_the_python_examples_run_from_the_clone_write_under_runs() -> None:
    # Run from the clone (they read runs/...), a file they name elsewhere lands in its root.
    files = re.compile(r"[\"']([\w./-]+\.(?:sqlite|safetensors|csv|parquet|json))[\"']")
    outside = []
    for page in sorted(DOCS.rglob("*.md")):
        for code in re.findall(r"^```python\n(.*?)^```", page.read_text(), re.MULTILINE | re.DOTALL):
            if '"runs/' in code:
                outside += [f"{page.name}: {f}" for f in files.findall(code) if not f.startswith("runs/")]

    assert outside == []
