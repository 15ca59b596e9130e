"""The docs that are generated stay in step with the code they describe."""
from __future__ import annotations

from helpers import ROOT


def test_the_configuration_reference_is_the_schema_as_it_is():
    """docs/reference.md is generated from hydratrain.config.schema; a field added, removed or re-documented without
    regenerating it fails here (python -m hydratrain.config.reference > docs/reference.md)."""
    from hydratrain.config.reference import render

    page = (ROOT / "docs" / "reference.md").read_text()
    assert page == render(), "docs/reference.md is stale: python -m hydratrain.config.reference > docs/reference.md"
    assert "| `resume_from` |" in page and "## `strategy`" in page and "### `strategy=fsdp`" in page


def test_the_site_navigation_lists_every_docs_page_once():
    """mkdocs.yml's nav names every docs/*.md page exactly once and no page that does not exist, so a page added to
    docs/ is reachable from the site's navigation (mkdocs build --strict, in .ci/run, checks links and anchors)."""
    import yaml

    def pages(entries):
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            yield from pages(value) if isinstance(value, list) else [value]

    nav = list(pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]))
    on_disk = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert sorted(nav) == on_disk, f"mkdocs.yml nav {sorted(nav)} != docs/*.md {on_disk}"
