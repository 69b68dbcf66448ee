"""The docstring under each field of a config dataclass (``rollart-nb train --list-options``,
the session's HTML, :func:`~rollart_nb.config.describe`)."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

__all__ = ["field_docs"]


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls`` (``{}`` where the source is missing).

    Example:
        >>> from rollart_nb.config import PipelineConfig
        >>> field_docs(PipelineConfig)["alpha"].split(":")[0]
        'Per-trajectory staleness bound'
    """
    docs: dict[str, str] = _attributes_section(cls.__doc__ or "")
    for klass in reversed(cls.__mro__[:-1]):
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0]
        if not isinstance(body, ast.ClassDef):
            continue
        stmts = body.body
        for a, b in zip(stmts, stmts[1:], strict=False):
            if (
                isinstance(a, ast.AnnAssign)
                and isinstance(a.target, ast.Name)
                and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant)
                and isinstance(b.value.value, str)
            ):
                docs[a.target.id] = inspect.cleandoc(b.value.value)
    return docs


def _attributes_section(doc: str) -> dict[str, str]:
    """The ``Attributes:`` section of a Google-style class docstring, per name (``a / b: text``
    documents both)."""
    out: dict[str, str] = {}
    lines = inspect.cleandoc(doc).splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return out
    names: list[str] = []
    for line in lines[start + 1 :]:
        if not line.strip() or not line.startswith(" "):
            break
        if not line.startswith("     ") and ":" in line:  # a new entry (one indent level)
            head, text = line.strip().split(":", 1)
            names = [n.strip() for n in head.split("/")]
            for n in names:
                out[n] = text.strip()
        else:
            for n in names:
                out[n] += " " + line.strip()
    return out
