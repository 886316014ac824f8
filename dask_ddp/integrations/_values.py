"""What the integrations send: the numeric part of a library's logged values, as one record."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any


def numeric_values(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The values ``report()`` takes: numbers and one-element tensors, as floats."""
    values = {}
    for name, value in metrics.items():
        if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
            value = value.item()
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            values[f"{prefix}{name}"] = float(value)
    return values


def send(metrics: Mapping[str, Any], step: int | None, prefix: str = "") -> bool:
    """Report the numeric part of ``metrics`` as one record (nothing if there is none).
    False outside a dask_ddp rank, where nothing can be sent."""
    from .. import report
    from ..errors import NotInRankError

    values = numeric_values(metrics, prefix)
    if not values:
        return True
    try:
        report(values, step=step)
    except NotInRankError:
        return False
    return True
