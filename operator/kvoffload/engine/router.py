"""vLLM's router (`vllm-router` on PyPI, a Rust core in a Python wheel): the version the operator renders for,
its policies, and what it needs from the engines behind it.

Verified from the vllm-router 0.1.17 wheel (vllm_router/router_args.py: every flag rendered in
rendering/routing.py is declared there, with these defaults) and by running it against an HTTP server
that logs what it is asked (tests/routing/build-router.sh installs it):
- `--service-discovery --selector k=v ... --service-discovery-namespace NS --service-discovery-port P`
  watches the pods of NS that carry the labels and routes to http://<pod IP>:P.
- `kv_aware` indexes a worker only after GET /get_server_info answers a `kv_block_size` and GET
  /kv_event_sources names its ZMQ publishers ({"<dp rank>": {"endpoint": ..., "topic": ...}}); otherwise
  it logs "no block_size from /get_server_info — cannot index" and routes on load alone. It tokenizes each
  request through the worker's POST /v1/completions/render. BlockStored events are credited per medium:
  GPU 1, CPU `--kv-penalty-host` (0.8), external `--kv-penalty-external` (0.6), disk `--kv-penalty-disk` (0.3).
  It asks a pod it found by `--service-discovery` the same (tests/integration/test_routing_cluster.py).
- `cache_aware` (read from the 0.1.17 sdist: src/policies/cache_aware.rs, src/protocols/spec.rs, src/tree.rs) asks
  each worker for the request's token ids (POST /v1/completions/render, else POST /tokenize) and keeps one radix tree
  per model of those ids, each id written as 8 hex characters behind a 6-character marker; `--max-tree-size` counts
  those characters per worker. Per request (CacheAwarePolicy::select_prepared): each worker's match rate is the share
  of the request's tokens its tree holds; when the load is balanced and the best rate exceeds `--cache-threshold`
  (0.3) it picks, among the workers with that rate, the one with the fewest requests in flight; otherwise the one with
  the fewest requests in flight of all, the first in its list when they tie (`min_by_key`), so requests sent one at a
  time all go to one worker. Load counts as imbalanced when the busiest worker has more than
  `--balance-abs-threshold` (64) requests in flight beyond the idlest and more than `--balance-rel-threshold` (1.5)
  times as many; then it picks the least loaded and records the request in that worker's tree. Every
  `--eviction-interval-secs` (120) it trims each worker's tree to `--max-tree-size` (2**25) characters, least recently
  used leaves first; between trims a tree grows without bound. No tokens from a worker (neither route answers): no
  tree at all, least loaded only.
"""

from __future__ import annotations

from dataclasses import dataclass

VERSION = "0.1.17"
DEFAULT_IMAGE = f"ghcr.io/kvoffload/vllm-router:{VERSION}"  # images/router/Dockerfile
HTTP_PORT = 8000  # the router's own port (--port): clients call it as they would call vLLM
METRICS_PORT = 29000  # --prometheus-port (the router's default)
DEFAULT_MAX_TREE_SIZE = 2 ** 25  # cache_aware's per-worker budget in characters, when nobody says
# cache_aware's tree characters per token: each token id as 8 hex digits (src/protocols/spec.rs, TOKEN_WIDTH).
TREE_CHARS_PER_TOKEN = 8
# --eviction-interval-secs: the router's default, and the shortest it accepts (src/config/validation.rs refuses 0).
DEFAULT_EVICTION_INTERVAL_S = 120
MIN_EVICTION_INTERVAL_S = 1
DEFAULT_CREDITS = {"cpu": 0.8, "external": 0.6, "disk": 0.3}  # kv_aware's constants (--kv-penalty-*)
# The router's flag per tier credit (the GPU tier's credit is 1, not a flag).
CREDIT_FLAGS = {"cpu": "--kv-penalty-host", "external": "--kv-penalty-external", "disk": "--kv-penalty-disk"}
# spec.routing.policy: auto picks kv_aware where the engine lets the router index it, else cache_aware.
POLICIES = ("auto", "kv_aware", "cache_aware", "round_robin")
# What the engine's KV-event publisher binds in the pod (vLLM's KVEventsConfig.endpoint default).
KV_EVENTS_PORT = 5557


@dataclass(frozen=True)
class Discovery:
    """Whether a vLLM version answers the two routes kv_aware needs to index a discovered pod."""
    server_info: bool  # GET /get_server_info with kv_block_size
    kv_event_sources: bool  # GET /kv_event_sources
    why: str

    @property
    def indexable(self) -> bool:
        return self.server_info and self.kv_event_sources


# Read from the released wheels' entrypoints (vllm/entrypoints/).
DISCOVERY: dict[str, Discovery] = {
    "0.26.0": Discovery(False, False, "vLLM 0.26.0 serves neither GET /get_server_info nor GET /kv_event_sources "
                                      "(only a dev-mode /server_info without kv_block_size)"),
    "0.33.0": Discovery(False, True, "vLLM 0.33.0 serves GET /kv_event_sources but no GET /get_server_info, so the router "
                                     "never learns the block size"),
}


def discovery(vllm_version: str) -> Discovery:
    return DISCOVERY.get(vllm_version, Discovery(False, False, f"vLLM {vllm_version} is not known to serve GET "
                                                                "/get_server_info and GET /kv_event_sources"))


def resolve(policy: str, vllm_version: str) -> str:
    """The policy the router runs for spec.routing.policy (auto: kv_aware where the pods can be indexed)."""
    if policy != "auto":
        return policy
    return "kv_aware" if discovery(vllm_version).indexable else "cache_aware"
