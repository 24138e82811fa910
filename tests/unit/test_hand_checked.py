"""Hand-checked figures of the examples, which no UPDATE_GOLDEN=1 rewrites (issue 37).

The goldens (tests/golden/*.yaml) are regenerated from the code they check, so they cannot catch a wrong formula.
Here every expected value is a literal, worked out by hand from the documented formulas (planning/sizing.py's and
planning/routing.py's docstrings, docs/backends.md) and the documented inputs: the operator's default settings
(api/settings.py: engineBaseline 4Gi, perWorkerOverhead 2Gi, stagingPerWorker 1Gi, serverBaseline 2Gi, headroom
10% (at least 1Gi), cpuReadGbps 54.847573715916525, diskReadGbps 0.9384999892678052), the model shapes
(planning/catalog.py) and vLLM 0.26.0's measured prefill (32768 tokens in 1.121 s for an 8,030,261,248-parameter
Llama on one H200, planning/sizing.MEASURED_PREFILL_S). The arithmetic is in the comments. Change a literal only
after redoing it by hand.

The code is called only to render the examples (the renderer the golden tests use) and to plan them.
"""

import copy

import pytest
import yaml

from kvoffload.api.settings import Settings
from kvoffload.controller import pipeline
from kvoffload.planning import routing
from kvtest import ROOT

EXAMPLES = ROOT / "examples"
LMCACHE_CONNECTOR = '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'


def desired(name: str, **engine):
    doc = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    spec = copy.deepcopy(doc["spec"])
    spec["engine"].update(engine)
    return pipeline.desired(doc["metadata"]["name"], doc["metadata"]["namespace"], "", spec, Settings())


def pod(d):
    return next(c for c in d.children if c["kind"] == "StatefulSet")["spec"]["template"]["spec"]


def container(d, name):
    p = pod(d)
    return next(c for c in p.get("initContainers", []) + p["containers"] if c["name"] == name)


def memory(c):
    return c["resources"]["requests"]["memory"], c["resources"]["limits"]["memory"]


def flag(c, name):
    args = c["args"]
    return args[args.index(name) + 1]


def env(c):
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def shm_limit(d):
    return next(v for v in pod(d)["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"]


# --- cpu-tier-qwen25-7b: backend lmcache (the default), TP 1, CPU tier 32Gi, maxModelLen 32768, 141Gi GPU ---------
# Qwen2.5-7B: 28 layers, 4 KV heads, head_dim 3584 / 28 = 128, bf16 (2 B), 7,615,616,512 parameters.
# KV bytes per token = 2 (K, V) × 28 × 4 × 128 × 2 = 57,344 B.

def test_cpu_tier_qwen25_7b_vllm_container():
    d = desired("cpu-tier-qwen25-7b")
    vllm = container(d, "vllm")
    # engine baseline 4Gi + worker 1 × 2Gi + CPU tier 32Gi (pinned in full) + staging 1 × 1Gi + /dev/shm (1Gi + 1Gi × 1)
    # = 41Gi = 41,984Mi; headroom 10% = 4,198.4Mi (> 1Gi); 46,182.4Mi rounded up to whole MiB = 46,183Mi;
    # request = limit.
    assert memory(vllm) == ("46183Mi", "46183Mi")
    assert shm_limit(d) == "2Gi"  # lmcache adds nothing to /dev/shm
    assert flag(vllm, "--gpu-memory-utilization") == "0.9"  # the CRD's default
    assert flag(vllm, "--kv-transfer-config") == LMCACHE_CONNECTOR
    # the default image is vLLM 0.26.0 + LMCache 0.5.3, whose V2 runner skips LMCache's loads (engine/images.py)
    assert env(vllm)["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert env(vllm)["LMCACHE_CONFIG_FILE"]


def test_cpu_tier_qwen25_7b_on_vllm_033():
    d = desired("cpu-tier-qwen25-7b", image="ghcr.io/kvoffload/vllm-lmcache:0.33.0-0.5.6", vllmVersion="0.33.0",
                lmcacheVersion="0.5.6")
    vllm = container(d, "vllm")
    assert memory(vllm) == ("46183Mi", "46183Mi")  # the same terms: no pair-dependent term for backend lmcache
    # vLLM 0.33.0's V2 runner skips LMCache 0.5.6's loads the same way (engine/images.py): the V1 runner again.
    assert env(vllm)["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert flag(vllm, "--kv-transfer-config") == LMCACHE_CONNECTOR


def test_cpu_tier_qwen25_7b_lmcache_config():
    d = desired("cpu-tier-qwen25-7b")
    config = next(c for c in d.children if c["kind"] == "ConfigMap" and "max_local_cpu_size" in str(c.get("data")))
    text = "".join(config["data"].values())
    assert "max_local_cpu_size: 32.0" in text  # 32Gi / TP 1, as GiB
    assert "chunk_size: 256" in text  # the CRD's default


def test_cpu_tier_qwen25_7b_plan():
    b = desired("cpu-tier-qwen25-7b").budget
    assert b.kv_bytes_per_token == 57344
    # GPU: int(141Gi × 0.9) = int(151,397,597,184 × 0.9) = 136,257,837,465; − weights 7,615,616,512 × 2 = 15,231,233,024
    # − activation reserve 2Gi (2,147,483,648) = 118,879,120,793 B; / 57,344 = 2,073,087 tokens; / (57,344 ×
    # 32,768) = 63 seqs.
    assert (b.tier("gpu").tokens, b.tier("gpu").sequences) == (2073087, 63)
    # CPU: 32Gi = 34,359,738,368 / (256-token chunk × 57,344 = 14,680,064) = 2,340 chunks = 599,040 tokens; /
    # 32,768 = 18.
    assert (b.tier("cpu").tokens, b.tier("cpu").sequences) == (599040, 18)
    (cpu,) = b.reload
    # prefill (the default vLLM 0.33.0's measured one) = 32,768 / 1.169 = 28,030.80 tokens/s for 8,030,261,248
    # params; × 8,030,261,248 / 7,615,616,512 × TP 1 = 29,556.98 tokens/s; recompute 32,768 tokens = 1.108638 s.
    assert cpu.recompute_s == pytest.approx(1.108638, abs=1e-6)
    # reload = 32,768 × 57,344 = 1,879,048,192 B / TP 1 / 54.847573715916525e9 B/s = 0.0342595 s.
    assert cpu.reload_s == pytest.approx(0.0342595, abs=1e-7)
    # credit = 1 − 0.0342595 / 1.108638 = 0.96910 → 0.9691 (4 places); no disk tier: 0.
    assert routing.credits(b) == {"cpu": 0.9691, "disk": 0.0}
    # --max-tree-size: the largest worthwhile tier, max(GPU 2,073,087, CPU 599,040) = 2,073,087 tokens × 8 chars
    # = 16,584,696.
    assert routing.max_tree_size(b) == 16584696


# --- server-llama31-8b: backend lmcache-server, TP 1, CPU (L1) 40Gi, disk 200Gi, maxModelLen 65536, 141Gi GPU -------
# Llama-3.1-8B: 32 layers, 8 KV heads, head_dim 128, bf16, 8,030,261,248 parameters.
# KV bytes per token = 2 × 32 × 8 × 128 × 2 = 131,072 B.

def test_server_llama31_8b_containers_lmcache_053():
    d = desired("server-llama31-8b")  # the example's pair: vLLM 0.26.0 + LMCache 0.5.3
    # vLLM: 4Gi + 2Gi + L1 40Gi (requested here only) + staging 1Gi + /dev/shm 2Gi = 49Gi = 50,176Mi; + 10% (5,017.6Mi)
    # = 55,193.6Mi → 55,194Mi (docs/backends.md: 53.9 GiB).
    assert memory(container(d, "vllm")) == ("55194Mi", "55194Mi")
    # server: baseline 2Gi (no floor for 0.5.3) + headroom max(1Gi, 0.2Gi) = 3Gi; limit + L1 40Gi = 43Gi.
    assert memory(container(d, "lmcache-server")) == ("3Gi", "43Gi")
    assert shm_limit(d) == "42Gi"  # 1Gi + 1Gi × TP 1 + the 40Gi L1 segment


def test_server_llama31_8b_containers_lmcache_056():
    d = desired("server-llama31-8b", image="ghcr.io/kvoffload/vllm-lmcache:0.33.0-0.5.6", vllmVersion="0.33.0",
                lmcacheVersion="0.5.6")
    # LMCache 0.5.6's server reached 2.81 GiB: its baseline floor is 4Gi (engine/images.py SERVER_BASELINE_FLOOR), so
    # the default 2Gi is raised to 4Gi; + headroom max(1Gi, 0.4Gi) = 5Gi; limit + L1 40Gi = 45Gi.
    assert memory(container(d, "lmcache-server")) == ("5Gi", "45Gi")
    vllm = container(d, "vllm")
    assert memory(vllm) == ("55194Mi", "55194Mi")  # the vLLM container's terms do not depend on the pair
    # VLLM_USE_V2_MODEL_RUNNER=0 is for the in-process connector only (images.connector_env, backends/lmcache.py); the
    # lmcache-server backend's LMCacheMPConnector does not get it. Open question (reported, issue 37):
    # docs/backends.md's
    # GPU row says its runs used the V1 runner, which this rendering does not select.
    assert "VLLM_USE_V2_MODEL_RUNNER" not in env(vllm)
    assert flag(vllm, "--kv-transfer-config") == (
        '{"kv_connector":"LMCacheMPConnector","kv_role":"kv_both","kv_connector_extra_config":'
        '{"lmcache.mp.host":"tcp://127.0.0.1","lmcache.mp.port":5555,"lmcache.mp.mp_transfer_mode":"engine_driven"}}')


def test_server_llama31_8b_server_flags():
    server = container(desired("server-llama31-8b"), "lmcache-server")
    assert flag(server, "--host") == "127.0.0.1"  # the network rule: loopback only
    assert flag(server, "--port") == "5555"
    assert flag(server, "--chunk-size") == "256"
    assert flag(server, "--l1-size-gb") == "40.0"  # 40Gi / TP 1, as GiB
    assert "--no-l1-use-lazy" in server["args"]  # a lazy L1 fell back to pickled transfers (docs/backends.md)
    assert flag(server, "--supported-transfer-mode") == "engine_driven"
    # disk 200Gi as GiB, written with O_DIRECT, and evicted (LRU) from 80% of it: without the eviction block
    # LMCache 0.5.3/0.5.6 never evict from L2 and max_capacity_gb bounds nothing
    assert flag(server, "--l2-adapter") == (
        '{"base_path":"/kvcache","eviction":{"eviction_policy":"LRU","eviction_ratio":0.2,"trigger_watermark":0.8},'
        '"max_capacity_gb":200.0,"type":"fs_native","use_odirect":true}')


def test_server_llama31_8b_plan():
    b = desired("server-llama31-8b").budget
    assert b.kv_bytes_per_token == 131072
    # GPU: 136,257,837,465 − 8,030,261,248 × 2 − 2Gi = 118,049,831,321 B; / 131,072 = 900,648 tokens;
    # / (131,072 × 65,536) = 13 seqs.
    assert (b.tier("gpu").tokens, b.tier("gpu").sequences) == (900648, 13)
    # CPU: 40Gi / (256 × 131,072 = 33,554,432) = 1,280 chunks = 327,680 tokens; disk: 200Gi / 33,554,432 = 6,400 chunks
    # = 1,638,400 tokens.
    assert (b.tier("cpu").tokens, b.tier("disk").tokens) == (327680, 1638400)
    cpu, disk = b.reload
    # recompute: 65,536 / 29,231.04 tokens/s (the measured 8B itself, TP 1) = 2 × 1.121 = 2.242000 s.
    assert cpu.recompute_s == pytest.approx(2.242000, abs=1e-6)
    # CPU reload: 65,536 × 131,072 = 8,589,934,592 B / 54.847573715916525e9 = 0.1566147 s: credit 1 − 0.1566147 / 2.242
    # = 0.93015 → 0.9301. Disk reload: 8,589,934,592 / 0.9384999892678052e9 = 9.15283 s > 2.242 s: slower, credit 0.
    assert cpu.reload_s == pytest.approx(0.1566147, abs=1e-7)
    assert disk.reload_s == pytest.approx(9.15283, abs=1e-5) and disk.slower_than_recompute
    assert routing.credits(b) == {"cpu": 0.9301, "disk": 0.0}
    # --max-tree-size: the disk tier is slower than recompute, so it does not count: max(GPU 900,648, CPU 327,680)
    # = 900,648 tokens × 8 = 7,205,184.
    assert routing.max_tree_size(b) == 7205184


# --- tp8-llama33-70b: backend lmcache, TP 8, CPU 640Gi, disk 2Ti, maxModelLen 131072, 141Gi GPUs ----------------------
# Llama-3.3-70B: 80 layers, 8 KV heads (1 per GPU at TP 8), head_dim 8192 / 64 = 128, bf16, 70,553,706,496 parameters.
# KV bytes per token per GPU = 2 × 80 × 1 × 128 × 2 = 40,960 B; per replica × 8 = 327,680 B.

def test_tp8_llama33_70b_vllm_container():
    d = desired("tp8-llama33-70b")
    # 4Gi + 8 × 2Gi + CPU tier 640Gi + staging 8 × 1Gi + /dev/shm (1Gi + 8 × 1Gi = 9Gi) = 677Gi = 693,248Mi;
    # + 10% (69,324.8Mi) = 762,572.8Mi → 762,573Mi.
    assert memory(container(d, "vllm")) == ("762573Mi", "762573Mi")
    assert shm_limit(d) == "9Gi"
    config = next(c for c in d.children if c["kind"] == "ConfigMap" and "max_local_cpu_size" in str(c.get("data")))
    text = "".join(config["data"].values())
    # per worker, as GiB: 640Gi / 8 = 80.0; 2Ti = 2,048Gi / 8 = 256.0
    assert "max_local_cpu_size: 80.0" in text and "max_local_disk_size: 256.0" in text


def test_tp8_llama33_70b_plan():
    b = desired("tp8-llama33-70b").budget
    assert (b.kv_bytes_per_token, b.kv_bytes_per_token_per_gpu) == (327680, 40960)
    # GPU, per GPU: 136,257,837,465 − ceil(70,553,706,496 × 2 / 8) = 17,638,426,624 − 2Gi = 116,471,927,193 B;
    # / 40,960 = 2,843,552 tokens; / (40,960 × 131,072) = 21 seqs.
    assert (b.tier("gpu").tokens, b.tier("gpu").sequences) == (2843552, 21)
    # CPU: 80Gi per worker / (256 × 40,960 = 10,485,760) = 8,192 chunks = 2,097,152 tokens;
    # disk: 256Gi / 10,485,760 = 26,214.4 → 26,214 chunks = 6,710,784 tokens.
    assert (b.tier("cpu").tokens, b.tier("disk").tokens) == (2097152, 6710784)
    cpu, disk = b.reload
    # prefill: 28,030.80 × 8,030,261,248 / 70,553,706,496 × TP 8 = 25,523.21 tokens/s; 131,072 tokens: 5.135405 s.
    assert cpu.recompute_s == pytest.approx(5.135405, abs=1e-6)
    # CPU: 131,072 × 327,680 = 42,949,672,960 B / 8 ranks / 54.847573715916525e9 = 0.0978842 s: 1 − 0.0978842 / 5.135405
    # = 0.98094 → 0.9809. Disk: 42,949,672,960 / 0.9384999892678052e9 = 45.7642 s > 5.14 s: slower, credit 0.
    assert cpu.reload_s == pytest.approx(0.0978842, abs=1e-7)
    assert disk.reload_s == pytest.approx(45.7642, abs=1e-4) and disk.slower_than_recompute
    assert routing.credits(b) == {"cpu": 0.9809, "disk": 0.0}
    # max(GPU 2,843,552, CPU 2,097,152) = 2,843,552 tokens × 8 = 22,748,416 (the slower disk tier does not count).
    assert routing.max_tree_size(b) == 22748416
