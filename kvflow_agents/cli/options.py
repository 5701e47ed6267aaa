"""Option parsing shared by the CLI's command modules."""

from __future__ import annotations

import typer


def positive_list(text: str, hint: str, integer: bool = False) -> list:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (ints or floats), every value > 0; else a clear flag error."""
    try:
        vals = [(int if integer else float)(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated {'integers' if integer else 'numbers'}, "
                                 f"got {text!r}", param_hint=hint) from None
    if not vals or any(v <= 0 for v in vals):
        raise typer.BadParameter("values must be positive (> 0)", param_hint=hint)
    return vals
