"""The product as a user installs it, on a real node: `make demo` from a fresh clone, the operator
in-cluster, and pods that a real kubelet + containerd + runc run (kvtest.node, the `demo` fixture).

Nothing leaves the machine: the node's addresses live on the bridge cni0 (198.18.0.0/24 pods,
198.19.0.0/24 Services) and the guard's drop counters stay 0 (checked last, in this module's end).
"""

from __future__ import annotations

import ipaddress
import json
import time
import urllib.request

import pytest
import yaml

from kvtest import ROOT, condition, listening_sockets, node

pytestmark = pytest.mark.cluster

OPERATOR_IMAGE = "ghcr.io/kvoffload/kvoffload:0.1.0"  # the chart's image, built by kvtest.images, loaded by the demo
RELEASE_NS = "kvoffload-system"
HARDENED = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}}


def run_pod(demo, ns: str, name: str, script: str, memory: str = "64Mi", volumes=(), mounts=(),
            image: str = OPERATOR_IMAGE) -> dict:
    """A one-shot hardened pod on the real node running `python3 -c script`; its final object."""
    demo.client.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
                        "spec": {**node.PLACEMENT, "restartPolicy": "Never", "automountServiceAccountToken": False,
                                 "securityContext": {"fsGroup": 1000},
                                 "containers": [{"name": "c", "image": image, "imagePullPolicy": "Never",
                                                 "command": ["python3", "-u", "-c", script],
                                                 "securityContext": HARDENED,
                                                 "resources": {"requests": {"cpu": "10m", "memory": memory},
                                                               "limits": {"memory": memory}},
                                                 "volumeMounts": list(mounts)}],
                                 "volumes": list(volumes)}})

    def done():
        p = demo.client.get("pods", name, ns)
        return p if p["status"].get("phase") in ("Succeeded", "Failed") else None
    return demo.wait_until(done, timeout=120, message=f"pod {name} finished")


def logs(demo, ns: str, name: str) -> str:
    """Through the API server's proxy to the kubelet (its serving certificate, the bridge address)."""
    return demo.client.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}/log")


# ---------------------------------------------------------------------------------------- the demo
def test_make_demo_succeeds_from_a_fresh_clone(demo):
    if demo.demo_rc is None:
        pytest.skip("KVO_DEMO_CLUSTER_DIR: a running demo reused, not run here")
    tail = "\n".join(demo.demo_log.read_text(errors="replace").splitlines()[-60:])
    assert demo.demo_rc == 0, f"make demo exited {demo.demo_rc}; its output ends:\n{tail}"
    kvs = {o["metadata"]["name"]: o for o in demo.client.list("kvs", "kvoffload-demo")}
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        name = yaml.safe_load(path.read_text())["metadata"]["name"]
        if "as-seen-in-the-field" in name:
            assert condition(kvs[name], "ConfigValid")["status"] == "False"
        else:
            assert condition(kvs[name], "Ready")["status"] == "True", (name, kvs[name]["status"].get("conditions"))
    tp8 = demo.client.list("pods", "kvoffload-demo", labels={"kvoffload.io/serve": "tp8-llama33-70b"})
    assert tp8 and tp8[0]["status"]["phase"] == "Running" and tp8[0]["spec"]["nodeName"].startswith("gpu-node-")


def test_the_operator_runs_in_cluster_from_its_chart(demo):
    (pod,) = demo.client.list("pods", RELEASE_NS, labels={"app.kubernetes.io/component": "operator"})
    assert pod["spec"]["nodeName"] == node.NAME
    assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network(node.POD_CIDR)
    assert condition(pod, "Ready")["status"] == "True"
    (c,) = pod["spec"]["containers"]
    assert c["image"] == OPERATOR_IMAGE and c["imagePullPolicy"] == "Never"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True and c["securityContext"]["runAsUser"] == 65532
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    (cs,) = pod["status"]["containerStatuses"]
    assert cs["ready"] and cs["restartCount"] == 0, cs  # the liveness probe passes on the pod IP
    sa = pod["spec"]["serviceAccountName"]
    assert demo.client.exists("serviceaccount", sa, RELEASE_NS)
    # It reconciles with that ServiceAccount through the `kubernetes` Service (in-cluster config):
    # the Lease it holds and the children it made say so.
    held = [lease for lease in demo.client.list("leases", RELEASE_NS)
            if (lease["spec"].get("holderIdentity") or "").find(pod["metadata"]["name"]) >= 0]
    assert held, [lease["spec"] for lease in demo.client.list("leases", RELEASE_NS)]
    assert demo.client.list("statefulsets", "kvoffload-demo", labels={"kvoffload.io/serve": "cpu-tier-qwen25-7b"})
    svc = demo.client.get("services", "kubernetes", "default")
    assert ipaddress.ip_address(svc["spec"]["clusterIP"]) in ipaddress.ip_network(node.SERVICE_CIDR)
    # Its own metrics on the pod IP (operator.metricsPort), as the chart's PodMonitor scrapes them.
    (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == "metrics"]
    body = urllib.request.urlopen(f"http://{pod['status']['podIP']}:{port}/metrics", timeout=10).read().decode()
    updated = [line for line in body.splitlines()
               if line.startswith('kvoffload_operator_reconciles_total{outcome="updated"}')]
    assert updated and float(updated[0].split()[-1]) >= 1, body[:2000]
    assert "kvoffload_operator_dead_tasks 0.0" in body


# ---------------------------------------------------------------------------------------- the node
def test_the_node_stays_on_the_machine(demo):
    n = demo.client.get("nodes", node.NAME)
    assert [a["address"] for a in n["status"]["addresses"] if a["type"] == "InternalIP"] == [node.BRIDGE_IP]
    assert {"key": "kvoffload.io/real-node", "value": "true", "effect": "NoSchedule"} in n["spec"]["taints"]
    # No GPU: the stand-in extended resource instead of nvidia.com/gpu (docs/cluster.md).
    assert n["status"]["allocatable"][node.GPU_STAND_IN] == node.STAND_IN_GPUS
    assert "nvidia.com/gpu" not in n["status"]["allocatable"]
    st = demo.cluster.state()
    pids = [r["pid"] for r in st["processes"].values()]
    allowed = {"127.0.0.1", node.BRIDGE_IP}
    listeners = listening_sockets(pids)
    assert listeners and {a for a, _, _ in listeners} <= allowed, listeners
    # kubelet's sysctl changes were put back once the node was Ready.
    assert node.read_sysctls() == st["host"]["sysctls"]
    assert node.guard_counters(), "the guard table is in place"


def test_a_hardened_pod_gets_what_its_spec_says(demo, node_ns):
    script = """
import os, errno
s = dict(l.split(':', 1) for l in open('/proc/self/status'))
print('uid', os.getuid()); print('gid', os.getgid()); print('groups', *sorted(os.getgroups()))
print('CapEff', s['CapEff'].strip(), 'NoNewPrivs', s['NoNewPrivs'].strip(), 'Seccomp', s['Seccomp'].strip())
try:
    open('/root-write', 'w')
except OSError as e:
    print('rootfs', errno.errorcode[e.errno])
n = 0
try:
    with open('/scratch/fill', 'wb') as f:
        while n < 80 << 20:
            f.write(b'x' * (1 << 20)); f.flush(); n += 1 << 20
except OSError as e:
    print('scratch', errno.errorcode[e.errno])
print('written', n >> 20)
st = os.statvfs('/scratch'); print('scratch-size', st.f_blocks * st.f_frsize >> 20)
print('limit', open('/sys/fs/cgroup/memory/memory.limit_in_bytes').read().strip())
"""
    vol = [{"name": "scratch", "emptyDir": {"medium": "Memory", "sizeLimit": "32Mi"}}]
    pod = run_pod(demo, node_ns, "hardened", script, memory="128Mi", volumes=vol,
                  mounts=[{"name": "scratch", "mountPath": "/scratch"}])
    out = logs(demo, node_ns, "hardened")
    assert pod["status"]["phase"] == "Succeeded", out
    fields = {ln.split()[0]: ln.split()[1:] for ln in out.splitlines() if ln.strip()}
    assert fields["uid"] == ["1000"] and fields["gid"] == ["1000"] and "1000" in fields["groups"], out  # fsGroup
    assert fields["CapEff"] == ["0000000000000000", "NoNewPrivs", "1", "Seccomp", "2"], out
    assert fields["rootfs"] == ["EROFS"], out
    # kubelet mounts a memory-backed emptyDir as a tmpfs of its sizeLimit: the write stops there.
    assert fields["scratch"] == ["ENOSPC"] and fields["written"] == ["32"] and fields["scratch-size"] == ["32"], out
    assert fields["limit"] == [str(128 << 20)], out


def test_over_its_memory_limit_a_container_is_oom_killed(demo, node_ns):
    # It grows slowly, after a second: the runc shim watches the cgroup's OOM events from just after the
    # start, and a process killed before that is reported as a plain exit 137 ("Error").
    script = "import time\ntime.sleep(2)\nb = []\nwhile True:\n    b.append(bytearray(1 << 20)); time.sleep(0.005)"
    pod = run_pod(demo, node_ns, "hog", script, memory="64Mi")
    (cs,) = pod["status"]["containerStatuses"]
    assert pod["status"]["phase"] == "Failed"
    assert cs["state"]["terminated"]["reason"] == "OOMKilled" and cs["state"]["terminated"]["exitCode"] == 137, cs


def test_pods_reach_the_api_server_through_the_kubernetes_service(demo, node_ns):
    demo.client.create({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader"}}, node_ns)
    script = """
import json, os, ssl, urllib.request
d = '/var/run/secrets/kubernetes.io/serviceaccount'
ctx = ssl.create_default_context(cafile=d + '/ca.crt')
host = os.environ['KUBERNETES_SERVICE_HOST'] + ':' + os.environ['KUBERNETES_SERVICE_PORT']
for path in ('/api/v1/namespaces/%s/pods' % open(d + '/namespace').read(), '/api/v1/nodes'):
    token = open(d + '/token').read()
    req = urllib.request.Request('https://' + host + path, headers={'Authorization': 'Bearer ' + token})
    try:
        print(path.split('/')[-1], urllib.request.urlopen(req, context=ctx).status)
    except urllib.error.HTTPError as e:
        print(path.split('/')[-1], e.code)
print('host', host)
"""
    demo.client.create({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "pods"},
                        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]}, node_ns)
    demo.client.create({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                        "metadata": {"name": "pods"}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                                                                  "kind": "Role", "name": "pods"},
                        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": node_ns}]}, node_ns)
    demo.client.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "api", "namespace": node_ns},
                        "spec": {**node.PLACEMENT, "restartPolicy": "Never", "serviceAccountName": "reader",
                                 "containers": [{"name": "c", "image": OPERATOR_IMAGE, "imagePullPolicy": "Never",
                                                 "command": ["python3", "-u", "-c", script],
                                                 "securityContext": {**HARDENED, "runAsUser": 65532,
                                                                     "runAsGroup": 65532},
                                                 "resources": {"limits": {"memory": "64Mi"}}}]}})
    demo.wait_until(lambda: demo.client.get("pods", "api", node_ns)["status"].get("phase") == "Succeeded",
                    timeout=120, message="the API client pod finished")
    out = logs(demo, node_ns, "api")
    assert "pods 200" in out and "nodes 403" in out, out  # RBAC says yes to one, no to the other
    assert out.split("host ")[1].startswith(node.KUBERNETES_SERVICE_IP), out


def test_zz_the_guard_dropped_nothing(demo):
    """Last in the module: after every pod above, nothing was headed off the machine."""
    counters = node.guard_counters()
    assert set(counters) >= {"bridge-to-elsewhere", "guarded-source-out", "guarded-destination-out"}, counters
    assert all(v == 0 for v in counters.values()), (json.dumps(counters), node.guard_log()[-20:])


def test_the_oci_capture_tool_saves_what_runc_ran(demo, tmp_path):
    """benchmarks/gpu/oci/capture.py on the operator's pod: its rendered securityContext and limits as OCI."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("capture", ROOT / "benchmarks" / "gpu" / "oci" / "capture.py")
    capture = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(capture)
    (pod,) = demo.client.list("pods", RELEASE_NS, labels={"app.kubernetes.io/component": "operator"})
    paths = capture.capture(demo.cluster, RELEASE_NS, pod["metadata"]["name"], tmp_path)
    assert sorted(p.name for p in paths) == ["operator.json", "sandbox.json"]
    oci = json.loads((tmp_path / pod["metadata"]["name"] / "operator.json").read_text())
    assert oci["process"]["user"]["uid"] == 65532 and oci["process"]["noNewPrivileges"] is True
    assert oci["root"]["readonly"] is True and not oci["process"]["capabilities"].get("effective")
    limit = pod["spec"]["containers"][0]["resources"]["limits"]["memory"]
    assert oci["linux"]["resources"]["memory"]["limit"] == {"512Mi": 512 << 20}.get(limit, -1), limit
    assert {"/tmp", "/etc/kvoffload"} <= {m["destination"] for m in oci["mounts"]}


def test_a_rendered_pods_capture_is_the_committed_one(demo, tmp_path):
    """capture.py --rendered on the real node: the workstation example's pod, fitted to the node, as kubelet +
    containerd create it, is what benchmarks/gpu/oci/lmcache/ holds (the specs the GPU runs use): the same
    containers with the same users, capabilities, read-only roots, mounts and options, seccomp, namespaces
    and cgroup sizes. A rendering that changes these needs a new capture (benchmarks/gpu/oci/README.md)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("capture", ROOT / "benchmarks" / "gpu" / "oci" / "capture.py")
    capture = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(capture)
    capture.capture_rendered(demo.cluster, str(ROOT / "examples" / "workstation-llama31-8b.yaml"), "lmcache", tmp_path)

    def shape(s: dict) -> dict:  # oomScoreAdj left out: it follows this machine's memory (checked in the unit tests)
        p, lx = s["process"], s["linux"]
        return {"user": p["user"], "capabilities": p.get("capabilities"), "noNewPrivileges": p.get("noNewPrivileges"),
                "cwd": p.get("cwd"), "rlimits": p.get("rlimits"), "readonly": s["root"].get("readonly", False),
                "mounts": sorted((m["destination"], m["type"], tuple(m.get("options") or ())) for m in s["mounts"]),
                "resources": lx.get("resources"), "seccomp": lx.get("seccomp"), "masked": lx.get("maskedPaths"),
                "readonlyPaths": lx.get("readonlyPaths"), "namespaces": sorted(n["type"] for n in lx["namespaces"])}

    def specs(d) -> dict:
        return {p.stem: shape(json.loads(p.read_text())) for p in d.glob("*.json") if p.stem != "changes"}
    got, committed = specs(tmp_path / "lmcache"), specs(ROOT / "benchmarks" / "gpu" / "oci" / "lmcache")
    assert sorted(got) == sorted(committed) == ["exporter", "prepare-disk-tier", "report-engine-versions", "sandbox",
                                                "vllm"]
    for name in committed:
        assert got[name] == committed[name], name
    assert not demo.client.get_or_none("statefulsets", "workstation-llama31-8b", capture.NAMESPACE)  # deleted again


# ---------------------------------------------------------------------------------------- lifecycle
def serving_pods(demo) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in demo.client.list("pods", "kvoffload-demo")}


def settled(demo) -> dict[str, str]:
    """The serving pods once every StatefulSet has rolled out (no rollout left over from an earlier test)."""
    def done():
        for sts in demo.client.list("statefulsets", "kvoffload-demo"):
            if OPERATOR_IMAGE not in {c["image"] for c in sts["spec"]["template"]["spec"]["containers"]}:
                return None  # the running operator has not re-rendered it yet (after an upgrade: the bug above)
            st, want = sts["status"], sts["spec"]["replicas"]
            if st.get("currentRevision") != st.get("updateRevision") or st.get("readyReplicas") != want \
                    or st.get("updatedReplicas") != want \
                    or st.get("observedGeneration") != sts["metadata"]["generation"]:
                return None
        pods = demo.client.list("pods", "kvoffload-demo")
        # Every pod the workloads ask for (the examples' StatefulSets, the router's and PerNode's node-server
        # Deployments), and no other: a count that follows the examples instead of a constant.
        want = sum(w["spec"].get("replicas", 1) for kind in ("statefulsets", "deployments")
                   for w in demo.client.list(kind, "kvoffload-demo"))
        return (serving_pods(demo)
                if len(pods) == want and not any(p["metadata"].get("deletionTimestamp") for p in pods) else None)
    return demo.wait_until(done, timeout=180, interval=1, message="every serving StatefulSet rolled out")


def operator_ready(demo, image: str) -> dict | None:
    pods = [p for p in demo.client.list("pods", RELEASE_NS, labels={"app.kubernetes.io/component": "operator"})
            if not p["metadata"].get("deletionTimestamp")]
    ok = len(pods) == 1 and pods[0]["spec"]["containers"][0]["image"] == image and \
        condition(pods[0], "Ready").get("status") == "True"
    return pods[0] if ok else None


def steady(demo, before: dict[str, str], seconds: float) -> None:
    """The serving pods stay the same pods (same UIDs) for `seconds` while the new operator reconciles."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert serving_pods(demo) == before
        time.sleep(1)


def test_helm_upgrade_to_a_new_operator_image_restarts_no_serving_pod(demo):
    before = settled(demo)
    assert len(before) == 10, before  # with the PerNode example's serving and node-server pods
    # A new operator image: the same content under a new tag, made in the node's containerd.
    node.ctr(demo.cluster, "images", "tag", "--force", OPERATOR_IMAGE, OPERATOR_IMAGE + "-upgrade")
    chart = (demo.demo_dir or ROOT) / "charts" / "kvoffload-operator"
    demo.helm("upgrade", "kvoffload", str(chart), "-n", RELEASE_NS, "--reuse-values",
              "--set", "image.tag=0.1.0-upgrade", "--wait", "--timeout", "3m")
    try:
        new = demo.wait_until(lambda: operator_ready(demo, OPERATOR_IMAGE + "-upgrade"), timeout=180,
                              message="the upgraded operator pod Ready")
        demo.wait_until(lambda: any(new["metadata"]["name"] in (lease["spec"].get("holderIdentity") or "")
                                    for lease in demo.client.list("leases", RELEASE_NS)),
                        timeout=120, message="the upgraded operator holds the Lease")
        steady(demo, before, 30)  # > its first full reconcile of the six examples
        for kvs in demo.client.list("kvs", "kvoffload-demo"):
            sts = demo.client.get_or_none("statefulsets", kvs["metadata"]["name"], "kvoffload-demo")
            if sts:
                images = {c["image"] for c in sts["spec"]["template"]["spec"]["containers"]}
                assert OPERATOR_IMAGE in images, images  # the exporter kept the image it runs
    finally:
        demo.helm("upgrade", "kvoffload", str(chart), "-n", RELEASE_NS, "--reuse-values",
                  "--set", "image.tag=0.1.0", "--wait", "--timeout", "3m")
        demo.wait_until(lambda: operator_ready(demo, OPERATOR_IMAGE), timeout=180, message="operator back on 0.1.0")


def test_helm_uninstall_keeps_the_crd_the_resources_and_their_pods(demo):
    before = settled(demo)
    values = demo.helm("get", "values", "kvoffload", "-n", RELEASE_NS, "-o", "yaml").stdout
    chart = (demo.demo_dir or ROOT) / "charts" / "kvoffload-operator"
    demo.helm("uninstall", "kvoffload", "-n", RELEASE_NS, "--wait", "--timeout", "3m")
    try:
        demo.wait_until(lambda: not demo.client.list("pods", RELEASE_NS), timeout=120, message="operator pod gone")
        assert demo.client.exists("customresourcedefinition", "kvoffloadserves.kvoffload.io")
        assert len(demo.client.list("kvs", "kvoffload-demo")) == 7
        steady(demo, before, 10)
    finally:
        demo.helm("install", "kvoffload", str(chart), "-n", RELEASE_NS, "-f", "-", "--wait", "--timeout", "3m",
                  input=values)
        demo.wait_until(lambda: operator_ready(demo, OPERATOR_IMAGE), timeout=180, message="operator reinstalled")


def lease_holder(demo) -> str:
    leases = [lease for lease in demo.client.list("leases", RELEASE_NS) if lease["spec"].get("holderIdentity")]
    return leases[0]["spec"]["holderIdentity"] if leases else ""


def test_ha_killing_the_leader_hands_over_and_a_drain_respects_the_budget(demo):
    """The chart's HA values (2 replicas, leader election, PodDisruptionBudget) on the real node."""
    chart = (demo.demo_dir or ROOT) / "charts" / "kvoffload-operator"
    demo.helm("upgrade", "kvoffload", str(chart), "-n", RELEASE_NS, "--reuse-values",
              "-f", str(chart / "ci" / "leader-election-values.yaml"), "--wait", "--timeout", "3m")
    try:
        def two_ready():
            pods = [p for p in demo.client.list("pods", RELEASE_NS, labels={"app.kubernetes.io/component": "operator"})
                    if condition(p, "Ready").get("status") == "True" and not p["metadata"].get("deletionTimestamp")]
            return pods if len(pods) == 2 else None
        pods = demo.wait_until(two_ready, timeout=180, message="two operator replicas Ready")
        names = {p["metadata"]["name"] for p in pods}
        leader = demo.wait_until(lambda: next((n for n in names if n in lease_holder(demo)), None), timeout=120,
                                 message="one replica holds the Lease")
        standby = (names - {leader}).pop()
        # The node cordoned first: the Deployment's replacement for the killed leader stays Pending, so the
        # standby is the only replica that can take the Lease (else the two race for it once it is free).
        demo.kubectl("cordon", node.NAME)
        # Killed, not stopped: no graceful release of the Lease; the standby takes it when it expires.
        demo.client.request("DELETE", f"/api/v1/namespaces/{RELEASE_NS}/pods/{leader}",
                            body={"gracePeriodSeconds": 0})

        def standby_holds() -> str:
            holder = lease_holder(demo)
            assert standby in holder, f"the Lease is held by {holder!r}"  # wait_until reports the last one
            return holder
        demo.wait_until(standby_holds, timeout=90, message=f"the standby {standby} to take the Lease from {leader}")
        demo.kubectl("uncordon", node.NAME)
        two_ready_again = demo.wait_until(two_ready, timeout=180, message="the Deployment back at two")
        # A drain of the node: the budget lets one replica go, not both (the replacement cannot schedule
        # on the cordoned node, so the second eviction must wait: the drain times out instead).
        cp = demo.kubectl("drain", node.NAME, "--ignore-daemonsets", "--delete-emptydir-data",
                          "--pod-selector=app.kubernetes.io/component=operator", "--timeout=40s", check=False)
        assert cp.returncode != 0, cp.stdout
        assert "disruption budget" in (cp.stdout + cp.stderr), cp.stderr[-2000:]
        left = [p for p in demo.client.list("pods", RELEASE_NS, labels={"app.kubernetes.io/component": "operator"})
                if p["spec"].get("nodeName") == node.NAME and condition(p, "Ready").get("status") == "True"
                and not p["metadata"].get("deletionTimestamp")]
        assert len(left) == 1 and len(two_ready_again) == 2, left
    finally:
        demo.kubectl("uncordon", node.NAME, check=False)
        demo.helm("upgrade", "kvoffload", str(chart), "-n", RELEASE_NS, "--reuse-values",
                  "--set", "operator.replicas=1", "--wait", "--timeout", "3m")
