"""spec.offload.backend: what each backend allows, how it is sized and rendered, and its conditions."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvoffload import backends
from kvoffload.api.errors import ConfigError
from kvoffload.api.quantity import GiB, gib, to_bytes
from kvoffload.api.settings import Settings
from kvoffload.api.spec import parse
from kvoffload.backends import lmcache_server
from kvoffload.cli import generate
from kvoffload.controller import conditions, pipeline
from kvoffload.controller.probe import Reading
from kvoffload.rendering import render
from kvtest.specs import SERVER_REQUEST, spec

ALLOW = Settings(allowed_images=("x/y:1",))  # an image the admin allows whose pair the spec names
PAIR = {"engine__image": "ghcr.io/kvoffload/vllm-lmcache:0.26.0-0.5.3", "engine__vllmVersion": "0.26.0",
        "engine__lmcacheVersion": "0.5.3"}


def desired(backend: str, **patch):
    s = spec(offload__backend=backend, **PAIR, **patch)
    if backend == "vllm-native":
        del s["offload"]["disk"]
    return pipeline.desired("svc", "team-a", "uid-1", s, ALLOW)


def pod(d):
    return next(c for c in d.children if c["kind"] == "StatefulSet")["spec"]["template"]["spec"]


def containers(d):
    p = pod(d)
    return {c["name"]: c for c in p["containers"] + p.get("initContainers", [])}


def arg(args, flag):
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("patch, field, words", [
    ({"offload__backend": "vllm-native"}, "spec.offload.disk", "CPU tier only"),
    ({"offload__backend": "lmcache-server", "offload__cpu__evictionPolicy": "LFU"}, "spec.offload.cpu.evictionPolicy",
     "LRU"),
    ({"offload__backend": "vllm-native", "offload__disk": None, "offload__cpu__evictionPolicy": "MRU"},
     "spec.offload.cpu.evictionPolicy", "LRU"),
    ({"offload__backend": "vllm-native", "offload__disk": None, "offload__chunkSize": 8192}, "spec.offload.chunkSize",
     "16-token vLLM KV blocks"),
    ({"offload__backend": "vllm-native", "offload__disk": None, "resources__stagingPerWorker": "2Gi"},
     "spec.resources.stagingPerWorker", "vllm-native"),
    ({"resources__serverBaseline": "3Gi"}, "spec.resources.serverBaseline", "no LMCache server"),
    ({"offload__backend": "redis"}, "spec.offload.backend", "lmcache, lmcache-server, vllm-native"),
    ({"offload__backend": "lmcache-server", "engine__image": "x/y:1", "engine__vllmVersion": "0.25.0",
      "engine__lmcacheVersion": "0.5.3"}, "spec.offload.backend", "vLLM 0.25.0"),
    ({"offload__backend": "lmcache-server", "engine__image": "x/y:1", "engine__vllmVersion": "0.26.0",
      "engine__lmcacheVersion": "0.5.2"}, "spec.offload.backend", "LMCache >= 0.5.3"),
    ({"offload__backend": "lmcache", "engine__image": "vllm/vllm-openai:v0.26.0", "engine__vllmVersion": "0.26.0"},
     "spec.engine.lmcacheVersion", "version table"),
])
def test_refused_with_the_field_named(patch, field, words):
    with pytest.raises(ConfigError) as err:
        parse(spec(**patch), ALLOW)
    assert err.value.field == field and words in str(err.value)


def test_native_needs_no_lmcache_in_the_image():
    s = spec(offload__backend="vllm-native", offload__disk=None, engine__image="vllm/vllm-openai:v0.26.0",
             engine__vllmVersion="0.26.0")
    assert parse(s, ALLOW).engine.lmcache_version == ""


def test_vllm_container_memory_is_the_same_and_the_server_adds_its_own():
    inproc, server, native = desired("lmcache"), desired("lmcache-server"), desired("vllm-native")
    # The L1 is requested by vLLM's container in both LMCache modes; the server's limit holds it too
    # (LMCache faults it in from the server when the server sees a GPU), its request does not.
    assert server.budget.memory_limit == inproc.budget.memory_limit
    assert server.budget.server_memory == SERVER_REQUEST
    assert inproc.budget.server_memory == 0 == native.budget.server_memory
    assert server.budget.server_memory_limit == SERVER_REQUEST + 40 * GiB
    assert inproc.budget.server_memory_limit == 0 == native.budget.server_memory_limit
    # The server's L1 is a /dev/shm segment: the volume grows by the CPU tier, never the container twice.
    assert server.budget.shm == inproc.budget.shm + 40 * GiB
    staging = {t.name: t.bytes for t in native.budget.memory_terms}["staging"]
    assert staging == 0  # vLLM copies directly between its GPU and pinned CPU blocks
    # Measured on the H200: a 40 GiB native tier pins 64 GiB (32 per-layer tensors of 1.25 GiB → 2 GiB).
    assert {t.name: t.bytes for t in native.budget.memory_terms}["cpu_tier"] == 64 * GiB
    assert native.budget.memory_limit > 66.3 * GiB  # the vLLM container's measured cgroup peak
    # A 32 GiB tier pins exactly 32 GiB: without staging buffers the pod is smaller than lmcache's.
    native32 = desired("vllm-native", offload__cpu__size="32Gi")
    inproc32 = desired("lmcache", offload__cpu__size="32Gi")
    assert {t.name: t.bytes for t in native32.budget.memory_terms}["cpu_tier"] == 32 * GiB
    assert native32.budget.memory_limit < inproc32.budget.memory_limit


PAIR_033 = {"engine__image": "ghcr.io/kvoffload/vllm-lmcache:0.33.0-0.5.6"}


def test_lmcache_056s_server_gets_the_measured_floor_and_a_smaller_explicit_one_is_refused():
    """LMCache 0.5.6's server process was OOM-killed at the 2 GiB default on an H200 (docs/benchmarks.md): its
    default rises to the floor, 0.5.3's stays the setting, and an explicit baseline under the floor is refused."""
    s = spec(offload__backend="lmcache-server", **PAIR_033)
    old, new = desired("lmcache-server"), pipeline.desired("svc", "team-a", "uid-1", s, ALLOW)
    assert new.budget.server_memory == old.budget.server_memory + 2 * GiB == SERVER_REQUEST + 2 * GiB
    assert new.budget.server_memory_limit == old.budget.server_memory_limit + 2 * GiB
    assert parse(spec(offload__backend="lmcache-server", resources__serverBaseline="6Gi", **PAIR_033),
                 ALLOW).resources.server_baseline == 6 * GiB
    with pytest.raises(ConfigError) as err:
        parse(spec(offload__backend="lmcache-server", resources__serverBaseline="3Gi", **PAIR_033), ALLOW)
    assert err.value.field == "spec.resources.serverBaseline" and "at least 4Gi" in str(err.value)


def test_native_tier_counts_whole_vllm_blocks():
    # chunkSize is LMCache's (refused with vllm-native, below); vLLM offloads 16-token blocks
    d = desired("vllm-native")
    cpu = d.budget.tier("cpu")
    assert cpu.tokens == 40 * GiB // (16 * d.budget.kv_bytes_per_token) * 16


def test_server_pod():
    d = desired("lmcache-server")
    c = containers(d)
    server, vllm = c["lmcache-server"], c["vllm"]
    assert server["restartPolicy"] == "Always"  # a native sidecar: outlives vLLM container restarts
    # The disk directory is emptied and the versions reported before the server starts.
    assert [i["name"] for i in pod(d)["initContainers"]] == ["prepare-disk-tier", "report-engine-versions",
                                                             "lmcache-server"]
    assert "nvidia.com/gpu" not in server["resources"]["limits"]  # engine-driven: the server needs no GPU
    assert to_bytes(server["resources"]["requests"]["memory"], "x") == d.budget.server_memory
    assert (to_bytes(server["resources"]["limits"]["memory"], "x") == d.budget.server_memory_limit
            == d.budget.server_memory + 40 * GiB)
    assert to_bytes(vllm["resources"]["limits"]["memory"], "x") == d.budget.memory_limit
    for name in ("lmcache-server", "vllm"):
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c[name]["volumeMounts"]  # the L1 is shared there
    args = server["args"]
    assert float(arg(args, "--l1-size-gb")) == pytest.approx(gib(d.budget.tier("cpu").bytes))
    assert arg(args, "--host") == "127.0.0.1" and arg(args, "--http-host") == "127.0.0.1"
    assert arg(args, "--supported-transfer-mode") == "engine_driven"
    # Eager L1 (the H200 run: LMCache's default lazy L1 turned the /dev/shm transfer off).
    assert "--no-l1-use-lazy" in args and "--l1-use-lazy" not in args
    l2 = json.loads(arg(args, "--l2-adapter"))
    # The eviction block is what bounds the L2 by max_capacity_gb (LMCache builds no L2 eviction without one).
    assert l2 == {"type": "fs_native", "base_path": render.DISK_DIR, "max_capacity_gb": 200.0, "use_odirect": True,
                  "eviction": {"eviction_policy": "LRU", "trigger_watermark": 0.8, "eviction_ratio": 0.2}}
    kv = json.loads(arg(vllm["args"], "--kv-transfer-config"))
    assert kv["kv_connector"] == "LMCacheMPConnector"
    assert kv["kv_connector_extra_config"]["lmcache.mp.port"] == int(arg(args, "--port"))
    assert kv["kv_connector_extra_config"]["lmcache.mp.mp_transfer_mode"] == "engine_driven"
    assert "LMCACHE_CONFIG_FILE" not in {e["name"] for e in vllm["env"]}
    assert not any(m["name"] == "kv-disk" for m in vllm["volumeMounts"])  # only the server writes the disk tier
    assert [k["kind"] for k in d.children] == ["Service", "Service", "StatefulSet", "PodDisruptionBudget"]
    exporter = c["exporter"]["args"]
    assert arg(exporter, "--backend") == "lmcache-server"
    assert arg(exporter, "--lmcache-server-url") == f"http://127.0.0.1:{lmcache_server.SERVER_HTTP_PORT}/status"


def test_native_pod():
    d = desired("vllm-native")
    c = containers(d)
    args = c["vllm"]["args"]
    assert arg(args, "--kv-offloading-backend") == "native"
    assert float(arg(args, "--kv-offloading-size")) == pytest.approx(40.0)  # GiB over all TP ranks
    assert "--kv-transfer-config" not in args
    assert set(c) == {"vllm", "exporter", "report-engine-versions"}
    assert not any(v["name"] in ("lmcache-config", "kv-disk") for v in pod(d)["volumes"])
    assert "ConfigMap" not in {k["kind"] for k in d.children}
    assert to_bytes(c["vllm"]["resources"]["limits"]["memory"], "x") == d.budget.memory_limit


def test_tp_native_size_is_the_total_over_ranks():
    d = desired("vllm-native", engine__tensorParallelSize=2)
    assert float(arg(containers(d)["vllm"]["args"], "--kv-offloading-size")) == pytest.approx(40.0)
    assert d.budget.tier("cpu").bytes_per_worker == 20 * GiB


@pytest.mark.parametrize("backend, reason", [("lmcache", "LMCacheActive"), ("lmcache-server", "LMCacheServerConnected"),
                                             ("vllm-native", "NativeOffloadActive")])
def test_offload_condition_names_the_backend(backend, reason):
    d = desired(backend)
    sts = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "replicas": 1, "readyReplicas": 1,
                                                     "updatedReplicas": 1, "currentRevision": "r",
                                                     "updateRevision": "r"}}
    p = {"metadata": {"name": "svc-0"}, "spec": {"nodeName": "n"},
         "status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "Initialized", "status": "True"}]}}
    body = {"metadata": {"name": "svc", "namespace": "team-a", "generation": 1}}
    for probes, want in (({"svc-0": Reading(1.0)}, reason), ({"svc-0": Reading(0.0)}, None)):
        st = conditions.status(body, d, None, conditions.Observed(sts, [p], probes))
        c = next(c for c in st["conditions"] if c["type"] == "OffloadActive")
        assert (c["reason"] == want) if want else c["status"] == "False"
    assert st["budget"]["backend"] == backend
    assert ("serverMemory" in st["summary"]) == (backend == "lmcache-server") == ("serverMemoryLimit" in st["summary"])


def test_plan_cli_backend():
    run = [sys.executable, "-m", "kvoffload.cli", "plan", "--model", "meta-llama/Llama-3.1-8B-Instruct",
           "--max-model-len", "32768", "--cpu-size", "40Gi"]
    out = subprocess.run(run + ["--backend", "lmcache-server", "-o", "json"], capture_output=True, text=True,
                         check=True)
    doc = json.loads(out.stdout)
    # The default pair's LMCache (0.5.6) needs a 4 GiB server baseline, as the operator renders it (the 2 GiB setting is
    # raised to engine/images.SERVER_BASELINE_FLOOR), + 1 GiB headroom.
    assert doc["backend"] == "lmcache-server" and doc["serverMemory"]["request"] == 5 * GiB
    assert doc["serverMemory"]["limit"] == 45 * GiB  # + the L1 (40 GiB), which the server faults in when it sees a GPU
    low = subprocess.run(run + ["--backend", "lmcache-server", "--server-baseline", "2Gi"], capture_output=True,
                         text=True)
    assert low.returncode != 0 and "--server-baseline: below 4Gi" in low.stderr
    native = subprocess.run(run + ["--backend", "vllm-native"], capture_output=True, text=True, check=True).stdout
    # The default vLLM (0.33.0) keeps the tier in one /dev/shm region (0.26.0's per-layer tensors: test_sizing.py).
    assert "cpu_tier" in native and "one /dev/shm region of 40 GiB" in native and "/dev/shm 42Gi" in native
    bad = subprocess.run(run + ["--backend", "vllm-native", "--disk-size", "100Gi"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--disk-size" in bad.stderr and "--backend vllm-native" in bad.stderr


def test_the_generated_part_of_the_backends_doc_sits_between_its_markers():
    """docs/backends.md: `make generate` rewrites only what lies between the markers (the prose around it is
    hand-written), and refuses a file that lost them rather than appending a second table."""
    doc = f"prose\n{generate.BACKENDS_BEGIN}\nstale\n{generate.BACKENDS_END}\nmore prose\n"
    out = generate.backends_doc(doc)
    assert out.startswith("prose\n") and out.endswith("\nmore prose\n") and "stale" not in out
    assert generate.backends_doc(out) == out
    for b in backends.REGISTRY.values():
        assert f"`{b.name}`" in out and all(f"`{path}`" in out for path in b.refuses)
    with pytest.raises(SystemExit, match="markers"):
        generate.backends_doc("prose only\n")


@pytest.mark.parametrize("left", ["segment", "link"])
def test_the_server_removes_the_segment_a_killed_server_left_before_it_starts(left, tmp_path):
    """A killed server's L1 segment stays in its tmpfs (the pod's /dev/shm outlives a container restart, the PerNode
    directory the pod), and LMCache 0.5.3 then lacks room for its own and falls back to pickled transfer. The rendered
    command, run by /bin/sh in a mount namespace of its own with a fresh tmpfs at /dev/shm and `lmcache server`
    replaced by a program that lists /dev/shm: the stale segment is gone (a link at its name goes, never what it
    names), every other file stays, and the program gets the server's arguments."""
    c = containers(desired("lmcache-server"))["lmcache-server"]
    assert c["command"] == lmcache_server.SERVER_COMMAND and render.exec_argv(c)[:2] == ["lmcache", "server"]
    outside = tmp_path / "outside"
    outside.write_text("not the server's")
    seg = f"/dev/shm/{lmcache_server.SERVER_SHM_NAME}"
    stale = f"head -c 65536 /dev/zero > {seg}" if left == "segment" else f"ln -s {outside} {seg}"
    setup = f'mount -t tmpfs -o size=1m tmpfs /dev/shm && {stale} && : > /dev/shm/nccl-1 && exec "$@"'
    lister = "import json, os, sys; print(json.dumps([sorted(os.listdir('/dev/shm')), sys.argv[1:]]))"
    argv = [*c["command"][:3], sys.executable, "-c", lister, *c["args"]]
    done = subprocess.run(["unshare", "--mount", "/bin/sh", "-c", setup, "sh", *argv], capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    files, args = json.loads(done.stdout)
    assert files == ["nccl-1"] and args == c["args"]
    assert outside.read_text() == "not the server's"
