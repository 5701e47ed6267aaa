"""Errors raised by the Agent Step Graph, and the one reader of its versioned JSON documents."""

from __future__ import annotations

import json
from typing import Any


class GraphError(ValueError):
    """A graph or a runtime state that cannot be an Agent Step Graph (the message says why)."""


def read_document(text: str, key: str, what: str) -> dict[str, Any]:
    """Parse a versioned kvflow JSON document (``{key: 1, ...}``, e.g. ``kvflow_asg``).

    ``what`` names it in errors ("an Agent Step Graph", "a transition model"). Raises one
    :class:`GraphError` that says what is wrong: not JSON, or not that document (a JSON list, a
    missing or other version), never an ``AttributeError`` or a message wrapped twice."""
    try:
        doc = json.loads(text)
    except (ValueError, TypeError) as e:
        raise GraphError(f"cannot read {what} from JSON: {e}") from e
    if not isinstance(doc, dict) or doc.get(key) != 1:
        raise GraphError(f"not {what} JSON document (missing {key}: 1)")
    return doc
