"""The memory planner for any model: the planner imports no model (it asks a model class for its memory model by
convention)."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "hydratrain"
PLANNER = ["plan.py", "footprint.py", "memsim.py"]


# ------------------------------------------------------------------------------------------------ the seam
def test_the_planner_imports_no_model():
    """The planner asks a model class for its memory model by convention (``memory_plan``), as MFU asks for
    ``flops_per_token``: no planner module imports hydratrain.models (at its top or inside a function)."""
    for name in PLANNER:
        tree = ast.parse((SRC / name).read_text())
        for node in ast.walk(tree):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(m == "hydratrain.models" or m.startswith("hydratrain.models.") for m in modules), \
                (name, node.lineno, modules)
