"""The configuration reference (``docs/reference.md``), generated from the schema dataclasses so it cannot drift:
every key of every typed group and option, its type, its default and the comment beside its field (in
:mod:`hydratrain.config.schema` and the group modules it draws on). A test regenerates it and fails when the page is
stale.

    python -m hydratrain.config.reference > docs/reference.md
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import tokenize
import typing
from enum import Enum
from types import ModuleType
from typing import Any

from hydratrain.config import schema

HEADER = """# Configuration reference

Generated from `hydratrain.config.schema` by `python -m hydratrain.config.reference > docs/reference.md` (a test
fails when this page is stale). Every key below is set on the command line as `group.key=value`; options are chosen
with `group=option`. The component groups (`model`, `loss`, `metrics`, a dataset `data` node) are `_target_` nodes
whose keys are their own constructor's: see [Your own model](own-model.md).
"""


def _schema_modules() -> list[ModuleType]:
    """The modules that define the schema's dataclasses: schema.py and each group's."""
    classes: list[type] = [schema.TrainConfig, schema.ModelKeys, schema.LoaderKeys]
    classes += [cls for options in schema.SCHEMAS.values() for cls in options.values()]
    hints = typing.get_type_hints(schema.TrainConfig)
    classes += [hints[f.name] for f in dataclasses.fields(schema.TrainConfig)
                if dataclasses.is_dataclass(hints[f.name])]
    names = {base.__module__ for cls in classes for base in cls.__mro__ if dataclasses.is_dataclass(base)}
    return [sys.modules[name] for name in sorted(names)]


def _comments() -> dict[tuple[str, str], str]:
    """``{(class name, field name): comment}`` of every schema module (the class names are unique across them)."""
    out: dict[tuple[str, str], str] = {}
    for module in _schema_modules():
        out.update(_module_comments(module))
    return out


def _module_comments(module: ModuleType) -> dict[tuple[str, str], str]:
    """``{(class name, field name): comment}``: the comment-only lines right above a field of ``module``, the ``#``
    comment on its line, and the comment-only lines right below it that continue that one (``#`` then an aligned
    indent)."""
    source = inspect.getsource(module)
    by_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            by_line[tok.start[0]] = tok.string[1:]
    lines = source.splitlines()

    def alone(row: int) -> bool:  # a line holding a comment only
        return row in by_line and lines[row - 1].strip().startswith("#")

    out = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            parts: list[str] = []
            above = item.lineno - 1
            while alone(above) and not by_line[above].strip().startswith("-"):
                parts.insert(0, by_line[above].strip())
                above -= 1
            row = item.end_lineno
            if row in by_line and not alone(row):
                parts.append(by_line[row].strip())
                nxt = row + 1
                while alone(nxt) and by_line[nxt].startswith("  "):
                    parts.append(by_line[nxt].strip())
                    nxt += 1
            if parts:
                out[(node.name, item.target.id)] = " ".join(parts)
    return out


def _doc(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    return "" if doc.startswith(f"{cls.__name__}(") else " ".join(doc.split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        names = [_type_name(a) for a in args if a is not type(None)]
        return " \\| ".join(names) + (" \\| null" if type(None) in args else "")
    if origin in (list, typing.List):
        return f"list[{_type_name(args[0])}]"
    if origin in (dict, typing.Dict):
        return f"dict[{_type_name(args[0])}, {_type_name(args[1])}]"
    if inspect.isclass(hint) and issubclass(hint, Enum):
        return " \\| ".join(m.value for m in hint)
    return getattr(hint, "__name__", str(hint))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return ""
    if value == "???":
        return "(required)"
    if isinstance(value, Enum):
        value = value.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _rows(cls: type, comments: dict, skip: tuple = ("name",), prefix: str = "") -> list[str]:
    """A row per field of ``cls``; a field that is a dataclass itself (``trainer.early_stopping``) a row per field of
    it, as ``<field>.<key>``."""
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            rows += _rows(hints[f.name], comments, skip=(), prefix=f"{prefix}{f.name}.")
            continue
        comment = next((comments[(c.__name__, f.name)] for c in cls.__mro__ if (c.__name__, f.name) in comments), "")
        rows.append(f"| `{prefix}{f.name}` | {_type_name(hints[f.name])} | {_default(f)} | {_cell(comment)} |")
    return rows


def _own_defaults(cls: type, base: type) -> set:
    """The fields of ``base`` whose default ``cls`` changes (``val_fraction`` of a corpus): listed with ``cls``."""
    ours = {f.name: _default(f) for f in dataclasses.fields(base)}
    return {f.name for f in dataclasses.fields(cls) if f.name in ours and _default(f) != ours[f.name]}


def render() -> str:
    """The reference page as markdown."""
    comments = _comments()
    out = [HEADER]
    top = schema.TrainConfig
    out += ["## Top-level keys", "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    hints = typing.get_type_hints(top)
    for f in dataclasses.fields(top):
        if dataclasses.is_dataclass(hints[f.name]) or f.name in schema.SCHEMAS or f.name in ("model", "loss", "data"):
            continue
        comment = comments.get((top.__name__, f.name), "")
        out.append(f"| `{f.name}` | {_type_name(hints[f.name])} | {_default(f)} | {_cell(comment)} |")
    out.append("")
    for f in dataclasses.fields(top):
        cls = hints[f.name]
        if dataclasses.is_dataclass(cls) and isinstance(cls, type):  # (hints are classes)
            out += [f"## `{f.name}`", "", *([_doc(cls), ""] if _doc(cls) else []),
                    "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
            out += _rows(cls, comments, skip=())
            out.append("")
    # keys every node of a group holds (a user's own file too): listed once, before the group's options
    owned = {"model": schema.ModelKeys, "data": schema.LoaderKeys}
    out += ["## `model`", "", _doc(schema.ModelKeys), "", "| key | type | default | meaning |",
            "| --- | --- | --- | --- |", *_rows(schema.ModelKeys, comments, skip=()), ""]
    for group, options in schema.SCHEMAS.items():
        out += [f"## `{group}`", "", f"Options: {', '.join(f'`{o}`' for o in options)} (`{group}=OPTION`).", ""]
        if group in owned:
            out += [_doc(owned[group]), "", "| key | type | default | meaning |", "| --- | --- | --- | --- |",
                    *_rows(owned[group], comments, skip=()), ""]
        for option, cls in options.items():
            mine = ("name",) + tuple(f.name for f in dataclasses.fields(owned[group]) if f.name not in
                                     _own_defaults(cls, owned[group])) if group in owned else ("name",)
            rows = _rows(cls, comments, skip=mine)
            out += [f"### `{group}={option}`", ""]
            if _doc(cls):
                out += [_doc(cls), ""]
            if rows:
                out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |", *rows]
            else:
                out.append("No keys of its own.")
            out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
