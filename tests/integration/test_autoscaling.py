"""spec.autoscaling on the real controllers: kube-controller-manager's HPA controller scales a KVOffloadServe
through its scale subresource, on external metrics that KEDA v2.21.0 (operator + metrics API server, built from
its Go module) reads from a real Prometheus, which scrapes stand-in vLLM engines (one per Running kwok pod) whose
queue the test drives. Also: a server-side re-apply of the same manifest leaves the autoscaler's replica count
alone; scale to zero and the wake-up; the plain HorizontalPodAutoscaler admitted by the API server; the CEL
rules. Timings go to docs/benchmarks.md (printed as `autoscaling timing: ...`)."""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvoffload.cli import why
from kvoffload.rendering import autoscaling
from kvtest import ApiError, OperatorProcess, background, condition, sentinel
from kvtest.exporter import FakeVllm
from kvtest.keda import SCALED_OBJECT_CRD, Keda, built
from kvtest.prometheus import PROMETHEUS, Prometheus
from kvtest.standin_engines import StandInEngines

pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(not PROMETHEUS.exists(),
                                 reason="/usr/bin/prometheus is absent (apt-get install prometheus)")]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "autoscaling" / "llama31-8b.yaml"
UP_PERIOD, DOWN_WINDOW = 5, 20  # short windows, through the spec
HPA_SYNC = 15  # kube-controller-manager's --horizontal-pod-autoscaler-sync-period (the default; kvtest sets none)
KEDA_POLL = autoscaling.KEDA_POLLING_SECONDS  # the ScaledObject's pollingInterval: KEDA's 0 <-> 1 decisions


def manifest(namespace: str, **autoscaling: Any) -> dict[str, Any]:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["namespace"] = namespace
    doc["spec"]["autoscaling"].update({"scaleUpPeriodSeconds": UP_PERIOD, "scaleDownWindowSeconds": DOWN_WINDOW,
                                       **autoscaling})
    return doc


def server_side_apply(cluster, doc: dict[str, Any], path: Path) -> None:
    path.write_text(yaml.safe_dump(doc))
    cluster.kubectl("apply", "--server-side", "--field-manager=gitops", "-f", str(path))


def replicas(cluster, namespace: str, name: str) -> int:
    return cluster.client.get("kvoffloadserves", name, namespace)["spec"].get("replicas", -1)


def ready_pods(cluster, namespace: str, name: str) -> int:
    sts = cluster.client.get_or_none("statefulsets", name, namespace) or {}
    return (sts.get("status") or {}).get("readyReplicas") or 0


@pytest.fixture(scope="module")
def keda(cluster, crd_installed, tmp_path_factory) -> Iterator[Keda]:
    bin_dir = built()
    if bin_dir is None:
        why = ("KEDA is not built (make keda: tests/autoscaling/build-keda.sh; "
               f"make test's background build: {background.log('keda')})")
        if os.environ.get("KVO_REQUIRE_KEDA"):  # make test: the KEDA tests must run
            pytest.fail(why + " (KVO_REQUIRE_KEDA is set)", pytrace=False)
        pytest.skip(why)
    k = Keda(cluster.cluster, tmp_path_factory.mktemp("keda"), bin_dir)
    try:
        yield k.start()
    finally:
        k.stop()


@pytest.fixture
def stack(cluster, namespace, keda, tmp_path) -> Iterator[tuple[StandInEngines, FakeVllm, OperatorProcess]]:
    """Prometheus scraping the stand-in engines of `llama31-8b-autoscaled` and a stand-in gateway, and the
    operator with autoscaler auto, which picks KEDA (its CRDs are served and prometheusAddress is set)."""
    name = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
    targets = tmp_path / "engines.json"
    engines = StandInEngines(cluster.client, namespace, name, targets)
    # The gateway's series carry the namespace they are for: a wakeQuery may select only its own (api/promql.py).
    gateway = FakeVllm(f'standin_gateway_pending_requests{{namespace="{namespace}",model="{name}"}} 0\n')
    prom = Prometheus(tmp_path, [
        {"job_name": "engines", "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}]},
        {"job_name": "gateway", "static_configs": [{"targets": [gateway.url.split("//", 1)[1].split("/", 1)[0]]}]}])
    sentinel(cluster.client, namespace)
    op = OperatorProcess(cluster.env, [namespace], {"resyncSeconds": 20, "autoscaler": "auto",
                                                    "prometheusAddress": prom.url, "probeExporters": False},
                         log_path=tmp_path / "operator.log")
    try:
        op.wait_started()
        assert "autoscaler auto: keda" in op.output()
        yield engines, gateway, op
    finally:
        op.stop()
        engines.close()
        prom.stop()
        gateway.close()


def _timing(what: str, seconds: float) -> None:
    print(f"autoscaling timing: {what} {seconds:.1f} s", flush=True)


def test_without_kedas_crd_the_operator_runs_on_and_refuses_autoscaling_naming_the_field(cluster, namespace,
                                                                                          crd_installed, tmp_path):
    """Autoscaler keda on a cluster without KEDA (first in this file: the `keda` fixture installs its CRDs and
    removes them after): the operator starts, serves what needs no ScaledObject, and refuses spec.autoscaling."""
    assert not cluster.client.exists("crd", SCALED_OBJECT_CRD), "KEDA's CRDs are left from an earlier run"
    sentinel(cluster.client, namespace)
    op = OperatorProcess(cluster.env, [namespace], {"resyncSeconds": 20, "autoscaler": "keda",
                                                    "prometheusAddress": "http://127.0.0.1:9", "probeExporters": False},
                         log_path=tmp_path / "operator.log")
    try:
        op.wait_started()
        scaled = manifest(namespace)
        plain = copy.deepcopy(scaled)
        plain["metadata"]["name"] = "plain"
        del plain["spec"]["autoscaling"]
        for doc in (scaled, plain):
            cluster.client.create(doc, namespace)

        def valid(name: str) -> dict[str, Any]:
            return condition(cluster.client.get("kvs", name, namespace), "ConfigValid")

        refused = cluster.wait_until(lambda: valid(scaled["metadata"]["name"]).get("status") == "False" and valid(
            scaled["metadata"]["name"]), timeout=60, message="spec.autoscaling refused")
        assert "spec.autoscaling" in refused["message"] and "install KEDA" in refused["message"], refused
        cluster.wait_until(lambda: valid("plain").get("status") == "True", timeout=60, message="the plain one valid")
        assert cluster.client.exists("statefulsets", "plain", namespace)
        assert not cluster.client.exists("statefulsets", scaled["metadata"]["name"], namespace)  # nothing half-applied
        assert op.proc.poll() is None and "serves no keda.sh/v1alpha1 ScaledObject" in op.output()
    finally:
        op.stop()


def test_keda_scales_up_under_load_and_down_after_it(cluster, namespace, stack, tmp_path):
    engines, _, op = stack
    doc = manifest(namespace)
    name = doc["metadata"]["name"]
    server_side_apply(cluster, doc, tmp_path / "serve.yaml")
    c = cluster.client
    cluster.wait_until(lambda: c.get_or_none("horizontalpodautoscalers", f"keda-hpa-{name}", namespace), timeout=60,
                       message="KEDA's HorizontalPodAutoscaler")
    cluster.wait_until(lambda: ready_pods(cluster, namespace, name) == 1, timeout=60, message="1 replica ready")
    ready = condition(c.get("kvs", name, namespace), "AutoscalingReady")
    assert (ready["status"], ready["reason"]) == ("True", "KedaServed"), ready

    engines.waiting = 14  # 14 queued / 4 per replica -> 4 replicas (max 4), at most doubling per 5 s
    t0 = time.monotonic()
    cluster.wait_until(lambda: replicas(cluster, namespace, name) == 4, timeout=120, interval=0.5,
                       message=f"scaled to 4; operator log tail:\n{op.output()[-1500:]}")
    up = time.monotonic() - t0
    _timing("scale-up 1 -> 4 replicas (spec.replicas)", up)
    # Two doublings 1 -> 2 -> 4, one scaleUpPeriodSeconds apart, each at an HPA sync (15 s) after KEDA's answer.
    assert up <= 2 * UP_PERIOD + 2 * HPA_SYNC + 20, f"scale-up took {up:.0f} s"
    cluster.wait_until(lambda: ready_pods(cluster, namespace, name) == 4, timeout=60, message="4 replicas ready")
    _timing("scale-up 1 -> 4 replicas ready", time.monotonic() - t0)

    # The status says what the autoscaler wants and why.
    def autoscaling() -> dict[str, Any]:
        return (c.get("kvoffloadserves", name, namespace).get("status") or {}).get("autoscaling") or {}

    cluster.wait_until(lambda: (autoscaling().get("currentReplicas"), autoscaling().get("desiredReplicas")) == (4, 4),
                       timeout=90,
                       message="status.autoscaling at 4 replicas")
    st = autoscaling()
    assert st["autoscaler"] == "keda" and st["horizontalPodAutoscaler"] == f"keda-hpa-{name}"
    waiting = next(m for m in st["metrics"] if m["target"] == "waitingRequestsPerReplica")
    assert float(waiting["current"]) == pytest.approx(14 / 4, abs=0.01) and waiting["want"] == "4"
    assert "wants 4 replicas" in st["message"]
    text = why.explain(c.get("kvoffloadserves", name, namespace), None, [], [], datetime.now(timezone.utc))
    assert "wants 4 replicas" in text, text

    # GitOps: the same manifest (no spec.replicas) applied again server-side (Flux, Argo CD's ServerSideApply) and
    # client-side (Argo CD's default sync, kubectl's three-way merge) leaves the count alone.
    server_side_apply(cluster, doc, tmp_path / "serve.yaml")
    cluster.kubectl("apply", "-f", str(tmp_path / "serve.yaml"))  # kubectl under test: client-side apply
    time.sleep(3)  # deliberate: a count that stays has no event to wait for; give a wrong reset time to show
    assert replicas(cluster, namespace, name) == 4
    managers = {f["manager"]: f for f in c.get("kvoffloadserves", name, namespace)["metadata"]["managedFields"]}
    assert "replicas" not in json.dumps(managers["gitops"].get("fieldsV1", {}).get("f:spec", {}))
    # A manifest that does set spec.replicas is applied without a conflict (the HPA's scale writes hold no field
    # ownership that conflicts): it resets the count, and the HPA takes it back at its next sync.
    pinned = copy.deepcopy(doc)
    pinned["spec"]["replicas"] = 1
    (tmp_path / "pinned.yaml").write_text(yaml.safe_dump(pinned))
    cluster.kubectl("apply", "--server-side", "--field-manager=gitops", "-f", str(tmp_path / "pinned.yaml"))
    assert replicas(cluster, namespace, name) == 1
    cluster.wait_until(lambda: replicas(cluster, namespace, name) == 4, timeout=60, interval=0.5,
                       message="HPA restored 4")
    server_side_apply(cluster, doc, tmp_path / "serve.yaml")  # back to the manifest without spec.replicas

    engines.waiting = 0
    t1 = time.monotonic()
    cluster.wait_until(lambda: replicas(cluster, namespace, name) == 1, timeout=DOWN_WINDOW + 90, interval=0.5,
                       message="scaled back to 1")
    down = time.monotonic() - t1
    _timing(f"scale-down 4 -> 1 after the load (window {DOWN_WINDOW} s)", down)
    # The window counts from the HPA's last high recommendation, at most one sync period before the load went.
    assert DOWN_WINDOW - HPA_SYNC <= down <= DOWN_WINDOW + 2 * HPA_SYNC + 20, f"scaled down after {down:.0f} s"


def test_keda_scales_on_the_queue_time_p90_which_falls_as_replicas_are_added(cluster, namespace, stack, tmp_path):
    """queueTimeP90Milliseconds alone, through KEDA's Prometheus trigger (metric type Value, the whole service) and
    the HPA controller: the same queueing work spread over more replicas waits less, so the p90 that took the
    resource from 1 to 4 replicas falls below its target at 4 with the load unchanged; with no requests it reads 0
    (not NaN) and the resource goes back to 1."""
    engines, _, op = stack
    doc = manifest(namespace, targets={"queueTimeP90Milliseconds": 500})
    name = doc["metadata"]["name"]
    server_side_apply(cluster, doc, tmp_path / "serve.yaml")
    c = cluster.client
    cluster.wait_until(lambda: ready_pods(cluster, namespace, name) == 1, timeout=60, message="1 replica ready")

    def queue_ms() -> float | None:
        st = (c.get("kvoffloadserves", name, namespace).get("status") or {}).get("autoscaling") or {}
        m = next((m for m in st.get("metrics") or [] if m["target"] == "queueTimeP90Milliseconds"), {})
        return None if m.get("current") in (None, "unknown") else float(m["current"])

    # 1.5 s of waiting on one engine: vLLM's bucket (1.0, 1.5], p90 1450 ms against 500 -> ceil(2.9) = 3 and more
    # while the window still holds the first requests; max 4.
    engines.queue_seconds = 1.5
    t0 = time.monotonic()
    cluster.wait_until(lambda: replicas(cluster, namespace, name) == 4, timeout=150, interval=0.5,
                       message=f"scaled to 4 on the queue time; operator log tail:\n{op.output()[-1500:]}")
    _timing("queue time p90 1450 ms / 500: 1 -> 4 replicas (spec.replicas)", time.monotonic() - t0)
    # The same work on 4 engines waits 0.375 s each (bucket (0.3, 0.5], p90 480 ms): once the window holds only
    # those, the signal is under its target and the HPA keeps 4 (ratio 0.96, within its 10 % tolerance).
    cluster.wait_until(lambda: (v := queue_ms()) is not None and v < 500, timeout=int(autoscaling.RATE_WINDOW[:-1]) * 60
                       + 3 * HPA_SYNC + 30, interval=1, message="the queue time p90 under 500 ms at 4 replicas")
    assert replicas(cluster, namespace, name) == 4
    _timing("queue time p90 falls under its target at 4 replicas, load unchanged", time.monotonic() - t0)

    engines.queue_seconds = 0  # no requests: every bucket's rate 0, the query's `or vector(0)` reads 0 ms
    t1 = time.monotonic()
    cluster.wait_until(lambda: replicas(cluster, namespace, name) == 1, timeout=int(autoscaling.RATE_WINDOW[:-1]) * 60
                       + DOWN_WINDOW + 3 * HPA_SYNC + 60, interval=1, message="scaled back to 1")
    _timing(f"no requests: 4 -> 1 replicas (rate window {autoscaling.RATE_WINDOW}, down window {DOWN_WINDOW} s)",
            time.monotonic() - t1)
    assert queue_ms() in (0.0, None)


def test_keda_scales_to_zero_when_idle_and_wakes_on_demand(cluster, namespace, stack, tmp_path):
    engines, gateway, _ = stack
    wake = f'sum(standin_gateway_pending_requests{{namespace="{namespace}",model="llama31-8b-autoscaled"}})'
    doc = manifest(namespace, minReplicas=0, wakeQuery=wake)
    name = doc["metadata"]["name"]
    engines.kv_usage = 0.0  # an idle vLLM holds no KV blocks for running requests: every trigger is inactive
    server_side_apply(cluster, doc, tmp_path / "serve.yaml")
    # Never active yet: KEDA scales to minReplicaCount at once (its cooldown counts from the last activity).
    cluster.wait_until(lambda: replicas(cluster, namespace, name) == 0, timeout=2 * KEDA_POLL + 30, interval=0.5,
                       message="at zero before any demand")
    cluster.wait_until(lambda: not engines.engines, timeout=60, message="no pod left")

    def pending(n: int) -> None:
        gateway.body = f'standin_gateway_pending_requests{{namespace="{namespace}",model="{name}"}} {n}\n'

    pending(3)  # demand that only the gateway sees: no vLLM runs
    t0 = time.monotonic()
    cluster.wait_until(lambda: replicas(cluster, namespace, name) >= 1, timeout=2 * KEDA_POLL + 30, interval=0.5,
                       message="woken up")
    wake = time.monotonic() - t0
    _timing(f"demand at the gateway, 0 replicas -> spec.replicas 1 (KEDA polling {KEDA_POLL} s)", wake)
    assert wake <= KEDA_POLL + 15, f"woke after {wake:.0f} s"  # one poll, plus Prometheus' scrape and a slow machine
    cluster.wait_until(lambda: ready_pods(cluster, namespace, name) >= 1, timeout=60, message="a replica ready")
    _timing("demand at the gateway -> first replica ready (kwok: no engine start-up)", time.monotonic() - t0)

    pending(0)  # the demand is served and gone
    t1 = time.monotonic()
    cluster.wait_until(lambda: replicas(cluster, namespace, name) == 0, timeout=DOWN_WINDOW + 2 * KEDA_POLL + 60,
                       interval=0.5, message="scaled to zero after the cooldown")
    idle = time.monotonic() - t1
    _timing(f"idle, 1 replica -> 0 replicas (cooldownPeriod {DOWN_WINDOW} s, polling {KEDA_POLL} s)", idle)
    # KEDA's last active poll was at most one polling interval before the demand went; it scales to zero at the
    # first poll a cooldown after that one.
    assert DOWN_WINDOW - KEDA_POLL <= idle <= DOWN_WINDOW + 2 * KEDA_POLL + 20, f"scaled to zero after {idle:.0f} s"
    cluster.wait_until(lambda: not engines.engines, timeout=60, message="no pod left after the cooldown")


def test_plain_hpa_is_admitted_and_status_says_why_it_cannot_scale(cluster, namespace, crd_installed, tmp_path):
    """Autoscaler auto without KEDA's CRD or a prometheusAddress resolves to hpa: the API server admits the rendered
    HorizontalPodAutoscaler; here no adapter serves its Pods metrics, and AutoscalingReady and status say so."""
    sentinel(cluster.client, namespace)
    op = OperatorProcess(cluster.env, [namespace], {"resyncSeconds": 20}, log_path=tmp_path / "operator.log")
    try:
        op.wait_started()
        doc = manifest(namespace)
        name = doc["metadata"]["name"]
        server_side_apply(cluster, doc, tmp_path / "serve.yaml")
        c = cluster.client
        hpa = cluster.wait_until(lambda: c.get_or_none("horizontalpodautoscalers", name, namespace), timeout=60,
                                 message="the operator's HorizontalPodAutoscaler")
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "kvoffload.io/v1alpha1", "kind": "KVOffloadServe",
                                                 "name": name}
        assert [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]] == [
            "vllm_num_requests_waiting", "vllm_kv_cache_usage_perc", "vllm_request_queue_time_p90_milliseconds"]
        assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == DOWN_WINDOW
        assert "autoscaler auto: hpa" in op.output()
        # No APIService serves custom.metrics.k8s.io here (the operator read discovery at start): said at once,
        # with the fix, before the HPA controller's own FailedGetPodsMetric.
        ready = cluster.wait_until(lambda: (lambda cond: cond if cond.get("reason") == "NoCustomMetricsAdapter"
                                            else None)(
            condition(c.get("kvs", name, namespace), "AutoscalingReady")), timeout=60, message="AutoscalingReady")
        assert ready["status"] == "False" and "install a custom-metrics adapter" in ready["message"], ready

        def reason() -> str:
            st = (c.get("kvoffloadserves", name, namespace).get("status") or {}).get("autoscaling") or {}
            return st.get("reason", "")

        cluster.wait_until(lambda: reason() == "FailedGetPodsMetric", timeout=90, message="status.autoscaling reason")
        # Turning autoscaling off prunes the HorizontalPodAutoscaler.
        c.patch("kvoffloadserves", name, {"spec": {"autoscaling": None}}, namespace)
        cluster.wait_until(lambda: c.get_or_none("horizontalpodautoscalers", name, namespace) is None, timeout=60,
                           message="HPA pruned")
    finally:
        op.stop()


@pytest.mark.parametrize("autoscaling,message", [
    ({"minReplicas": 3, "maxReplicas": 2, "targets": {"waitingRequestsPerReplica": 4}},
     "minReplicas must be at most maxReplicas"),
    ({"maxReplicas": 2, "targets": {}}, "needs at least one of waitingRequestsPerReplica"),
    ({"maxReplicas": 2, "targets": {"kvCacheUsagePercent": 101}}, "kvCacheUsagePercent"),
    ({"minReplicas": 0, "maxReplicas": 2, "targets": {"waitingRequestsPerReplica": 4}},
     "wakeQuery is required with minReplicas 0"),
    ({"maxReplicas": 2, "targets": {"waitingRequestsPerReplica": 4}, "wakeQuery": "up"},
     "wakeQuery is required with minReplicas 0"),
])
def test_the_api_server_refuses_bad_autoscaling(cluster, namespace, crd_installed, autoscaling, message):
    doc = copy.deepcopy(manifest(namespace))
    doc["spec"]["autoscaling"] = autoscaling
    with pytest.raises(ApiError) as err:
        cluster.client.create(doc, namespace, dry_run=True)
    assert message in str(err.value) and "spec.autoscaling" in str(err.value)


def test_the_api_server_refuses_the_recompute_target_saying_why(cluster, namespace, crd_installed):
    """promptRecomputePercent is no longer a target: refused with why and what to use instead."""
    doc = manifest(namespace)
    doc["spec"]["autoscaling"]["targets"] = {"promptRecomputePercent": 60}
    with pytest.raises(ApiError) as err:
        cluster.client.create(doc, namespace, dry_run=True)
    assert "promptRecomputePercent is no longer a target" in str(err.value), err.value
    assert "does not fall as replicas are added" in str(err.value) and "queueTimeP90Milliseconds" in str(err.value)


def test_a_stored_object_with_the_recompute_target_stays_updatable_until_its_targets_change(cluster, namespace):
    """Objects stored before promptRecomputePercent was refused: on the real API server, the CRD's CEL rules ratchet
    (unchanged fields are not re-judged), so such an object keeps taking other updates, and an edit of its targets
    hears why. A copy of the CRD in a group of its own stands for "the CRD before and after the upgrade"."""
    group = "ratchet.kvtest.io"
    new = yaml.safe_load((ROOT / "crds" / "kvoffload.io_kvoffloadserves.yaml").read_text())
    new["metadata"]["name"] = f"{new['spec']['names']['plural']}.{group}"
    new["spec"]["group"] = group
    new["spec"]["names"].pop("shortNames", None)
    new["spec"]["names"].pop("categories", None)
    old = copy.deepcopy(new)
    targets = old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "autoscaling"]["properties"]["targets"]
    targets["x-kubernetes-validations"] = [r for r in targets["x-kubernetes-validations"]
                                           if "promptRecomputePercent" not in r["rule"]]
    c = cluster.client
    c.apply(old)
    try:
        cluster.wait_until(lambda: any(cnd["type"] == "Established" and cnd["status"] == "True" for cnd in (
            c.get("crd", new["metadata"]["name"]).get("status") or {}).get("conditions", [])), timeout=60,
            message="the copied CRD established")
        doc = manifest(namespace)
        doc["apiVersion"] = f"{group}/v1alpha1"
        doc["spec"]["autoscaling"]["targets"] = {"waitingRequestsPerReplica": 4, "promptRecomputePercent": 60}
        cluster.wait_until(lambda: c.create(doc, namespace) or True, timeout=30, message="stored under the old CRD")
        c.apply(new)  # the upgrade: the rule that refuses the target

        def refused_create() -> bool:
            other = copy.deepcopy(doc)
            other["metadata"]["name"] = "fresh"
            try:
                c.create(other, namespace, dry_run=True)
            except ApiError as exc:
                return "no longer a target" in str(exc)
            return False

        cluster.wait_until(refused_create, timeout=30, message="the new CRD's rule in force")
        name, plural = doc["metadata"]["name"], f"{new['spec']['names']['plural']}.{group}"
        c.patch(plural, name, {"metadata": {"labels": {"team": "a"}}, "spec": {"autoscaling": {"maxReplicas": 3}}},
                namespace)  # accepted: the targets are unchanged
        with pytest.raises(ApiError) as err:
            c.patch(plural, name, {"spec": {"autoscaling": {"targets": {"waitingRequestsPerReplica": 5}}}}, namespace)
        assert "promptRecomputePercent is no longer a target" in str(err.value), err.value
    finally:
        c.delete("crd", new["metadata"]["name"], wait=True, missing_ok=True)
