"""Rendering: (owner, Spec, Budget, Settings) -> child objects as plain dicts.

Imports api/, engine/, backends/, planning/."""
