"""spec.offload.server PerNode against the engines of the offered pairs that take it (LMCache >= 0.5.6: vLLM 0.33.0 +
LMCache 0.5.6; 0.5.3 is refused), by their own parsers in their engine venvs: the serving pod's vLLM
command line (vLLM's parser, create_engine_config() and KVConnectorFactory: LMCacheMPConnector to the node's server at
the Service's address, lmcache.mp.mq_timeout lowered), and the node server's `lmcache server` command line (LMCache's
own server parser and config converters: bound to the pod's addresses, the named /dev/shm L1 the serving pods map,
the L2 with its cap). Skipped without an engine venv, unless KVO_REQUIRE_ENGINE=1 makes that a failure."""

from __future__ import annotations

import engine_venv
import pytest

from kvoffload.api.quantity import gib
from kvoffload.api.settings import Settings
from kvoffload.backends import lmcache_server
from kvoffload.controller import pipeline
from kvoffload.engine import images
from kvoffload.rendering import render, shared_cache
from kvtest.fidelity import for_image
from kvtest.specs import LLAMA_CONFIG, spec

SETTINGS = Settings(shared_memory_root="/run/kvoffload-shm")
ADDRESS = "198.19.0.42"  # a ClusterIP as the reconcile reads it back


def rendered(image: str, tp: int) -> tuple[pipeline.Desired, dict, dict]:
    s = for_image(spec(offload__backend="lmcache-server", offload__server="PerNode", engine__tensorParallelSize=tp),
                  image)
    d = pipeline.desired("svc", "team-a", "uid", s, SETTINGS, nodes=(shared_cache.Node("gpu-node-0"),),
                         address=ADDRESS)
    pod = next(c for c in d.children if c["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    server = next(c for c in d.children if c["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return d, pod["containers"][0], server


# The offered pairs that take PerNode (engine/images.SHARED_SERVER_MIN_LMCACHE; older ones are refused).
SHARED_IMAGES = [i for i, p in images.serving_images().items() if images.takes_shared_server(p.lmcache)]


@pytest.fixture(scope="module", params=SHARED_IMAGES)
def engine(request):
    image = request.param
    pair = images.KNOWN_IMAGES[image]
    venv = engine_venv.require(pair.vllm, pair.lmcache)
    cases = {f"shared-tp{tp}": rendered(image, tp) for tp in (1, 2)}
    def argv(server: dict) -> list[str]:
        return [a.replace("$(POD_NAME)", "svc-cache-x") for a in render.exec_argv(server)]

    out = engine_venv.run(venv, "check", {
        "vllm": [{"id": k, "argv": render.vllm_argv(v), "model_config": LLAMA_CONFIG}
                 for k, (_, v, _) in cases.items()],
        "server": [{"id": k, "argv": argv(s)} for k, (_, _, s) in cases.items()]})
    assert (out["versions"]["vllm"], out["versions"]["lmcache"]) == (pair.vllm, pair.lmcache)
    return cases, {section: {r["id"]: r for r in out[section]} for section in ("vllm", "server")}


@pytest.mark.parametrize("case_id", ["shared-tp1", "shared-tp2"])
def test_the_serving_pod_dials_its_nodes_server(engine, case_id):
    r = engine[1]["vllm"][case_id]
    assert r["ok"], r
    p = r["parsed"]
    assert p["kv_connector"] == "LMCacheMPConnector"
    assert p["connector_class"].endswith("LMCacheMPConnector")
    extra = p["kv_connector_extra_config"]
    assert extra["lmcache.mp.host"] == f"tcp://{ADDRESS}" and extra["lmcache.mp.port"] == 5555
    assert extra["lmcache.mp.mq_timeout"] == lmcache_server.SHARED_MQ_TIMEOUT_S
    assert extra["lmcache.mp.mp_transfer_mode"] == "engine_driven"


@pytest.mark.parametrize("case_id", ["shared-tp1", "shared-tp2"])
def test_the_node_server_command_line_through_lmcaches_parser(engine, case_id):
    d = engine[0][case_id][0]
    r = engine[1]["server"][case_id]
    assert r["ok"], r
    p = r["parsed"]
    assert (p["host"], p["port"]) == ("0.0.0.0", 5555) and (p["http_host"], p["http_port"]) == ("0.0.0.0", 8081)
    # The named segment the replicas map through the shared /dev/shm; 0.5.6 has none unless named.
    assert p["shm_name"].startswith("lmcache_l1_pool_") and p["l1_use_lazy"] is False
    assert p["supported_transfer_mode"] == "engine_driven"
    assert abs(p["l1_size_bytes"] - d.budget.tier("cpu").bytes) < 1024  # the replica's CPU tier, once per node
    (l2,) = p["l2_adapters"]
    assert l2["base_path"] == "/kvcache" and abs(l2["max_capacity_gb"] - gib(d.budget.tier("disk").bytes)) < 1e-5
