"""The disk tier's fingerprint: everything that decides the names and the contents of the files a pod's disk
directory holds, so that the disk-tier init step keeps an earlier pod's files only when the new pod would read them
as the same KV (docs/disk-tier.md, "Kept or emptied at pod start").

LMCache names a chunk by model name, worker rank and chunk hash (fs_native: `<model>@0x<rank>@<group>@<hash>.data`)
and stores raw tensor bytes with no header: a chunk written for another KV dtype, engine pair or layout under the
same name is loaded as if it were right. So the fingerprint holds every input that changes either the key or the
bytes, and more rather than less (an unneeded change empties a cache; a missed one serves wrong answers).
"""

from __future__ import annotations

import json
from typing import Any

from ..api.settings import Settings
from ..api.spec import Spec
from ..backends.base import Backend, BudgetView, DiskReuse

FORMAT = 1  # bump when the fields below change meaning: every kept directory is then emptied once


def fingerprint(spec: Spec, budget: BudgetView, settings: Settings, backend: Backend) -> dict[str, Any] | None:
    """The fingerprint of a hostPath disk tier whose backend re-reads it after a restart; None: always emptied."""
    reuse = reusable(spec, budget, backend)
    if reuse is None:
        return None
    e = spec.engine
    return {
        "format": FORMAT,
        "backend": backend.name,
        "layout": dict(reuse.layout),  # the backend's adapter and its write mode
        "model": spec.model.name,
        "servedName": spec.model.served_name,
        "architecture": dict(sorted(spec.model.architecture.items())),
        "dtype": e.dtype,
        "kvDtype": spec.model.kv_dtype,
        "chunkSize": spec.offload.chunk_size,
        "tensorParallelSize": e.tensor_parallel_size,
        "vllm": e.vllm_version,
        "lmcache": e.lmcache_version,
        "image": e.image,  # two builds of one pair may differ (another torch, another LMCache commit)
        "pythonHashSeed": settings.python_hash_seed,
        # Flags and variables can change the KV layout (an attention backend, a quantisation): kept whole.
        "extraArgs": list(e.extra_args),
        "env": [dict(v) for v in e.env],
    }


def reusable(spec: Spec, budget: BudgetView, backend: Backend) -> DiskReuse | None:
    """The backend's reuse of a hostPath disk tier; None without one (an ephemeral volume is new with each pod)."""
    if not spec.offload.disk or not spec.offload.disk.path:
        return None
    return backend.disk_reuse(spec, budget)


def encode(fp: dict[str, Any]) -> str:
    """The one text form: what the init container gets as --fingerprint and writes to its marker."""
    return json.dumps(fp, sort_keys=True, separators=(",", ":"))
