"""The backends layer: one module per spec.offload.backend behind one interface (base.Backend), and the
registry every other layer reads: the CRD's enum and rules (through api/data/backends.json, which
`make generate` writes from here), the planner, the renderer, the exporter, the conditions and the
CLI's choices. Imports only api/ and engine/. Adding a backend: docs/architecture.md."""

from __future__ import annotations

from ..api.errors import ConfigError
from . import lmcache, lmcache_server, vllm_native
from .base import Backend

REGISTRY: dict[str, Backend] = {b.name: b for b in (lmcache.BACKEND, lmcache_server.BACKEND, vllm_native.BACKEND)}
NAMES = tuple(REGISTRY)
DEFAULT = lmcache.BACKEND.name


def get(name: str, field: str = "spec.offload.backend") -> Backend:
    """The backend called `name`; a ConfigError naming `field` and the allowed values otherwise."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ConfigError(field, f"{name!r} is not allowed; allowed values: {', '.join(NAMES)}") from None


def declarations() -> dict[str, object]:
    """api/data/backends.json: what the API layer needs to know of every backend."""
    return {"default": DEFAULT, "backends": [b.declaration() for b in REGISTRY.values()]}
