"""The docs that are generated stay in step with the code they describe."""
from __future__ import annotations

from helpers import ROOT


def _section(page: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading."""
    start = page.index(f"{heading}\n")
    end = page.find("\n#", start + len(heading))
    return page[start:end if end >= 0 else None]


def test_the_configuration_reference_is_what_runs():
    """docs/reference.md is generated from what a run composes (conf/ on hydratrain.config.schema); a field added,
    removed or re-documented, or a preset changed, without regenerating it fails here (python -m
    hydratrain.config.reference > docs/reference.md). Its defaults are the presets' values, not the schema's (optim.lr
    0.002 of conf/optim/adamw.yaml, not the schema's 0.001), an interpolation shows as written (no machine's path),
    and a comment that wraps onto the next line is its own field's, not run into the next field's cell."""
    import yaml

    from hydratrain.config.reference import render

    page = (ROOT / "docs" / "reference.md").read_text()
    assert page == render(), "docs/reference.md is stale: python -m hydratrain.config.reference > docs/reference.md"
    assert "| `resume_from` |" in page and "## `strategy`" in page and "### `strategy=fsdp`" in page

    def preset(path: str) -> dict:
        return yaml.safe_load((ROOT / "conf" / path).read_text())

    lr, warmup = float(preset("optim/adamw.yaml")["lr"]), preset("scheduler/warmup_cosine.yaml")["warmup_steps"]
    assert f"| `lr` | float | {lr} |" in _section(page, "### `optim=adamw`")
    assert f"| `warmup_steps` | int | {warmup} |" in _section(page, "### `scheduler=warmup_cosine`")
    data_dir = preset("paths/workspace.yaml")["data_dir"]
    assert f"| `data_dir` | str | `{data_dir}` |" in _section(page, "### `paths=workspace`")
    restore = next(line for line in page.splitlines() if line.startswith("| `restore_data_position` |"))
    assert restore.endswith("| false: start the saved epoch over from its first sample |"), restore


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
