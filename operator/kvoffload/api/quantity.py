"""Kubernetes quantities <-> bytes. Parsing is the kubernetes client's own parser."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

from .errors import ConfigError

GiB = 1024**3
MiB = 1024**2
_BINARY = (("Ti", 1024**4), ("Gi", GiB), ("Mi", MiB), ("Ki", 1024))


def to_bytes(value: str | int | float, field: str, *, allow_zero: bool = True) -> int:
    """Parse a quantity such as `40Gi`, `500G` or `1073741824` into whole bytes."""
    from kubernetes.utils.quantity import parse_quantity  # here: the exporter imports this module and not the client

    try:
        q = parse_quantity(value if not isinstance(value, float) else str(value))
    except (ValueError, InvalidOperation, TypeError):
        raise ConfigError(field, f"{value!r} is not a Kubernetes quantity (examples: 40Gi, 500G, 1073741824)") from None
    if q < 0 or (q == 0 and not allow_zero):
        raise ConfigError(field, f"{value!r} must be {'>= 0' if allow_zero else '> 0'}")
    return int(q.to_integral_value(rounding="ROUND_CEILING"))


def format_bytes(n: int) -> str:
    """Canonical quantity the API server keeps as written: the largest exact binary suffix."""
    for suffix, size in _BINARY:
        if n and n % size == 0:
            return f"{n // size}{suffix}"
    return str(n)


def gib(n: int) -> float:
    """Bytes -> GiB float, the unit LMCache's size keys use."""
    return float(Decimal(n) / Decimal(GiB))


def human(n: int | float) -> str:
    """Short human form for tables: 1.5 GiB, 128 KiB."""
    for suffix, size in (("TiB", 1024**4), ("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.4g} {suffix}"
    return f"{int(n)} B"
