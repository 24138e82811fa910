"""vLLM's router (`vllm-router` on PyPI, a Rust core in a Python wheel): the version the operator renders for,
its policies, and what it needs from the engines behind it.

Verified from the vllm-router 0.1.17 wheel (vllm_router/router_args.py: every flag rendered in
rendering/routing.py is declared there, with these defaults), its sdist (src/main.rs, src/config/mod.rs,
src/kv_index/discovery.rs, src/kv_index/subscriber.rs, src/routers/http/router.rs) and by running it against
stand-in engines that log what they are asked (tests/routing/build-router.sh installs it):
- `--service-discovery --selector k=v ... --service-discovery-namespace NS --service-discovery-port P`
  watches the pods of NS that carry the labels and routes to http://<pod IP>:P.
- `kv_aware` builds its KV index only for the workers it was started with (`--worker-urls`: a worker that
  discovery adds later is routed on load alone until the router restarts). For a worker named in
  `--kv-event-source URL=tcp://HOST:PORT` it takes the block size (`--kv-event-block-size`) and the model
  identity (`--kv-event-model`) from its flags and asks the engine nothing over HTTP (neither vLLM 0.26.0 nor
  0.33.0 serves GET /get_server_info, which it asks otherwise). It subscribes to the engine's ZMQ publisher and,
  on its first batch or any gap in the sequence numbers, asks `--kv-event-replay-source` for what it missed;
  without a replay source a gap drops that worker's index. BlockStored events are credited per medium: GPU 1,
  CPU `--kv-penalty-host` (0.8), external `--kv-penalty-external` (0.6), disk `--kv-penalty-disk` (0.3).
  At start-up it waits until every `--worker-urls` worker answers /health (`--worker-startup-timeout-secs`).
- `cache_aware` (read from the 0.1.17 sdist: src/policies/cache_aware.rs, src/protocols/spec.rs, src/tree.rs;
  docs/routing.md says what it does per request): its per-worker radix tree holds the token ids that each worker's
  POST /v1/completions/render (else POST /tokenize) returns, 8 characters per id, which `--max-tree-size` counts; a
  request that matches no tree well enough goes by load alone (requests in flight; on a tie the first worker); the
  trees are trimmed to `--max-tree-size` every `--eviction-interval-secs`.
- On SIGTERM it stops accepting and finishes the requests in flight (axum's graceful shutdown).
"""

from __future__ import annotations

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
# spec.routing.policy: auto runs cache_aware (rendering/routing.AUTO_POLICY: what served best on real engines)
POLICIES = ("auto", "kv_aware", "cache_aware", "round_robin")
# What the engine's KV-event publisher binds in the pod (vLLM's KVEventsConfig.endpoint default), and its replay
# endpoint beside it (KVEventsConfig.replay_endpoint: a ZMQ ROUTER that resends the last buffer_steps batches).
KV_EVENTS_PORT = 5557
KV_EVENTS_REPLAY_PORT = 5558
