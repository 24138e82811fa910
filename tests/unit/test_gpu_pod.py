"""The container runner of the GPU benchmark (benchmarks/gpu: gpu_manifests.containerize, gpu_oci,
gpu_pod) without a GPU: the rendered pod's containers as a container runtime runs them, the OCI
specs the real node's containerd generated (benchmarks/gpu/oci, captured) rewritten for the GPU
host, and the checks the results are judged by."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvtest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import gpu_manifests as gm  # noqa: E402
import gpu_oci  # noqa: E402
import gpu_pod  # noqa: E402
import gpu_report  # noqa: E402

from kvoffload.backends import lmcache_server  # noqa: E402
from kvoffload.engine import images  # noqa: E402

OCI = ROOT / "benchmarks" / "gpu" / "oci"
PODS = {"workstation-llama31-8b": ROOT / "examples" / "workstation-llama31-8b.yaml",
        "server-llama31-8b": ROOT / "examples" / "server-llama31-8b.yaml",
        "native-llama31-8b": ROOT / "benchmarks" / "gpu" / "native-llama31-8b.yaml",
        "workstation-llama31-8b-vllm-0.33.0": ROOT / "benchmarks" / "gpu" / "workstation-llama31-8b-vllm-0.33.0.yaml",
        "server-llama31-8b-vllm-0.33.0": ROOT / "benchmarks" / "gpu" / "server-llama31-8b-vllm-0.33.0.yaml",
        "native-llama31-8b-vllm-0.33.0": ROOT / "benchmarks" / "gpu" / "native-llama31-8b-vllm-0.33.0.yaml",
        "workstation-llama31-8b-bf16": ROOT / "benchmarks" / "gpu" / "workstation-llama31-8b-bf16.yaml"}
HOST = gpu_oci.Host(image_dirs=("/usr", "/opt", "/etc"),
                    devices=(gpu_oci.Device("/dev/nvidia0", 195, 0), gpu_oci.Device("/dev/nvidiactl", 195, 255),
                             gpu_oci.Device("/dev/nvidia-uvm", 507, 0)),
                    rlimit_hard={"RLIMIT_NOFILE": 4096}, controllers=frozenset({"cpu", "memory", "pids", "io"}),
                    existing=frozenset({"/etc/hosts", "/etc/resolv.conf"}))


def rendered_text(name: str) -> str:
    return subprocess.run([sys.executable, "-m", "kvoffload.cli", "render", "-f", str(PODS[name])], check=True,
                          capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def rendered() -> dict[str, gm.Rendered]:
    return {n: gm.parse_rendered(rendered_text(n)) for n in PODS}


def pod(r: gm.Rendered, **kw) -> gm.PodRun:
    return gm.containerize(r, "/w/pod", "/d/node-dir", model_config={"num_hidden_layers": 32}, **kw)


# ------------------------------------------------------------------ the rendered pod's containers

def test_vllm_runs_the_rendered_command_with_only_the_model_changed(rendered):
    for r in rendered.values():
        run = pod(r)
        main = run.container("main")
        want = [*r.vllm.command, *r.vllm.args]
        i = want.index("serve") + 1
        assert main.argv[:i] == want[:i] and main.argv[i] == "/models/" + gm.MODEL_DIR
        assert main.argv[i + 1:] == want[i + 1:] + ["--load-format", "dummy", "--skip-tokenizer-init"]
        assert main.env["VLLM_SERVER_DEV_MODE"] == "1" and main.env["POD_NAME"] == f"{r.name}-0"
        assert json.loads(run.files[f"/w/pod/volumes/models/{gm.MODEL_DIR}/config.json"]) == {"num_hidden_layers": 32}
        assert [c.name for c in run.containers] == [*(c.name for c in r.init), *(c.name for c in r.sidecars), "vllm",
                                                    "exporter"]


def test_every_mount_lands_on_its_volume_and_subpathexpr_is_expanded(rendered):
    r = rendered["workstation-llama31-8b"]
    run = pod(r)
    # the hostPath volume is the allowed root (/mnt/nvme): the spec's lmcache/ is part of the subPath
    disk = f"/d/node-dir/lmcache/{r.namespace}/{r.name}/{r.name}-0"
    by = {c.name: c.mounts for c in run.containers}
    # the exporter reads the directory vLLM writes and the init container makes, marks and empties (from its parent)
    assert by["vllm"]["/kvcache"] == (disk, False)
    assert by["prepare-disk-tier"] == {"/var/run/kvoffload/disk-parent": (disk.rsplit("/", 1)[0], False)}
    assert by["exporter"]["/kvcache"] == (disk, True) and run.disk_dir == disk
    assert run.multiproc_dir == "/w/pod/volumes/prometheus-multiproc"
    assert run.memory_volumes == {"dshm": gm.quantity(r.volumes["dshm"]["emptyDir"]["sizeLimit"])}
    assert run.port == 8000 and run.exporter_port == 9400
    assert gm.flag(run.container("exporter").argv, "--listen") == f"{gm.POD_IP}:9400"
    assert yaml.safe_load(run.files["/w/pod/volumes/lmcache-config/lmcache.yaml"]) == r.lmcache_config()


def test_a_subpathexpr_variable_missing_from_the_containers_env_is_refused_as_kubelet_does():
    docs = [d for d in yaml.safe_load_all(rendered_text("workstation-llama31-8b")) if d]
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    x = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "exporter")
    x["env"] = [e for e in x["env"] if e["name"] != "POD_NAME"]  # the exporter as rendered before the fix
    with pytest.raises(gm.ManifestError, match="exporter: volumeMount /kvcache .*missing value for POD_NAME"):
        pod(gm.parse_rendered(yaml.safe_dump_all(docs)))


def test_server_sidecar_runs_before_vllm_with_its_probe_and_the_baseline_drops_it(rendered):
    r = rendered["server-llama31-8b"]
    run = pod(r)
    side = run.container("sidecar")
    assert side.name == "lmcache-server" and side.argv[:5] == lmcache_server.SERVER_COMMAND
    assert "--no-l1-use-lazy" in side.argv
    assert side.probe[:2] == ["python3", "-c"] and side.env["POD_NAME"] == f"{r.name}-0"
    assert gm.flag(side.argv, "--instance-id") == f"{r.name}-0"  # kubelet expands $(POD_NAME) in args
    assert run.status_url == "http://127.0.0.1:8081/status"
    base = pod(r, connector=False)
    assert base.container("sidecar") is None and base.status_url is None
    assert gm.CONNECTOR_FLAG not in base.container("main").argv and gm.CONNECTOR_FLAG in run.container("main").argv


def test_kept_volumes_are_not_emptied_and_overrides_reach_the_config(rendered):
    run = pod(rendered["workstation-llama31-8b"], kept={"home": "/w/kept-home"},
              lmcache_overrides={"use_layerwise": True}, extra_env={"LMCACHE_LOG_LEVEL": "DEBUG"})
    assert run.volume_dirs["home"] == "/w/kept-home" and "/w/kept-home" not in run.fresh_dirs
    assert "/w/pod/volumes/tmp" in run.fresh_dirs and "/d/node-dir" in run.fresh_dirs
    assert yaml.safe_load(run.files["/w/pod/volumes/lmcache-config/lmcache.yaml"])["use_layerwise"] is True
    assert run.container("main").env["LMCACHE_LOG_LEVEL"] == "DEBUG"
    assert "LMCACHE_LOG_LEVEL" not in run.container("exporter").env


# ------------------------------------------------------------------ the captured specs, rewritten

TEMPLATE = OCI / "hardened" / "c.json"  # the real node's CRI spec of a hardened pod (containerd 2.4.2, runc, cgroup v1)


def captured(name: str) -> dict[str, dict]:
    """Each container's spec as the runner derives it from the real node's spec (no capture of these pods yet)."""
    template = json.loads(TEMPLATE.read_text())
    r = gm.parse_rendered(rendered_text(name))
    return {c.name: gpu_oci.from_template(template, c.security, c.cpu_request, c.memory_limit)[0]
            for c in pod(r).containers}


@pytest.mark.parametrize("name", PODS)
def test_rewrite_keeps_what_kubelet_decided_and_adds_the_gpu(name, rendered):
    """The capture is of the rendered pod (each container's user and the pod's fsGroup), and the rewrite
    keeps what kubelet + containerd decided."""
    specs, r = captured(name), rendered[name]
    run = pod(r)
    for c in run.containers:
        spec = specs[c.name]
        user = spec["process"]["user"]
        assert user["uid"] == {"exporter": 65532, "prepare-disk-tier": 0}.get(c.name, 1000), c.name
        assert 1000 in user.get("additionalGids", []), c.name  # the pod's fsGroup
        at = gpu_oci.Placement(rootfs=f"/w/pod/rootfs-{c.name}", pod_files="/w/pod/files", sandbox_shm="/w/pod/shm",
                               namespaces={"network": "/proc/9/ns/net", "ipc": "/proc/9/ns/ipc",
                                           "uts": "/proc/9/ns/uts"},
                               image_env={"PATH": "/opt/kvimage/serving/bin:/usr/bin"}, volume_mounts=c.mounts,
                               cgroup_leaf=c.name, memory_limit=c.memory_limit, other_shape=True)
        new, changes = gpu_oci.rewrite(spec, c.argv, c.env, HOST, at, c.name)
        p, q = spec["process"], new["process"]
        for key in ("user", "capabilities", "noNewPrivileges", "oomScoreAdj"):
            assert q.get(key) == p.get(key), (c.name, key)
        assert (new["linux"]["seccomp"] == spec["linux"]["seccomp"]
                and new["root"]["readonly"] == spec["root"]["readonly"])
        assert new["linux"]["resources"]["memory"]["limit"] == c.memory_limit
        assert q["args"] == c.argv and "PATH=/opt/kvimage/serving/bin:/usr/bin" in q["env"]
        assert all(rl["hard"] <= 4096 for rl in q.get("rlimits", []) if rl["type"] == "RLIMIT_NOFILE")
        mounts = {m["destination"]: m for m in new["mounts"]}
        for dest, (src, ro) in c.mounts.items():
            assert mounts[dest]["source"] == src and ("ro" in mounts[dest]["options"]) == ro
        assert [m["destination"] for m in new["mounts"][:3]] == ["/usr", "/opt", "/etc"]
        assert all(not m["source"].startswith(("/var/lib/kubelet", "/var/lib/containerd", "/run/containerd"))
                   for m in new["mounts"]), c.name
        ns = {n["type"]: n.get("path") for n in new["linux"]["namespaces"]}
        assert ns["network"] == "/proc/9/ns/net" and ns["ipc"] == "/proc/9/ns/ipc" and ns["uts"] == "/proc/9/ns/uts"
        assert "path" not in next(n for n in new["linux"]["namespaces"] if n["type"] == "pid")
        assert new["linux"]["cgroupsPath"] == f"{gpu_oci.pod_cgroup(spec)}/{c.name}"
        devs = {d["path"]: d for d in new["linux"]["devices"]}
        assert devs["/dev/nvidia-uvm"]["major"] == 507
        assert ({"allow": True, "type": "c", "major": 195, "minor": 255, "access": "rwm"}
                in new["linux"]["resources"]["devices"])
        assert new["ociVersion"] == gpu_oci.OCI_VERSION and any("ociVersion" in ch for ch in changes)


def test_rewrite_takes_the_rendered_limit_and_refuses_a_capture_with_other_mounts(rendered):
    r = rendered["workstation-llama31-8b"]
    c = pod(r).container("main")
    spec = copy.deepcopy(captured("workstation-llama31-8b")["vllm"])
    # as a capture of this pod would hold it: the rendered volume mounts from kubelet's directories
    spec["mounts"] = [m for m in spec["mounts"] if "/kubelet/pods/" not in m["source"]
                      or m["destination"] in gpu_oci.POD_FILES] + [
        {"destination": d, "type": "bind", "source": f"/var/lib/kubelet/pods/u/volumes/kubernetes.io~empty-dir{d}",
         "options": ["rbind", "rprivate", "ro" if ro else "rw"]} for d, (_src, ro) in c.mounts.items()]
    spec["linux"]["resources"]["memory"].update(limit=2**30, swap=2**30)  # a pod sized for the CPU node
    at = gpu_oci.Placement(rootfs="/r", pod_files="/f", sandbox_shm="/s",
                           namespaces=dict.fromkeys(gpu_oci.JOINED, "/n"),
                           image_env={}, volume_mounts=c.mounts, cgroup_leaf="vllm", memory_limit=c.memory_limit)
    new, changes = gpu_oci.rewrite(spec, c.argv, c.env, HOST, at, "vllm")
    assert new["linux"]["resources"]["memory"]["limit"] == c.memory_limit
    assert any(ch.startswith(f"resources.memory.limit {2**30} (the captured pod's) -> {c.memory_limit}")
               for ch in changes)
    at = gpu_oci.Placement(rootfs="/r", pod_files="/f", sandbox_shm="/s",
                           namespaces=dict.fromkeys(gpu_oci.JOINED, "/n"),
                           image_env={}, volume_mounts={**c.mounts, "/extra": ("/x", False)}, cgroup_leaf="vllm")
    with pytest.raises(gpu_oci.SpecError, match="not in the captured spec"):
        gpu_oci.rewrite(spec, c.argv, c.env, HOST, at, "vllm")
    spec["mounts"].append({"destination": "/stray", "type": "bind", "source": "/var/lib/kubelet/x",
                           "options": ["rbind"]})
    with pytest.raises(gpu_oci.SpecError, match="captured mount /stray"):
        gpu_oci.rewrite(spec, c.argv, c.env, HOST, at, "vllm")


def test_pod_dry_run_lays_out_volumes_files_and_bundles(tmp_path, rendered):
    r = rendered["server-llama31-8b"]
    run = gm.containerize(r, str(tmp_path / "pod"), str(tmp_path / "node-dir"), model_config={"a": 1})
    p = gpu_pod.Pod(run, captured("server-llama31-8b"), name=f"{r.name}-0", tag="t", work=str(tmp_path / "pod"),
                    logdir=str(tmp_path), namespaces=dict(gpu_pod.NS_FILES), python="/opt/py/bin/python3", crun="crun",
                    host=HOST, dry_run=True, other_shape=True)
    p.prepare()
    assert set(p.boxes) == {c.name for c in run.containers}
    for name, b in p.boxes.items():
        spec = json.loads((b.bundle / "config.json").read_text())
        assert spec == b.spec and Path(spec["root"]["path"]).is_dir()
        for m in spec["mounts"]:
            if m["type"] == "bind" and m["destination"] not in HOST.image_dirs:
                assert Path(m["source"]).exists(), (name, m["destination"])
    assert (tmp_path / "pod" / "pod-files" / "resolv.conf").read_text() == "nameserver 127.0.0.1\n"
    assert (tmp_path / "node-dir" / "lmcache" / r.namespace / r.name / f"{r.name}-0").is_dir()
    env = dict(e.split("=", 1) for e in p.box("exporter").spec["process"]["env"])
    assert (env["PYTHONPATH"] == "/opt/kvimage/operator/site"
            and env["PATH"].startswith("/opt/kvimage/operator/bin:/opt/py/bin:"))


# ------------------------------------------------------------------ result checks

def test_verdicts_name_oom_kills_limits_transfer_and_the_l1s_container():
    G = 2**30
    run = {"runtime": "crun", "memory_limit": 54 * G, "memory": {"max_cg_peak": 10 * G, "max_cg_shmem": 1 * G},
           "sidecar_memory": {"lmcache-server": {"limit": 43 * G, "max_cg_peak": 41 * G, "max_cg_shmem": 40 * G}},
           "memory_events": {"vllm": {"oom_kill": 0}, "lmcache-server": {"oom_kill": 1}},
           "sidecar_log_facts": {"lmcache-server": {"transfer": ["shm"]}},
           "phases": {"gpu": [{"output_token_ids": [5]}, {"output_token_ids": [7]}],
                      "after_reset": [{"output_token_ids": [5]}, {"output_token_ids": [8]}]}}
    v = gpu_report.pod_verdicts(run)
    assert v[0] == "OOM-killed: lmcache-server (1x)"
    assert "lmcache-server: memory.peak 41.0 GiB = 95% of its 43.0 GiB limit" in v
    assert "lmcache-server: KV transfer shm" in v
    assert v[-1].startswith("shared memory charged to lmcache-server (40.0 GiB")
    assert gpu_report.token_check(run) == "after_reset = gpu: 1/2"
    disk = {"phases": {"cold": [{"output_token_ids": [1]}], "disk": [{"output_token_ids": [1]}],
                       "after_disk_reset": [{"output_token_ids": [2]}]}}
    assert gpu_report.token_check(disk) == "disk = cold: 1/1; after_disk_reset = cold: 0/1"
    assert gpu_report.pod_verdicts({"memory_events": {"vllm": {"oom_kill": 0}}})[0] == "no OOM kill"


def test_cold_cost_is_against_the_same_engine_without_the_connector():
    def ph(cold, reset, store=None):
        c = {"ttft_s": cold, **({"lmcache_store_ms": store, "lmcache_offload_ms": store - 5, "lmcache_put_ms": 5.0}
                                if store else {})}
        return {"cold": [c] * 3, "gpu": [{"ttft_s": 0.04, "output_token_ids": [3]}] * 3,
                "after_reset": [{"ttft_s": reset, "output_token_ids": [3]}] * 3}
    runs = {"connector-tp1-crun": {"kind": "connector", "backend": "lmcache", "phases": ph(1.217, 0.074, 117.0),
                                   "changes": []},
            "connector-tp1-layerwise": {"kind": "connector", "backend": "lmcache", "phases": ph(1.120, 0.090, 20.0),
                                        "changes": ['LMCache config overrides {"use_layerwise": true}']},
            "baseline-tp1-crun": {"kind": "baseline", "backend": "lmcache", "phases": ph(1.100, 1.096)}}
    rows = gpu_report.cold_cost_rows(runs, "baseline-tp1-crun")
    assert (rows[2]
            == "| connector-tp1-crun | `-` | 1.217 s | +10.6 % | 117 ms (112 / 5) | 0.074 s | after_reset = gpu: 3/3 |")
    assert rows[3].startswith('| connector-tp1-layerwise | `{"use_layerwise": true}` | 1.120 s | +1.8 % |')
    assert rows[-1].startswith("| baseline-tp1-crun | (no connector) | 1.100 s |") and len(rows) == 5


def user_of(spec: dict) -> tuple:
    u = spec["process"]["user"]
    return u["uid"], u["gid"], u["additionalGids"]


def test_from_template_sets_what_cri_derives_from_the_security_context(rendered):
    template = json.loads(TEMPLATE.read_text())
    run = pod(rendered["server-llama31-8b"])
    derived = {c.name: gpu_oci.from_template(template, c.security, c.cpu_request, c.memory_limit)
               for c in run.containers}
    init, _ = derived["prepare-disk-tier"]
    assert user_of(init) == (0, 0, [0, 1000])
    assert init["process"]["capabilities"]["effective"] == ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER"]
    assert user_of(derived["exporter"][0])[:2] == (65532, 65532) and derived["exporter"][0]["root"]["readonly"] is True
    side, changes = derived["lmcache-server"]
    assert side["root"]["readonly"] is True  # the sidecar writes only to its volumes (/tmp, /dev/shm, the disk tier)
    assert derived["vllm"][0]["linux"]["resources"]["cpu"]["shares"] == 4096  # cpu request 4
    for spec, _ in derived.values():  # the rest is the real node's: seccomp RuntimeDefault, masked paths
        assert spec["linux"]["seccomp"] == template["linux"]["seccomp"] and spec["process"]["noNewPrivileges"] is True
    assert changes[0].startswith("spec derived from the real node's CRI spec of pod hardened")


def test_a_capture_of_another_backends_pod_is_refused_unless_asked_and_then_listed(rendered):
    c = pod(rendered["workstation-llama31-8b"]).container("main")  # mounts /etc/lmcache: the server pod does not
    spec = captured("server-llama31-8b")["vllm"]
    kw = dict(rootfs="/r", pod_files="/f", sandbox_shm="/s", namespaces=dict.fromkeys(gpu_oci.JOINED, "/n"),
              image_env={},
              volume_mounts=c.mounts, cgroup_leaf="vllm", memory_limit=c.memory_limit)
    with pytest.raises(gpu_oci.SpecError, match="captured mount /scratch .* is neither a rendered volume mount"):
        gpu_oci.rewrite(spec, c.argv, c.env, HOST, gpu_oci.Placement(**kw), "vllm")
    new, changes = gpu_oci.rewrite(spec, c.argv, c.env, HOST, gpu_oci.Placement(**kw, other_shape=True), "vllm")
    m = next(m for m in new["mounts"] if m["destination"] == "/etc/lmcache")
    assert m["source"] == c.mounts["/etc/lmcache"][0] and m["options"] == ["rbind", "rprivate", "ro"]
    assert any(ch.startswith("volume mount /etc/lmcache added") for ch in changes)
    assert "captured volume mount /scratch dropped (the rendered pod has no such mount)" in changes
    assert user_of(new) == (1000, 1000, [1000]) and new["process"]["capabilities"] == {}


# ------------------------------------------------------------------ captures of the rendered pods (capture.py
# --rendered)

CAPTURES = {"lmcache": "workstation-llama31-8b", "lmcache-server": "server-llama31-8b",
            "vllm-native": "native-llama31-8b"}
CPU_NODE_MEMORY = 24683652 * 1024  # MemTotal of the CPU machine whose kubelet made the captures
GPU_HOST = gpu_oci.Host(**{**HOST.__dict__, "memory_capacity": 135128870912})  # an H200 host's MemTotal (1 Dec)


def capture_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("capture", OCI / "capture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sts_spec(docs: list[dict]) -> dict:
    return next(d for d in docs if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]


@pytest.mark.parametrize("backend", CAPTURES)
def test_for_cpu_node_changes_only_sizes_gpu_images_placement_and_the_sidecars_command(backend):
    cap = capture_module()
    docs = [d for d in yaml.safe_load_all(rendered_text(CAPTURES[backend])) if d]
    fitted, changes = cap.for_cpu_node(docs, backend)
    assert [d["kind"] for d in fitted] == [d["kind"] for d in docs if d["kind"] in ("ConfigMap", "StatefulSet")]
    before, after = sts_spec(docs), sts_spec(fitted)
    assert after["securityContext"] == before["securityContext"]
    for b, a in zip(before.get("initContainers", []) + before["containers"], after.get("initContainers", [])
                    + after["containers"]):
        for key in ("name", "env", "volumeMounts", "securityContext", "ports", "restartPolicy"):
            assert a.get(key) == b.get(key), (a["name"], key)
        if not (b.get("restartPolicy") == "Always" and b.get("startupProbe")):
            assert (a.get("command"), a.get("args")) == (b.get("command"), b.get("args")), a["name"]
        assert a["image"] == cap.OPERATOR
        for part in ("requests", "limits"):
            for kind, q in (a["resources"].get(part) or {}).items():
                if kind in cap.CAP:
                    assert cap._amount(kind, q) <= cap._amount(kind, cap.CAP[kind]), (a["name"], part, kind)
                    was = b["resources"][part][kind]
                    assert q == was or f"{a['name']}: {part}.{kind} {was} -> {q}" in changes
            assert "nvidia.com/gpu" not in (a["resources"].get(part) or {})
    assert after["nodeSelector"] == cap.node.PLACEMENT["nodeSelector"]
    assert [v for v in after["volumes"] if "hostPath" not in v] == [v for v in before["volumes"] if "hostPath" not in v]
    # the vLLM container is Burstable either way (a CPU request, no CPU limit): the same kubepods/burstable cgroup
    vllm = next(c for c in after["containers"] if c["name"] == "vllm")["resources"]
    assert "cpu" in vllm["requests"] and "cpu" not in vllm.get("limits", {})


@pytest.mark.parametrize("backend", CAPTURES)
def test_the_captures_are_of_the_rendered_pods(backend, rendered):
    """Every container of today's rendering was captured, as kubelet ran it: its user and groups, capabilities,
    read-only root, the rendered volume mounts with their read-only flag; and changes.json says what was fitted."""
    specs = gpu_pod.load_specs(str(OCI / backend))
    run = pod(rendered[CAPTURES[backend]])
    assert set(specs) == {c.name for c in run.containers}
    notes = json.loads((OCI / backend / "changes.json").read_text())
    assert notes["pod"].endswith(f"/{CAPTURES[backend]}-0") and notes["rendered"].endswith(PODS[CAPTURES[backend]].name)
    assert all(ch.split(":", 1)[0] in {d["kind"] + " " + d["metadata"]["name"] for d in yaml.safe_load_all(
        (OCI / backend / "applied.yaml").read_text())} | {"pod", "volume kv-disk"} | {c.name for c in run.containers}
               for ch in notes["changes"])  # each change names what it changed
    for c in run.containers:
        s, sec = specs[c.name], c.security
        assert s["annotations"]["io.kubernetes.cri.container-name"] == c.name
        assert s["process"]["user"]["uid"] == sec.get("runAsUser", 0) and 1000 in s["process"]["user"]["additionalGids"]
        added = sorted(f"CAP_{x}" for x in (sec.get("capabilities") or {}).get("add") or [])
        assert (s["process"]["capabilities"] or {}).get("effective", []) == added, c.name
        assert (s["process"]["noNewPrivileges"] is True
                and s["root"].get("readonly", False) == bool(sec.get("readOnlyRootFilesystem")))
        mounts = {m["destination"]: "ro" in m["options"] for m in s["mounts"] if "/kubelet/pods/" in m["source"]
                  and m["destination"] not in gpu_oci.POD_FILES}
        assert mounts == {d: ro for d, (_src, ro) in c.mounts.items()}, c.name
        assert s["linux"]["seccomp"]["defaultAction"] == "SCMP_ACT_ERRNO"
        # the sizes kubelet derived on the CPU node, from the fitted pod's requests (kubelet's formula, checked)
        lim = s["linux"]["resources"]["memory"]["limit"]
        assert lim == min(c.memory_limit, 2**30), c.name
        req = min(c.memory_request, 2**30)
        floor = min(min(x.memory_request, 2**30) for x in run.containers if x.role in ("main", "exporter"))
        assert s["process"]["oomScoreAdj"] == gpu_oci.oom_score_adj(
            gpu_oci.qos(s), req, CPU_NODE_MEMORY, floor if c.role == "sidecar" else None), c.name


@pytest.mark.parametrize("backend", CAPTURES)
def test_rewrite_of_a_capture_puts_back_the_rendered_sizes_and_nothing_else(backend, rendered, tmp_path):
    r = rendered[CAPTURES[backend]]
    run = gm.containerize(r, str(tmp_path / "pod"), str(tmp_path / "node-dir"), model_config={"a": 1})
    specs = gpu_pod.load_specs(str(OCI / backend))
    p = gpu_pod.Pod(run, copy.deepcopy(specs), name=f"{r.name}-0", tag="t", work=str(tmp_path / "pod"),
                    logdir=str(tmp_path),
                    namespaces=dict(gpu_pod.NS_FILES), python="/opt/py/bin/python3", crun="crun", host=GPU_HOST,
                    dry_run=True)
    p.prepare()  # same shape: a mount missing on either side is refused
    for c in run.containers:
        old, new, ch = specs[c.name], p.box(c.name).spec, p.changes[c.name]
        assert not any("derived from" in x or "added as kubelet mounts" in x for x in ch), c.name
        res = new["linux"]["resources"]
        assert res["memory"] == {"limit": c.memory_limit, "swap": c.memory_limit}
        assert res["cpu"]["shares"] == gpu_oci.cpu_shares(c.cpu_request)
        want_oom = new["process"]["oomScoreAdj"]
        if c.name == "vllm":
            assert (want_oom == 1000 - 1000 * c.memory_request // GPU_HOST.memory_capacity
                    < old["process"]["oomScoreAdj"])
            assert any(x.startswith(f"resources.memory.limit {2**30} (the captured pod's) -> {c.memory_limit}")
                       for x in ch)
        for key in ("user", "capabilities", "noNewPrivileges", "cwd"):
            assert new["process"].get(key) == old["process"].get(key), (c.name, key)
        for key in ("seccomp", "maskedPaths", "readonlyPaths", "sysctls"):
            assert new["linux"].get(key) == old["linux"].get(key), (c.name, key)
        assert new["root"]["readonly"] == old["root"].get("readonly", False)
        kept = {m["destination"]: m["options"] for m in old["mounts"]}
        assert all(m["options"] == kept[m["destination"]] for m in new["mounts"] if m["destination"] in kept)


def test_kubelets_oom_score_adj():
    assert gpu_oci.oom_score_adj("burstable", 2**30, CPU_NODE_MEMORY) == 958  # as the CPU node's kubelet set it
    assert gpu_oci.oom_score_adj("burstable", 55194 * 2**20, 135128870912) == 572
    assert gpu_oci.oom_score_adj("burstable", 64 * 2**20, 2**40) == 999  # never BestEffort's 1000
    assert gpu_oci.oom_score_adj("burstable", 2**41, 2**40) == 3  # never below Guaranteed + 1000
    # a sidecar: the smallest regular request
    assert gpu_oci.oom_score_adj("burstable", 32 * 2**20, 2**34, sidecar_floor=2**30) == 938
    assert (gpu_oci.oom_score_adj("guaranteed", 2**30, 2**40) == -997
            and gpu_oci.oom_score_adj("besteffort", None, 2**40) == 1000)


# ------------------------------------------------------------------ the second pair (vLLM 0.33.0 + LMCache 0.5.6)

@pytest.mark.parametrize("base,image", [
    ("workstation-llama31-8b", "ghcr.io/kvoffload/vllm-lmcache:0.33.0-0.5.6"),
    ("server-llama31-8b", "ghcr.io/kvoffload/vllm-lmcache:0.33.0-0.5.6"),
    ("native-llama31-8b", "vllm/vllm-openai:v0.33.0")])
def test_each_033_example_is_its_backends_example_on_the_033_image(rendered, base, image):
    """Its KVOffloadServe differs in spec.engine.image (and vllmVersion) alone; its pod's containers have the
    captured pod's names, mounts and limits, so the backend's capture (of the default pair's pod) fits it
    container for container; gpu_pod runs each on the 0.33.0 pair's stand-in image."""
    new, old = (yaml.safe_load(PODS[n].read_text()) for n in (f"{base}-vllm-0.33.0", base))
    assert new["spec"]["engine"].pop("image") == image
    old["spec"]["engine"].pop("image", None)  # the workstation example takes the default image
    for key, version in (("vllmVersion", "0.33.0"), ("lmcacheVersion", "0.5.6")):  # declared or not: the pair's
        assert new["spec"]["engine"].pop(key, version) == version
        old["spec"]["engine"].pop(key, None)
    assert new == old
    a, b = rendered[base], rendered[f"{base}-vllm-0.33.0"]
    for x, y in zip(pod(a).containers, pod(b).containers, strict=True):
        # LMCache 0.5.6's server needs 2 GiB more beside its L1 (engine/images.py SERVER_BASELINE_FLOOR)
        more = 2 * 2**30 if y.name == "lmcache-server" else 0
        if base == "native-llama31-8b" and y.name == "vllm":
            # vLLM 0.33.0 keeps the 40 GiB tier in one /dev/shm region, 0.26.0 pins 64 GiB of power-of-two tensors
            # (backends/vllm_native.py): limits 52.8 GiB against 79.2 GiB
            assert (x.memory_limit, y.memory_limit) == (85_040_562_176, 56_694_407_168)
            more = y.memory_limit - x.memory_limit
        assert ((y.name, y.mounts, y.memory_limit, y.security)
                == (x.name, x.mounts, x.memory_limit + more, x.security)), x.name
        if base == "workstation-llama31-8b":  # the in-process connector: the image alone differs
            assert dataclasses.replace(y, image=x.image) == x, x.name
    # the exporter and the disk-tier init container run the operator image; everything else the serving image
    assert {c.image for c in pod(b).containers if c.name not in ("exporter", "prepare-disk-tier")} == {image}
    assert {gpu_pod.stand_in(c.image) for c in pod(b).containers if c.image == image} == {"serving-0.33.0-0.5.6"}


def test_the_bf16_example_is_the_workstation_example_with_a_bf16_cache(rendered):
    """dev.sh plan-layerwise (issue 21): the KVOffloadServe differs in the KV dtype and the context alone; the pod's
    containers are the workstation pod's, so the lmcache capture fits each, and vLLM gets a bf16 cache."""
    new, old = (yaml.safe_load(PODS[n].read_text()) for n in ("workstation-llama31-8b-bf16", "workstation-llama31-8b"))
    assert (new["spec"]["model"].pop("kvDtype"), old["spec"]["model"].pop("kvDtype")) == ("bf16", "fp8")
    assert (new["spec"]["engine"].pop("maxModelLen"), old["spec"]["engine"].pop("maxModelLen")) == (40960, 65536)
    assert new == old
    a, b = (pod(rendered[n]) for n in ("workstation-llama31-8b", "workstation-llama31-8b-bf16"))
    assert [c.name for c in a.containers] == [c.name for c in b.containers]
    assert gm.flag(b.container("main").argv, "--kv-cache-dtype") == "bfloat16"
    gpu_pod.Pod(b, gpu_pod.load_specs(str(OCI / "lmcache")), name="bf16-0", tag="t", work="/w/pod", logdir="/tmp",
                namespaces=dict(gpu_pod.NS_FILES), python="/opt/py/bin/python3", crun="crun", host=GPU_HOST,
                dry_run=True).prepare()  # every container of it has its captured spec (a missing one would raise)


def test_each_serving_image_runs_on_its_own_stand_in(tmp_path, rendered, monkeypatch):
    """The host's pair (gpu_pod.HOST_PAIR) on the host's torch (serving/), another pair, the operator's default
    included, on its carried torch (serving-<tag>/, first on PYTHONPATH); a pod whose stand-in dev.sh has not
    installed is refused before any container starts."""
    assert gpu_pod.stand_in(f"{images.SERVING_REPOSITORY}:{gpu_pod.HOST_PAIR}") == "serving"
    assert gpu_pod.stand_in(images.DEFAULT_IMAGE) == f"serving-{images.DEFAULT_PAIR.vllm}-{images.DEFAULT_PAIR.lmcache}"
    assert gpu_pod.stand_in("ghcr.io/kvoffload/vllm-lmcache:0.33.0-0.5.6") == "serving-0.33.0-0.5.6"
    assert gpu_pod.stand_in("ghcr.io/kvoffload/kvoffload:0.1.0") == "operator"
    env = gpu_pod.image_env("ghcr.io/kvoffload/vllm-lmcache:0.33.0-0.5.6", "/opt/py/bin/python3")
    assert env["PYTHONPATH"] == "/opt/kvimage/serving-0.33.0-0.5.6/site"
    assert env["PATH"].startswith("/opt/kvimage/serving-0.33.0-0.5.6/bin:/opt/py/bin:")
    r = rendered["workstation-llama31-8b-vllm-0.33.0"]
    run = gm.containerize(r, str(tmp_path / "pod"), str(tmp_path / "node-dir"), model_config={"a": 1})
    p = gpu_pod.Pod(run, gpu_pod.load_specs(str(OCI / "lmcache")), name=f"{r.name}-0", tag="t",
                    work=str(tmp_path / "pod"),
                    logdir=str(tmp_path), namespaces=dict(gpu_pod.NS_FILES), python="/opt/py/bin/python3", crun="crun",
                    host=GPU_HOST, dry_run=True)
    p.prepare()  # the lmcache capture, rewritten for each container of the 0.33 pod (a mount it lacks would raise)
    env = dict(e.split("=", 1) for e in p.box("vllm").spec["process"]["env"])
    assert env["PYTHONPATH"] == "/opt/kvimage/serving-0.33.0-0.5.6/site"
    monkeypatch.setattr(gpu_pod, "IMAGES", str(tmp_path / "kvimage"))
    (tmp_path / "kvimage" / "serving").mkdir(parents=True)
    (tmp_path / "kvimage" / "operator").mkdir()
    p.dry_run = False
    with pytest.raises(SystemExit, match="no stand-in image .*/serving-0.33.0-0.5.6: run dev.sh install"):
        p.prepare()
