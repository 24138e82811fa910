"""The one error type a user can cause: it always names the field at fault."""

from __future__ import annotations


class ConfigError(ValueError):
    """Invalid input. `field` is a dotted path in the KVOffloadServe (e.g. `spec.offload.cpu.size`)
    or a CLI option; `message` says what is wrong and what is allowed."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")
