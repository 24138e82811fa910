"""Every LMCache config the operator renders loads with LMCache 0.5.6's own loader,
with no "Unknown configuration key" warning and exactly the GiB values expected."""

import logging

import pytest
import yaml

from kvoffload.api.settings import Settings
from kvoffload.controller import pipeline
from kvoffload.rendering import render

from .helpers import EXAMPLES, spec

lmcache_config = pytest.importorskip("lmcache.v1.config", reason="pip install lmcache==0.5.6 --no-deps (make venv does)")


@pytest.fixture
def load(tmp_path, caplog):
    def _load(text):
        path = tmp_path / "lmcache.yaml"
        path.write_text(text)
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            config = lmcache_config.LMCacheEngineConfig.from_file(str(path))
        return config, [r.getMessage() for r in caplog.records if "Unknown configuration key" in r.getMessage()]
    return _load


def rendered_text(spec_dict):
    d = pipeline.desired("x", "ns", "uid", spec_dict, Settings())
    cm = next(c for c in d.children if c["kind"] == "ConfigMap")
    return cm["data"]["lmcache.yaml"]


def test_the_capture_sees_unknown_keys(load):
    _, unknown = load("chunk_size: 256\ncpu_threshold: 0.8\n")
    assert unknown and "cpu_threshold" in unknown[0]


@pytest.mark.parametrize("tp, cpu, disk, cpu_gib, disk_gib", [
    (1, "40Gi", "200Gi", 40.0, 200.0),
    (2, "40Gi", "200Gi", 20.0, 100.0),
    (4, "10Gi", None, 2.5, None),
    (8, "640Gi", "2Ti", 80.0, 256.0),
    (8, "1Gi", "1Gi", 0.125, 0.125),
])
def test_sizes_are_per_worker_gib(load, tp, cpu, disk, cpu_gib, disk_gib):
    s = spec(engine__tensorParallelSize=tp, offload__cpu__size=cpu)
    if disk:
        s["offload"]["disk"]["size"] = disk
    else:
        del s["offload"]["disk"]
    config, unknown = load(rendered_text(s))
    assert unknown == []
    assert config.max_local_cpu_size == cpu_gib
    assert config.local_cpu is True
    assert config.chunk_size == 256
    if disk:
        assert config.max_local_disk_size == disk_gib
        assert config.local_disk == render.DISK_DIR + "/"  # file:// URL of the pod's own directory
    else:
        assert config.local_disk is None and config.max_local_disk_size == 0.0


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_load_cleanly(load, path):
    doc = yaml.safe_load(path.read_text())
    try:
        text = rendered_text(doc["spec"])
    except Exception as exc:  # the deliberately infeasible field example
        assert "as-seen-in-the-field" in path.name, exc
        return
    config, unknown = load(text)
    assert unknown == []
    assert config.cache_policy == doc["spec"]["offload"]["cpu"].get("evictionPolicy", "LRU")
