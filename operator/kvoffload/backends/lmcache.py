"""Backend lmcache: LMCache inside the vLLM process (LMCacheConnectorV1), configured by a YAML file
the operator renders into a ConfigMap; the CPU and disk tiers live and die with the vLLM container."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import yaml

from ..api.quantity import gib, human
from ..api.rules import SIDECAR
from ..engine import images
from ..engine.images import EnginePair
from .base import (
    CONFIG_DIR,
    DISK_DIR,
    LMCACHE_METRICS,
    MULTIPROC_DIR,
    VLLM,
    Backend,
    BudgetView,
    MemoryTerm,
    Reasons,
    Refusal,
    Seen,
    Sizing,
)

if TYPE_CHECKING:
    from ..api.spec import Spec

CONFIG_FILE = f"{CONFIG_DIR}/lmcache.yaml"
KV_TRANSFER_CONFIG = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, separators=(",", ":"))

OFFLOAD_ACTIVE_HELP = (
    "1 if KV offloading through LMCache is proven at work, else 0. Rule: vLLM's /metrics was read "
    "AND vllm:external_prefix_cache_queries_total > 0 (vLLM's scheduler has asked its KV connector "
    "for prompt tokens since vLLM started; vLLM counts these only when a KV connector is configured) "
    "AND LMCache's metrics are present (lmcache:* in the multiprocess dir, or on vLLM's page without "
    "--multiproc-dir: the connector is LMCache and its engine started) AND LMCache has stored or "
    "retrieved something (lmcache:num_stored_tokens_total or lmcache:num_retrieve_requests_total > 0: "
    "an LMCache engine whose init failed publishes zeros while vLLM serves on without it) AND, once "
    "vllm:external_prefix_cache_hits_total > 0, lmcache:num_retrieve_requests_total > 0 (LMCache "
    "really loaded; see kvoffload_external_hits_unloaded_tokens). 0 before the first request "
    "(not yet proven); 0 while vLLM serves traffic means offloading is not wired or not loading."
)

UNLOADED_HELP = (
    "Prompt tokens vLLM counted as loaded from its KV connector (vllm:external_prefix_cache_hits_total) "
    "while LMCache has retrieved nothing since it started (lmcache:num_retrieve_requests_total summed "
    "over TP workers is 0), once this has lasted the exporter's --unloaded-grace-seconds (LMCache "
    "publishes its counters every 10 s). vLLM skipped these tokens' prefill without their KV being "
    "loaded: answers are wrong. Seen with vLLM 0.26.0's V2 model runner and LMCache 0.5.3 (the operator "
    "renders VLLM_USE_V2_MODEL_RUNNER=0 for that pair). 0 otherwise; absent while vLLM or LMCache "
    "cannot be read."
)


def lmcache_gib(budget: BudgetView, tier: str) -> float:
    """A tier's per-worker share (Budget) in LMCache's unit: GiB as a float, to 6 decimals."""
    return round(gib(budget.tier(tier).bytes_per_worker), 6)


def lmcache_config(spec: Spec, budget: BudgetView) -> dict[str, Any]:
    """LMCache in-process config: keys and units exactly as `LMCacheEngineConfig` reads them (sizes are GiB
    floats per worker, i.e. per tensor-parallel rank); tests/engine/test_fidelity.py loads every rendered
    config with the image's LMCache (0.5.6 by default) and its own loader."""
    config: dict[str, Any] = {
        "chunk_size": spec.offload.chunk_size,
        "local_cpu": True,  # the disk tier needs it; the CPU tier is the point of this product
        "max_local_cpu_size": lmcache_gib(budget, "cpu"),
        "cache_policy": spec.offload.eviction_policy,
    }
    if spec.offload.disk:
        config["local_disk"] = f"file://{DISK_DIR}/"
        config["max_local_disk_size"] = lmcache_gib(budget, "disk")
    return config


def unloaded_tokens(vllm: Any, lmc: Any) -> float | None:
    """vLLM's external hits if LMCache has retrieved nothing, else 0; None when a source is down."""
    if vllm is None or lmc is None:
        return None
    hits = vllm.external_hits or 0.0
    return hits if hits > 0 and lmc.retrieve_requests == 0 else 0.0


def offload_active(vllm: Any, lmc: Any) -> bool:
    """The rule in OFFLOAD_ACTIVE_HELP: vLLM has consulted its KV connector, that connector is
    LMCache, LMCache has stored or retrieved something (on the H200 at TP 2 LMCache's init failed, a
    ZMQ socket path over 107 characters, and vLLM served on, its external queries counted, LMCache's
    counters all 0), and what vLLM counted as loaded LMCache really retrieved. Monotone while vLLM runs
    (the counters only rise), so the verdict does not flicker."""
    return (vllm is not None and lmc is not None and (vllm.external_queries or 0) > 0
            and (lmc.stored_tokens > 0 or lmc.retrieve_requests > 0) and unloaded_tokens(vllm, lmc) == 0)


class LMCache(Backend):
    name = "lmcache"
    summary = "LMCache inside the vLLM process (LMCacheConnectorV1); the tiers die with the vLLM container."
    min_vllm, min_lmcache = images.MIN_VLLM, images.MIN_LMCACHE  # LMCacheConnectorV1 with the config file
    refuses = {"resources.serverBaseline": Refusal("there is no LMCache server: LMCache runs inside the vLLM process"),
               "offload.server": Refusal("there is no LMCache server to share: LMCache runs inside the vLLM process",
                                         allowed=(SIDECAR,))}
    in_process = True
    # KV events: the GPU tier's only. LMCache's in-process tiers publish a BlockStored per stored chunk (medium "cpu",
    # lower case) and never a BlockRemoved: the router would keep crediting evicted chunks, so they stay off.
    sources = (VLLM, LMCACHE_METRICS)
    proof = "LMCache's metrics are present (the connector is LMCache and its engine started)"
    unloaded_help = UNLOADED_HELP
    reasons = Reasons(
        "LMCacheConnectorV1", "LMCacheActive", "NoLMCacheActivity",
        "vLLM asks LMCache for prompt tokens and LMCache's metrics are present",
        "vLLM has not asked LMCache for prompt tokens yet (vllm:external_prefix_cache_queries_total is 0), "
        "LMCache's metrics are absent, or LMCache has stored nothing (its engine may have failed to start: "
        "see the vllm container's log for 'LMCacheEngine marked as init failed')")

    def cpu_tier(self, s: Sizing) -> MemoryTerm:
        return MemoryTerm("cpu_tier", s.cpu_size, f"LMCache CPU tier, pinned in full at start-up: {s.tp} rank(s) × "
                                                  f"{human(s.cpu_size // s.tp)}")

    def vllm_args(self, spec: Spec, budget: BudgetView) -> list[str]:
        return ["--kv-transfer-config", KV_TRANSFER_CONFIG]

    def vllm_env_head(self, spec: Spec) -> list[dict[str, Any]]:
        return [{"name": "LMCACHE_CONFIG_FILE", "value": CONFIG_FILE}]

    def vllm_env(self, spec: Spec) -> list[dict[str, Any]]:
        # What this pair needs for the in-process connector to really load KV (vLLM 0.26.0: the V1 model
        # runner; LMCacheConnectorV1 skips loads under V2). LMCacheMPConnector has no such early return.
        pair = EnginePair(spec.engine.vllm_version, spec.engine.lmcache_version)
        return [{"name": k, "value": v} for k, v in sorted(images.connector_env(pair).items())]

    def config_files(self, spec: Spec, budget: BudgetView) -> dict[str, str] | None:
        head = (f"# Rendered by kvoffload for LMCache {spec.engine.lmcache_version}. "
                "Edit the KVOffloadServe, not this.\n")
        return {"lmcache.yaml": head + yaml.safe_dump(lmcache_config(spec, budget), sort_keys=True)}

    def exporter_args(self, spec: Spec, budget: BudgetView) -> list[str]:
        return ["--multiproc-dir", MULTIPROC_DIR, "--lmcache-config", CONFIG_FILE]

    def offload_active(self, seen: Seen) -> bool:
        return offload_active(seen.vllm, seen.lmcache)

    def unloaded_tokens(self, seen: Seen) -> float | None:
        return unloaded_tokens(seen.vllm, seen.lmcache)

    def offload_active_help(self) -> str:
        return OFFLOAD_ACTIVE_HELP


BACKEND = LMCache()
