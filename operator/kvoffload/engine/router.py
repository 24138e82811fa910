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
- `cache_aware` (read from the 0.1.17 sdist: src/policies/cache_aware.rs, src/protocols/spec.rs, src/tree.rs;
  docs/routing.md says what it does per request): its per-worker radix tree holds the token ids that each worker's
  POST /v1/completions/render (else POST /tokenize) returns, 8 characters per id, which `--max-tree-size` counts; a
  request that matches no tree well enough goes by load alone (requests in flight; on a tie the first worker); the
  trees are trimmed to `--max-tree-size` every `--eviction-interval-secs`.
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
    "0.33.0": Discovery(False, True, "vLLM 0.33.0 serves GET /kv_event_sources but no GET /get_server_info, so the "
                                     "router never learns the block size"),
}


def discovery(vllm_version: str) -> Discovery:
    return DISCOVERY.get(vllm_version, Discovery(False, False, f"vLLM {vllm_version} is not known to serve GET "
                                                                "/get_server_info and GET /kv_event_sources"))


def resolve(policy: str, vllm_version: str) -> str:
    """The policy the router runs for spec.routing.policy (auto: kv_aware where the pods can be indexed)."""
    if policy != "auto":
        return policy
    return "kv_aware" if discovery(vllm_version).indexable else "cache_aware"
