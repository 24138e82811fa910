"""Which (vLLM, LMCache) pair an image holds, and what that pair supports.

LMCache's CUDA extension is built against one torch, and each vLLM pins one torch: only pairs
whose pins agree work (docs/compatibility.md). The operator must know the pair in the image to
render for it and to check flags against that vLLM's flag table (engine/flags.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..api.errors import ConfigError


@dataclass(frozen=True)
class EnginePair:
    vllm: str
    lmcache: str


@dataclass(frozen=True)
class KnownImage:
    vllm: str | None  # None: the image does not pin it; the spec must say
    lmcache: str | None
    why: str = ""
    # How the image got LMCache: "wheel" (PyPI's, whose CUDA extension is built against one torch) or
    # "source" (its sdist, the extension compiled against the image's own torch: images/serving/Dockerfile).
    lmcache_from: str = "wheel"


# Images whose contents are known. The project's own serving images are built by
# images/serving/Dockerfile from these pins (tests check the two agree), and every one of them is a
# row of docs/compatibility.md checked in full by `make test`. The default is vLLM 0.33.0 + LMCache 0.5.6,
# the newest of both: vLLM 0.33.0 pins torch 2.14.0, and no LMCache wheel is built against it (0.5.6's
# extension lacks c10_cuda_check_implementation there), so its image compiles LMCache from source against
# that torch. On an H200 every backend ran on it as rendered (docs/benchmarks.md, 1 and 3 Dec 2026;
# lmcache-server with its --shm-name fix in session 15, after it became the default). vLLM 0.26.0 +
# LMCache 0.5.3 (torch 2.11.0 both, LMCache's PyPI wheel) stays offered for those who pin it: every
# backend and tier ran on it on an H200.
SERVING_REPOSITORY = "ghcr.io/kvoffload/vllm-lmcache"
DEFAULT_PAIR = EnginePair(vllm="0.33.0", lmcache="0.5.6")
DEFAULT_IMAGE = f"{SERVING_REPOSITORY}:{DEFAULT_PAIR.vllm}-{DEFAULT_PAIR.lmcache}"
KNOWN_IMAGES: dict[str, KnownImage] = {
    DEFAULT_IMAGE: KnownImage(
        vllm=DEFAULT_PAIR.vllm, lmcache=DEFAULT_PAIR.lmcache, lmcache_from="source",
        why="built by images/serving/Dockerfile with LMCACHE_FROM=source "
            "(LMCache compiled against vLLM 0.33.0's torch 2.14.0)"),
    f"{SERVING_REPOSITORY}:0.26.0-0.5.3": KnownImage(vllm="0.26.0", lmcache="0.5.3",
                                                     why="built by images/serving/Dockerfile with "
                                                         "LMCACHE_FROM=wheel (LMCache's PyPI wheel)"),
    # LMCache's published image (docker/Dockerfile of the 0.5.4 sdist) pip-installs an unpinned vLLM:
    # its vLLM is whatever was newest when it was built.
    "lmcache/vllm-openai:v0.5.4": KnownImage(vllm=None, lmcache="0.5.4",
                                             why="it installs an unpinned vLLM; set "
                                                 "spec.engine.vllmVersion to the one it holds"),
}

# Environment the vllm container needs for LMCacheConnectorV1 (in-process LMCache) to really load KV,
# per known pair. vLLM 0.26.0's default V2 model runner calls the connector's start_load_kv without
# attention metadata when one token is left to compute; LMCache 0.5.3 then returns without loading
# ("attn_metadata is None", lmcache/integration/vllm/vllm_v1_adapter.py:787) while vLLM counts the
# tokens as external hits and skips their prefill: wrong answers, silently. With the V1 runner the
# loads happen (H200 run, docs/benchmarks.md "GPU": CPU tier 0.074 s vs 1.096 s recompute, disk tier
# 1.405 s read from disk; LMCache's retrieve counters count). vLLM 0.26.0 reads the variable in
# vllm/envs.py ("VLLM_USE_V2_MODEL_RUNNER": maybe_convert_bool(...), line 1922) and
# vllm/config/vllm.py (use_v2_model_runner, line 551).
# vLLM 0.33.0 + LMCache 0.5.6, from the source (and run with the V1 runner on an H200, 1 Dec 2026):
# V2 is the default runner for every
# model (vllm/config/vllm.py:748-767, no per-architecture gate any more); LMCacheConnectorV1 keeps
# vLLM's full CUDA graphs unless use_layerwise (kv_connector/v1/lmcache_connector.py:70-76,
# config/vllm.py:1990); with a full graph the V2 runner calls the connector's pre_forward outside the
# forward context (vllm/v1/worker/gpu/model_runner.py:2056), and its _start_load_kv then runs
# start_load_kv under set_forward_context(None) with the metadata only as a keyword
# (v1/worker/gpu/kv_connector.py:123-127), which LMCache 0.5.6 ignores: it reads
# forward_context.attn_metadata and returns when it is None (vllm_v1_adapter.py:782-785). The same
# skip, so the same fix; vLLM 0.33.0 still honours VLLM_USE_V2_MODEL_RUNNER=0 (config/vllm.py:748-750;
# envs.py:2149), and its V1 runner starts the loads inside the forward context
# (v1/worker/kv_connector_model_runner_mixin.py:85). The exporter's
# kvoffload_external_hits_unloaded_tokens catches the same failure at run time on any pair.
V1_RUNNER = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
CONNECTOR_ENV: dict[EnginePair, dict[str, str]] = {
    EnginePair(vllm="0.26.0", lmcache="0.5.3"): V1_RUNNER,
    EnginePair(vllm="0.33.0", lmcache="0.5.6"): V1_RUNNER,
}
# Why the operator owns each of these variables (a user value would undo the fix).
CONNECTOR_ENV_WHY = {
    "VLLM_USE_V2_MODEL_RUNNER": "the operator picks vLLM's model runner for the engine pair: vLLM's default V2 runner "
                                "skips LMCache's KV loads (vLLM 0.26.0 and 0.33.0, docs/compatibility.md)",
}


def serving_images() -> dict[str, KnownImage]:
    """The project's own serving images (images/serving/Dockerfile): the pairs the operator offers."""
    return {image: k for image, k in KNOWN_IMAGES.items() if image.startswith(SERVING_REPOSITORY + ":")}


def connector_env(pair: EnginePair) -> dict[str, str]:
    """Variables the in-process LMCache connector needs on this pair ({} for pairs without a known quirk)."""
    return dict(CONNECTOR_ENV.get(pair, {}))


# Usage telemetry ("phoning home"). Left alone, vLLM 0.26.0 posts usage stats from every engine to
# https://stats.vllm.ai (vllm/usage/usage_lib.py, is_usage_stats_enabled) and LMCache 0.5.3 posts usage
# messages to http://stats.lmcache.ai:8080 (lmcache/usage_telemetry/identity.py, is_usage_tracking_enabled).
# Traffic leaving the cluster is a bug for this product's users, so the operator turns both off in every
# container that runs vLLM or LMCache code, on every pair and backend, and users cannot turn them back on
# (docs/security.md). DO_NOT_TRACK=1 (the cross-tool convention) turns off LMCache's (also LMCache 0.5.4 and
# 0.5.6), huggingface_hub's (HF_HUB_DISABLE_TELEMETRY) and vLLM's; but vLLM reads DO_NOT_TRACK only when
# VLLM_DO_NOT_TRACK is unset (vllm/envs.py), so VLLM_NO_USAGE_STATS=1, which no other variable undoes, is set
# too. tests/engine/test_telemetry.py runs the pinned engine's own checks under the env the operator renders.
TELEMETRY_OFF_ENV: dict[str, str] = {"DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1"}
TELEMETRY_OFF_WHY = ("the operator turns vLLM's and LMCache's usage telemetry off, so that no pod sends traffic out of "
                     "the cluster; it cannot be turned back on (docs/security.md)")


def telemetry_off_env() -> dict[str, str]:
    """Variables that turn vLLM's and LMCache's usage telemetry off (every pair: an unread variable is harmless)."""
    return dict(TELEMETRY_OFF_ENV)


# Every variable the operator sets for the engine from this module, and why a user may not set it.
ENGINE_ENV_WHY: dict[str, str] = {**CONNECTOR_ENV_WHY, **{name: TELEMETRY_OFF_WHY for name in TELEMETRY_OFF_ENV}}


# LMCacheConnectorV1 with the in-process config file exists from these versions on.
MIN_VLLM = (0, 10, 0)
MIN_LMCACHE = (0, 3, 0)


def version_tuple(text: str, field: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split("."))
    except ValueError:
        raise ConfigError(field, f"{text!r} is not a version like 0.5.6") from None


def declared(image_versions: dict[str, dict[str, str]]) -> dict[str, KnownImage]:
    """The admin's images (operator config imageVersions) as table entries."""
    return {image: KnownImage(vllm=pair["vllm"], lmcache=pair.get("lmcache") or None,
                              why="declared in the operator config imageVersions")
            for image, pair in image_versions.items()}


# The LMCache server process's host memory beside its L1, by LMCache version (backend lmcache-server), measured on an
# H200 (docs/benchmarks.md, "lmcache-server under load"): 0.5.3's peaked at 0.41 GiB anonymous; 0.5.6's reached
# 2.81 GiB and was OOM-killed at a 2 GiB serverBaseline (+ 1 GiB headroom). From a listed version on, a smaller
# default is raised to the floor and a smaller explicit spec.resources.serverBaseline is refused.
SERVER_BASELINE_FLOOR = {"0.5.6": "4Gi"}


def server_baseline_floor(lmcache: str) -> str | None:
    """The floor of the highest SERVER_BASELINE_FLOOR version at or below `lmcache` (None: none applies)."""
    have = version_tuple(lmcache, "spec.engine.lmcacheVersion") if lmcache else ()
    at = [v for v in SERVER_BASELINE_FLOOR if version_tuple(v, "SERVER_BASELINE_FLOOR") <= have]
    return SERVER_BASELINE_FLOOR[max(at, key=lambda v: version_tuple(v, ""))] if at else None


def upstream_vllm_images() -> set[str]:
    """vLLM's own published images of the offered pairs' vLLM versions (no LMCache: backend vllm-native only)."""
    return {f"vllm/vllm-openai:v{k.vllm}" for k in serving_images().values() if k.vllm}


def allowed(image: str, allowlist: tuple[str, ...], table: dict[str, KnownImage]) -> bool:
    """Whether `image` may run: an image in the operator's table (its own, and the admin's imageVersions), vLLM's
    own image of an offered version, or an admin allowlist entry: the same reference, or a path ending in "/*" that
    the image lies below (so that "registry.acme/vllm/*" takes "registry.acme/vllm/x:1" but not
    "registry.acme/vllmx/y:1")."""
    def below(entry: str) -> bool:
        return entry.endswith("/*") and image.startswith(entry[:-1]) and len(image) > len(entry) - 1

    return image in table or image in upstream_vllm_images() or any(image == e or below(e) for e in allowlist)


def check_allowed(image: str, allowlist: tuple[str, ...], table: dict[str, KnownImage]) -> None:
    if not allowed(image, allowlist, table):
        known = {*table, *upstream_vllm_images()}
        extra = [e for e in allowlist if e not in known]
        raise ConfigError("spec.engine.image", f"{image!r} is not an image the cluster admin allows: the operator's "
                                               f"known images ({', '.join(sorted(known))})"
                                               + (f" and the allowlist ({', '.join(extra)})" if extra else "")
                                               + "; the admin adds images with the operator config allowedImages "
                                               "(or imageVersions)")


def resolve(image: str, vllm: str | None, lmcache: str | None, *, needs_lmcache: bool = True,
            table: dict[str, KnownImage] = KNOWN_IMAGES) -> EnginePair:
    """The pair in `image`: the table's for a known image (a declared version must agree with it: the flag and
    key tables are chosen by version), else what the spec declares; unknown images must say what they hold.
    Without `needs_lmcache` (backend vllm-native) an image without LMCache is fine: lmcache is then ""."""
    known = table.get(image)
    for field, said, holds in (("vllmVersion", vllm, known and known.vllm), ("lmcacheVersion", lmcache,
                                                                             known and known.lmcache)):
        if said and holds and said != holds:
            raise ConfigError(f"spec.engine.{field}", f"{said} contradicts image {image!r}, which holds {holds} "
                                                      f"(the operator's version table): leave it out or set {holds}")
    vllm = vllm or (known.vllm if known else None)
    lmcache = lmcache or (known.lmcache if known else None)
    if not needs_lmcache and vllm is not None and lmcache is None:
        if version_tuple(vllm, "spec.engine.vllmVersion") < MIN_VLLM:
            raise ConfigError("spec.engine.vllmVersion", f"vLLM {vllm} is too old; need >= "
                                                         f"{'.'.join(map(str, MIN_VLLM))}")
        return EnginePair(vllm=vllm, lmcache="")
    if vllm is None or lmcache is None:
        missing = "spec.engine.vllmVersion" if vllm is None else "spec.engine.lmcacheVersion"
        if known:
            raise ConfigError(missing, "the operator's version table does not know the "
                                       f"{missing.rsplit('.', 1)[1][:-7]} version in image {image!r}: {known.why}")
        raise ConfigError(missing, f"image {image!r} is not in the operator's version table "
                                   f"({', '.join(sorted(table))}); set spec.engine.vllmVersion and "
                                   "spec.engine.lmcacheVersion (or the admin lists "
                                   "it in the operator config imageVersions)")
    if version_tuple(vllm, "spec.engine.vllmVersion") < MIN_VLLM:
        raise ConfigError("spec.engine.vllmVersion", f"vLLM {vllm} predates LMCacheConnectorV1; need >= "
                                                     f"{'.'.join(map(str, MIN_VLLM))}")
    if version_tuple(lmcache, "spec.engine.lmcacheVersion") < MIN_LMCACHE:
        raise ConfigError("spec.engine.lmcacheVersion", f"LMCache {lmcache} is too old; need >= "
                                                        f"{'.'.join(map(str, MIN_LMCACHE))}")
    return EnginePair(vllm=vllm, lmcache=lmcache)


# spec.offload.server PerNode needs LMCache's connector to look the server up again after an outage. LMCache 0.5.3's
# scheduler-side adapter never starts its heartbeat (vllm_multi_process_adapter.py: `_heartbeats = {}`, then
# `if self._heartbeats is not None: return`), so once one lookup times out while the server is down it stays
# unhealthy and never looks up again until vLLM restarts: every request recomputes (H200, 4 Dec 2026: 0 tokens from
# the shared tier after a server restart; tests/engine/test_l2_restart.py). 0.5.6 starts it.
SHARED_SERVER_MIN_LMCACHE = (0, 5, 6)


def takes_shared_server(lmcache: str) -> bool:
    """Whether an image with this LMCache ("" for none) may run PerNode."""
    return bool(lmcache) and version_tuple(lmcache, "spec.engine.lmcacheVersion") >= SHARED_SERVER_MIN_LMCACHE


def check_shared_server(server: str, pair: EnginePair, allowed: str) -> None:
    """Refuse PerNode where the image's LMCache would stop using the shared server after its first outage."""
    if not takes_shared_server(pair.lmcache):
        need = ".".join(map(str, SHARED_SERVER_MIN_LMCACHE))
        raise ConfigError("spec.offload.server", f"{server} needs LMCache >= {need}; the image holds LMCache "
                          f"{pair.lmcache or 'none'}, whose vLLM connector stops looking the shared server up for good "
                          "once a lookup timed out while the server was down (spec.engine.image / lmcacheVersion); "
                          f"allowed values with this image: {allowed}")


def check_backend(backend: str, need_vllm: str, need_lmcache: str | None, pair: EnginePair) -> None:
    """Refuse a backend the image's pair does not have (each backend declares its minimum pair, checked in the
    installed sources of the default pair; older pairs are refused rather than guessed at), naming both versions."""
    min_vllm = version_tuple(need_vllm, "spec.offload.backend")
    min_lmcache = None if need_lmcache is None else version_tuple(need_lmcache, "spec.offload.backend")
    v = version_tuple(pair.vllm, "spec.engine.vllmVersion")
    lmc = version_tuple(pair.lmcache, "spec.engine.lmcacheVersion") if pair.lmcache else (0,)
    need = " and ".join(f"{name} >= {'.'.join(map(str, low))}"
                        for name, low in (("vLLM", min_vllm), ("LMCache", min_lmcache)) if low)
    if (min_vllm and v < min_vllm) or (min_lmcache and lmc < min_lmcache):
        raise ConfigError("spec.offload.backend", f"{backend} needs {need}; the image holds vLLM {pair.vllm} and "
                                                  f"LMCache {pair.lmcache or 'none'} "
                                                  "(spec.engine.image / vllmVersion / lmcacheVersion)")
