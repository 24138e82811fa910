"""The exporter for backends lmcache-server and vllm-native: the LMCache server's real /status
(LMCache 0.5.3) and vLLM 0.26.0's native offload counters, and what proves offloading for each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvoffload import backends
from kvoffload.api.fetch import SourceError
from kvoffload.backends.lmcache_server import offload_active as server_active
from kvoffload.backends.vllm_native import offload_active as native_active
from kvoffload.exporter.capacity import TierCapacity
from kvoffload.exporter.collector import ExporterConfig, TierCollector
from kvoffload.exporter.lmcache_server import parse_status
from kvoffload.exporter.vllm_metrics import parse_vllm
from kvtest.exporter import FakeVllm

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
IDLE = json.loads((FIXTURES / "lmcache-0.5.3-server-status" / "status-idle.json").read_text())
CONNECTED = {**IDLE, "active_sessions": 1, "registered_non_cuda_instance_ids": [7],
             "storage_manager": {**IDLE["storage_manager"], "l1_manager": {
                 **IDLE["storage_manager"]["l1_manager"], "memory_used_bytes": 4 << 20}}}
VLLM = (FIXTURES / "vllm-0.26.0-lmcache-0.5.3-h200" / "vllm-metrics-with-lmcache.txt").read_text()
# vLLM 0.26.0's native offload counters, as its OffloadPromMetrics names them (model_name, engine labels).
NATIVE = VLLM + (
    "# HELP vllm:kv_offload_store_bytes_total Total bytes stored from GPU to offload storage.\n"
    "# TYPE vllm:kv_offload_store_bytes_total counter\n"
    'vllm:kv_offload_store_bytes_total{engine="0",model_name="m"} 8.388608e+06\n'
    "# HELP vllm:kv_offload_load_bytes_total Total bytes loaded from offload storage to GPU.\n"
    "# TYPE vllm:kv_offload_load_bytes_total counter\n"
    'vllm:kv_offload_load_bytes_total{engine="0",model_name="m"} 4.194304e+06\n')


def samples(collector: TierCollector) -> dict[tuple[str, tuple], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_status_of_the_real_server_parses():
    snap = parse_status(IDLE)
    assert (snap.healthy, snap.l1_used_bytes, snap.l1_total_bytes, snap.engines) == (True, 0, 268435456, 0)
    assert parse_status(CONNECTED).engines == 1
    with pytest.raises(SourceError):
        parse_status({"is_healthy": True})


def test_server_active_needs_a_registered_engine_and_connector_queries():
    vllm = parse_vllm(VLLM)
    assert (vllm.external_queries or 0) > 0
    assert server_active(vllm, parse_status(CONNECTED))
    assert not server_active(vllm, parse_status(IDLE))  # vLLM not registered with the server
    assert not server_active(None, parse_status(CONNECTED))
    assert not server_active(vllm, None)


def test_native_active_needs_vllms_own_offload_counters():
    assert native_active(parse_vllm(NATIVE))
    assert not native_active(parse_vllm(VLLM))  # LMCache's connector, not vLLM's native one


def test_server_backend_scrape(tmp_path):
    with FakeVllm(VLLM) as vllm, FakeVllm(json.dumps(CONNECTED)) as server:
        got = samples(TierCollector(ExporterConfig(vllm_metrics_url=vllm.url, backend="lmcache-server",
                                                   server_status_url=server.url,
                                                   capacity=TierCapacity(disk_bytes=10 << 30))))
    assert got[("kvoffload_tier_capacity_bytes", (("tier", "cpu"),))] == 268435456  # the L1 in force
    assert got[("kvoffload_tier_used_bytes", (("tier", "cpu"),))] == 4 << 20
    assert got[("kvoffload_tier_capacity_bytes", (("tier", "disk"),))] == 10 << 30
    assert got[("kvoffload_lmcache_server_engines", ())] == 1
    assert got[("kvoffload_offload_active", ())] == 1
    assert got[("kvoffload_source_up", (("source", "lmcache"),))] == 1


def test_server_backend_when_the_server_is_down():
    with FakeVllm(VLLM) as vllm:
        got = samples(TierCollector(ExporterConfig(vllm_metrics_url=vllm.url, backend="lmcache-server",
                                                   server_status_url="http://127.0.0.1:9/status")))
    assert got[("kvoffload_offload_active", ())] == 0
    assert got[("kvoffload_source_up", (("source", "lmcache"),))] == 0
    assert ("kvoffload_tier_used_bytes", (("tier", "cpu"),)) not in got  # left out, never zeroed


def test_native_backend_scrape():
    with FakeVllm(NATIVE) as vllm:
        got = samples(TierCollector(ExporterConfig(vllm_metrics_url=vllm.url, backend="vllm-native",
                                                   capacity=TierCapacity(cpu_bytes=40 << 30))))
    assert got[("kvoffload_tier_capacity_bytes", (("tier", "cpu"),))] == 40 << 30
    assert got[("kvoffload_offload_transfer_bytes_total", (("direction", "store"),))] == 8388608
    assert got[("kvoffload_offload_transfer_bytes_total", (("direction", "load"),))] == 4194304
    assert got[("kvoffload_offload_active", ())] == 1
    assert ("kvoffload_source_up", (("source", "lmcache"),)) not in got  # no LMCache to read
    assert ("kvoffload_tier_used_bytes", (("tier", "cpu"),)) not in got  # vLLM exports no fill level


@pytest.mark.parametrize("backend", backends.NAMES)
def test_every_figure_a_backend_declares_is_served(backend):
    """Backend.sources says which kvoffload_* samples each source gives (docs/backends.md is generated from it):
    a scrape of the real pages and the server's /status serves every one, and kvoffload_source_up names its sources."""
    pages = {"lmcache": VLLM, "lmcache-server": VLLM, "vllm-native": NATIVE}
    with FakeVllm(pages[backend]) as vllm, FakeVllm(json.dumps(CONNECTED)) as server:
        got = samples(TierCollector(ExporterConfig(vllm_metrics_url=vllm.url, backend=backend,
                                                   kv_bytes_per_token=131072,
                                                   server_status_url=server.url, unloaded_grace_s=0)))
    served = {name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else "") for name, labels in got}
    sources = backends.get(backend).sources
    assert {f for s in sources for f in s.figures} <= served
    assert {s.label for s in sources} == {dict(labels)["source"] for name, labels in got
                                          if name == "kvoffload_source_up"}


# --- spec.offload.server PerNode: the node's shared server, read by every replica on that node (docs/metrics.md)
WITH_L2 = json.loads((FIXTURES / "lmcache-0.5.6-server-status" / "status-idle-l2.json").read_text())


def test_the_l2_figures_come_from_lmcaches_own_eviction_count():
    """LMCache 0.5.6's real /status with the rendered fs_native L2 (an `eviction` block): its L2 bytes used and
    capacity; 0.5.3's without an L2, and the H200 run's L2 without an eviction block, have none."""
    snap = parse_status(WITH_L2)
    assert (snap.l1_total_bytes, snap.l2_used_bytes, snap.l2_capacity_bytes) == (268435456, 0, 536870912)
    assert (parse_status(IDLE).l2_used_bytes, parse_status(IDLE).l2_capacity_bytes) == (None, None)
    lazy = json.loads((FIXTURES / "h200-backends-vllm-0.26.0-lmcache-0.5.3" / "server-status-lazy-l1.json").read_text())
    assert parse_status(lazy).l2_capacity_bytes is None and parse_status(lazy).engines == 1


def test_per_node_the_shared_tier_is_the_nodes_labelled_once_per_node():
    """PerNode: the server's L1 and L2 are served as tier="shared" with the node, never as this pod's cpu or disk
    tier; its own gpu tier and vLLM's hits stay. Two replicas on one node serve identical series but for the pod
    (Prometheus' target labels), so max by (node, medium) counts the server once."""
    used = {**WITH_L2["storage_manager"]["l2_eviction_controller"]["adapters"][0], "total_bytes_used": 3 << 20}
    doc = {**WITH_L2, "registered_non_cuda_instance_ids": [7, 8],
           "storage_manager": {**WITH_L2["storage_manager"],
                               "l1_manager": {**WITH_L2["storage_manager"]["l1_manager"], "memory_used_bytes": 4 << 20},
                               "l2_eviction_controller": {**WITH_L2["storage_manager"]["l2_eviction_controller"],
                                                          "adapters": [used]}}}
    with FakeVllm(VLLM) as vllm, FakeVllm(json.dumps(doc)) as server:
        pods = [samples(TierCollector(ExporterConfig(
            vllm_metrics_url=vllm.url, backend="lmcache-server", server_status_url=server.url,
            kv_bytes_per_token=131072, shared_node="gpu-node-1",
            capacity=TierCapacity(cpu_bytes=40 << 30, disk_bytes=200 << 30)))) for _ in range(2)]
    got = pods[0]
    node = (("medium", "cpu"), ("node", "gpu-node-1"), ("tier", "shared"))
    disk = (("medium", "disk"), ("node", "gpu-node-1"), ("tier", "shared"))
    assert got[("kvoffload_tier_capacity_bytes", node)] == 268435456  # the server's L1 in force, not the rendered 40Gi
    assert got[("kvoffload_tier_used_bytes", node)] == 4 << 20
    assert got[("kvoffload_tier_capacity_bytes", disk)] == 536870912  # LMCache's own L2 capacity
    assert got[("kvoffload_tier_used_bytes", disk)] == 3 << 20
    assert got[("kvoffload_lmcache_server_engines", (("node", "gpu-node-1"),))] == 2
    for tier in ("cpu", "disk"):  # not this pod's
        assert ("kvoffload_tier_capacity_bytes", (("tier", tier),)) not in got
        assert ("kvoffload_tier_used_bytes", (("tier", tier),)) not in got
    assert ("kvoffload_tier_capacity_bytes", (("tier", "gpu"),)) in got
    assert got[("kvoffload_tier_hit_tokens_total", (("tier", "external"),))] >= 0  # this replica's, from vLLM
    assert got[("kvoffload_offload_active", ())] == 1
    assert pods[0] == pods[1]  # the same server's figures from each replica: a sum over pods would double them


def test_per_node_without_lmcaches_l2_count_the_rendered_capacity_stands():
    with FakeVllm(VLLM) as vllm, FakeVllm(json.dumps(CONNECTED)) as server:
        got = samples(TierCollector(ExporterConfig(
            vllm_metrics_url=vllm.url, backend="lmcache-server", server_status_url=server.url, shared_node="n",
            capacity=TierCapacity(disk_bytes=10 << 30))))
    assert got[("kvoffload_tier_capacity_bytes", (("medium", "disk"), ("node", "n"), ("tier", "shared")))] == 10 << 30
    assert ("kvoffload_tier_used_bytes", (("medium", "disk"), ("node", "n"), ("tier", "shared"))) not in got


def test_per_node_with_the_server_down_serves_no_shared_figure():
    with FakeVllm(VLLM) as vllm:
        got = samples(TierCollector(ExporterConfig(vllm_metrics_url=vllm.url, backend="lmcache-server",
                                                   server_status_url="http://127.0.0.1:9/status", shared_node="n",
                                                   capacity=TierCapacity(disk_bytes=10 << 30))))
    assert not [k for k in got if dict(k[1]).get("tier") in ("shared", "cpu", "disk")]  # left out, never zeroed
    assert got[("kvoffload_offload_active", ())] == 0
