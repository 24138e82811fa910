"""The interface every spec.offload.backend implements (docs/architecture.md, "Adding a backend").

A backend is one module holding one `Backend` object: what it declares about the API (which spec
fields it cannot honour, which engine pair it needs), its sizing terms (planning asks), its pod
fragments (rendering assembles them into the generic pod and children), what the exporter reads and
what proves offloading, and its OffloadActive reasons. Its module imports only api/ and engine/ (and
only light modules of them at run time: the exporter imports it), so every layer below may ask it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..api.spec import Spec

from ..api.managed import HTTP_PORT  # noqa: F401  (declared with the pod's other ports: the spec may not reuse them)

# Pod layout the generic pod and the backends' fragments share.
CONFIG_DIR = "/etc/lmcache"  # where a backend's config files (Backend.config_files) are mounted
DISK_DIR = "/kvcache"
MULTIPROC_DIR = "/var/run/kvoffload/prometheus"
CONFIG_VOLUME = "lmcache-config"
# The exporter container's variable holding its pod's node (the downward API's spec.nodeName): with a shared server
# (spec.offload.server PerNode) the server's figures are the node's, labelled with it.
NODE_NAME_ENV = "NODE_NAME"


@dataclass(frozen=True)
class DiskReuse:
    """What a backend whose engine re-reads its disk tier after a restart tells the disk-tier init step."""
    layout: Mapping[str, Any]  # what besides the spec's model, dtypes, chunk, pair, seed and TP decides files' contents
    keep_bytes: int  # at most this many bytes of the earlier process's files are kept (the newest first)


@dataclass(frozen=True)
class MemoryTerm:
    name: str
    bytes: int
    note: str


class ModelShape(Protocol):
    """The model facts a backend's sizing reads (planning.catalog.ModelArch has them)."""
    @property
    def layers(self) -> int: ...
    @property
    def sliding_window(self) -> int | None: ...
    @property
    def sliding_window_layers(self) -> int: ...
    @property
    def full_layers(self) -> int: ...


@dataclass(frozen=True)
class Sizing:
    """What planning hands a backend to size its terms (bytes per replica unless said)."""
    model: ModelShape
    tp: int
    cpu_size: int
    disk_size: int
    chunk_size: int
    kv_bytes_per_token_per_gpu: int
    staging_per_worker: int
    server_baseline: int
    vllm: tuple[int, ...]  # the image's vLLM version: what it allocates changes between minors
    # spec.offload.server PerNode: the L1 and L2 live in the node's shared server pod, not in the replica
    shared: bool = False


class TierView(Protocol):
    @property
    def bytes(self) -> int: ...
    @property
    def bytes_per_worker(self) -> int: ...


class BudgetView(Protocol):
    """The Budget figures a backend's fragments read (planning.sizing.Budget has them)."""
    @property
    def kv_bytes_per_token(self) -> int: ...
    @property
    def server_memory(self) -> int: ...
    @property
    def server_memory_limit(self) -> int: ...
    def tier(self, name: str) -> TierView: ...


@dataclass(frozen=True)
class Sidecar:
    """What the generic pod gives a backend's sidecar containers."""
    image: str
    env: list[dict[str, Any]]  # POD_NAME, POD_NAMESPACE and the telemetry-off variables
    disk_mount: dict[str, Any] | None  # the pod's disk-tier mount (writable), None without a disk tier
    tmp_mount: dict[str, Any]  # the pod's /tmp: with a read-only root, where a sidecar writes scratch files
    security_context: dict[str, Any]  # read-only root, no capabilities
    shm_mount: dict[str, Any] | None = None  # the /dev/shm it shares with vLLM; None: the pod's own (volume dshm)


class VllmSeen(Protocol):
    """The vLLM /metrics figures a proof-of-offload rule reads (exporter.vllm_metrics.VllmSnapshot)."""
    @property
    def external_queries(self) -> float | None: ...
    @property
    def external_hits(self) -> float | None: ...
    @property
    def offload_store_bytes(self) -> float | None: ...


@dataclass(frozen=True)
class Source:
    """One input the exporter reads. A backend lists its own (Backend.sources): the exporter reads those, and the GPU
    benchmark checks their figures, without knowing any backend by name."""
    label: str  # kvoffload_source_up{source=...}: whose health the reads count in
    what: str  # where it is read (docs/backends.md)
    figures: tuple[str, ...]  # the kvoffload_* samples taken from it (docs/backends.md; test_exporter_backends.py)


# Every backend reads vLLM's page: hits, lookups and prompt-token origins are what the engine really served.
VLLM = Source("vllm", "vLLM's /metrics on 127.0.0.1", (
    'kvoffload_tier_capacity_bytes{tier="gpu"}', 'kvoffload_tier_used_bytes{tier="gpu"}',
    'kvoffload_tier_hit_tokens_total{tier="gpu"}', 'kvoffload_tier_requested_tokens_total{tier="gpu"}',
    'kvoffload_tier_hit_tokens_total{tier="external"}', 'kvoffload_tier_requested_tokens_total{tier="external"}',
    'kvoffload_prompt_tokens_total{origin="gpu"}', 'kvoffload_prompt_tokens_total{origin="external"}',
    'kvoffload_prompt_tokens_total{origin="compute"}'))
LMCACHE_METRICS = Source(
    "lmcache", "LMCache's prometheus multiprocess files (lmcache:*), or the same families on vLLM's page", (
        'kvoffload_tier_used_bytes{tier="cpu"}', 'kvoffload_tier_used_bytes{tier="disk"}',
        'kvoffload_tier_stored_tokens_total{tier="external"}', 'kvoffload_tier_evictions_total{tier="cpu"}',
        "kvoffload_external_hits_unloaded_tokens"))
# The LMCache server is LMCache to the source labels, however it is read.
SERVER_STATUS = Source("lmcache", "the LMCache server's GET /status on 127.0.0.1", (
    'kvoffload_tier_capacity_bytes{tier="cpu"}', 'kvoffload_tier_used_bytes{tier="cpu"}',
    "kvoffload_lmcache_server_engines"))
# Part of vLLM's page (read with it, counted in its health), listed apart because only native offloading has them.
VLLM_OFFLOAD = Source("vllm", "vLLM's own offload counters on its /metrics (vllm:kv_offload_*)", (
    'kvoffload_offload_transfer_bytes_total{direction="store"}',
    'kvoffload_offload_transfer_bytes_total{direction="load"}'))


@dataclass(frozen=True)
class Seen:
    """One exporter look at a pod's sources; None: that source is down or not read by this backend."""
    vllm: VllmSeen | None
    lmcache: Any = None  # exporter.lmcache_metrics.LmcacheSnapshot (backend lmcache)
    server: Any = None  # exporter.lmcache_server.ServerSnapshot (backend lmcache-server)


@dataclass(frozen=True)
class Reasons:
    """OffloadActive's words for this backend (controller/conditions.py)."""
    connector: str  # what is configured
    active: str  # reason when proven
    idle: str  # reason when not proven while serving
    proof: str  # what proves it
    missing: str  # what is missing when idle


@dataclass(frozen=True)
class Refusal:
    """A spec field this backend cannot honour: refused when set (when it differs from its CRD default, if
    it has one; the API server writes defaults), or, with `allowed`, when set to another value."""
    why: str
    allowed: tuple[str, ...] = ()


class Backend(ABC):
    name: str
    summary: str  # one sentence for the CRD's description of spec.offload.backend
    min_vllm: tuple[int, ...]
    min_lmcache: tuple[int, ...] | None  # None: no LMCache involved (the image may hold none)
    refuses: Mapping[str, Refusal] = {}  # spec path (without "spec.") -> why this backend cannot honour it
    in_process: bool = False  # the tiers live in the vLLM process (its config, its disk mount)
    stages: bool = True  # pinned staging buffers per worker (planning's staging term)
    sources: tuple[Source, ...] = (VLLM,)  # what the exporter reads
    proof: str = ""  # what proves offloading, beyond vLLM asking its KV connector (kvoffload_offload_active)
    unloaded_help: str = ""  # kvoffload_external_hits_unloaded_tokens' help, where unloaded_tokens judges
    # The tiers whose KV events the engine publishes for the router (spec.routing kv_aware): vLLM's own prefix cache
    # (medium GPU) always; an offload tier only where its connector publishes a BlockStored and a BlockRemoved.
    event_tiers: tuple[str, ...] = ("gpu",)
    reasons: Reasons

    @property
    def disk_tier(self) -> bool:
        return "offload.disk" not in self.refuses

    # Planning.
    def unit(self, s: Sizing) -> int:
        """Tokens stored as one piece."""
        return s.chunk_size

    @abstractmethod
    def cpu_tier(self, s: Sizing) -> MemoryTerm:
        """The CPU tier's term of the vLLM container's memory."""

    def warnings(self, s: Sizing) -> list[str]:
        return []

    def vllm_limit_only(self, s: Sizing) -> MemoryTerm | None:
        """A term the vLLM container's memory limit holds beyond its request (pages another pod's process may leave
        for vLLM's workers to fault in); None: request = limit."""
        return None

    def shm_extra(self, s: Sizing) -> int:
        """Bytes this backend keeps in the pod's memory-backed /dev/shm beyond NCCL's share."""
        return 0

    def sidecar_memory(self, s: Sizing) -> tuple[list[MemoryTerm], MemoryTerm | None]:
        """The sidecar container's request terms (before headroom) and a term held in its limit only; with
        s.shared, the node's shared server's terms (its request = limit)."""
        return [], None

    # Rendering fragments.
    @abstractmethod
    def vllm_args(self, spec: Spec, budget: BudgetView) -> list[str]:
        """vLLM flags that turn this backend's offloading on."""

    def kv_events_args(self, spec: Spec, budget: BudgetView) -> list[str]:
        """vLLM flags beyond --kv-events-config that make the offload tiers publish their KV events (kv_aware)."""
        return []

    def vllm_env_head(self, spec: Spec) -> list[dict[str, Any]]:
        """Variables that come first in the vllm container (where the backend's config is)."""
        return []

    def vllm_env(self, spec: Spec) -> list[dict[str, Any]]:
        """Variables the connector needs on the image's pair, after the pod's own."""
        return []

    def config_files(self, spec: Spec, budget: BudgetView) -> dict[str, str] | None:
        """Files of the config child (a ConfigMap mounted at CONFIG_DIR); None: no config child."""
        return None

    def sidecars(self, spec: Spec, budget: BudgetView, pod: Sidecar) -> list[dict[str, Any]]:
        """Containers that run beside vLLM (native sidecars: init containers that keep running)."""
        return []

    def shared_server(self, spec: Spec, budget: BudgetView, pod: Sidecar) -> list[dict[str, Any]]:
        """The containers of the node's shared server pod (spec.offload.server PerNode); [] for a backend that runs
        no server (it refuses PerNode)."""
        return []

    # The disk tier across pod restarts (docs/disk-tier.md, "Kept or emptied at pod start").
    def disk_reuse(self, spec: Spec, budget: BudgetView) -> DiskReuse | None:
        """How a restarted pod may reuse the files its hostPath disk directory holds; None: the engine never reads
        an earlier process's files again (its index is lost), so the directory is emptied at every pod start."""
        return None

    @abstractmethod
    def exporter_args(self, spec: Spec, budget: BudgetView) -> list[str]:
        """The exporter's flags for this backend's sources and capacities."""

    # Exporter.
    @abstractmethod
    def offload_active(self, seen: Seen) -> bool:
        """The proof-of-offload rule over one look (kvoffload_offload_active)."""

    def unloaded_tokens(self, seen: Seen) -> float | None:
        """Prompt tokens vLLM counted as loaded through its KV connector that this backend did not load
        (kvoffload_external_hits_unloaded_tokens); None: not judged (a source is down, or the backend cannot tell)."""
        return None

    def offload_active_help(self) -> str:
        return (f"1 if KV offloading (backend {self.name}) is proven at work, else 0. Rule: vLLM's /metrics was read "
                f"AND vllm:external_prefix_cache_queries_total > 0 AND {self.proof}.")

    def declaration(self) -> dict[str, Any]:
        """What the API layer reads (api/data/backends.json, written by `make generate`)."""
        return {"name": self.name, "summary": self.summary, "minVllm": ".".join(map(str, self.min_vllm)),
                "minLmcache": None if self.min_lmcache is None else ".".join(map(str, self.min_lmcache)),
                "refuses": {path: {"why": r.why, **({"allowed": list(r.allowed)} if r.allowed else {})}
                            for path, r in self.refuses.items()}}


def field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}


