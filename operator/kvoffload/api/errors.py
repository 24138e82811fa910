"""The one error type a user can cause: it always names the field at fault."""

from __future__ import annotations

import re
from collections.abc import Mapping


class ConfigError(ValueError):
    """Invalid input. `field` is a dotted path in the KVOffloadServe (e.g. `spec.offload.cpu.size`)
    or a CLI option; `message` says what is wrong and what is allowed."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


class InputError(ConfigError):
    """A planning input at fault, keyed by the planner's own name for it (`tp`, `cpu_size`); the
    message names other inputs as `{key}`. Each caller translates it into its own vocabulary (CRD
    paths in the operator, options in `kvoffload plan`) with `named`."""

    def __init__(self, key: str, template: str) -> None:
        super().__init__(key, template)
        self.key = key
        self.template = template

    def named(self, names: Mapping[str, str]) -> ConfigError:
        return ConfigError(name_inputs(f"{{{self.key}}}", names), name_inputs(self.template, names))


_INPUT = re.compile(r"\{(\w+)\}")


def name_inputs(text: str, names: Mapping[str, str]) -> str:
    """Replace each `{key}` in `text` with `names[key]`; a key without a name stays `{key}`."""
    return _INPUT.sub(lambda m: names.get(m.group(1), m.group(0)), text)
