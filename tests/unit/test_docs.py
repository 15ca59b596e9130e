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
