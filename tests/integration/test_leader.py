"""Leader election on the real control plane: two replicas, one Lease, one of them acts.

Both operators run `kvoffload run --leader-election` as subprocesses scoped to the test's namespace,
with the Lease in that namespace.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvtest import OperatorProcess

pytestmark = pytest.mark.cluster

LEASE = "kvo-test-leader"
SERVE = {"apiVersion": "kvoffload.io/v1alpha1", "kind": "KVOffloadServe", "metadata": {"name": "one"},
         "spec": {"replicas": 1, "model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "engine": {"maxModelLen": 4096},
                  "offload": {"cpu": {"size": "1Gi"}}, "resources": {"gpuMemory": "141Gi"}}}


def replica(env: dict[str, str], namespace: str, log_path: Path) -> OperatorProcess:
    """One operator replica with --leader-election, the Lease in the test's namespace."""
    return OperatorProcess(env, [namespace], log_path=log_path, leader_election=(namespace, LEASE))


@pytest.fixture
def replicas(cluster, crd_installed, namespace, tmp_path):
    pair = [replica(cluster.env, namespace, tmp_path / f"replica-{i}.log") for i in range(2)]
    cluster.wait_until(lambda: all(r.identity() for r in pair), timeout=60, message="both replicas started")
    yield pair
    for r in pair:
        r.stop()
        print(f"--- {r.log_path.name} ({r.identity()})\n" + "\n".join(
            line for line in r.output().splitlines() if "kvoffload." in line)[-3000:])


def lease(cluster, ns):
    return cluster.client.get_or_none("lease", LEASE, ns)


def holder(cluster, ns) -> str | None:
    return ((lease(cluster, ns) or {}).get("spec") or {}).get("holderIdentity") or None


def leader_and_follower(cluster, ns, pair):
    ident = cluster.wait_until(lambda: holder(cluster, ns), timeout=30, message="Lease held")
    (lead,) = [r for r in pair if r.identity() == ident]
    (follow,) = [r for r in pair if r is not lead]
    return lead, follow


def apply(cluster, ns, obj):
    cluster.client.apply(obj, ns)


def wait_ready(cluster, ns, name, timeout=120):
    def check():
        obj = cluster.client.get("kvs", name, ns)
        st = obj.get("status") or {}
        ok = st.get("observedGeneration") == obj["metadata"]["generation"] and any(
            c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions", []))
        return obj if ok else None
    return cluster.wait_until(check, timeout=timeout, message=f"{name} Ready at its generation")


def applies(op: OperatorProcess, name: str | None = None) -> list[str]:
    return [line for line in op.output().splitlines()
            if "kvoffload.reconcile: apply " in line and (name is None or line.endswith(f"/{name}")
                                                          or f"/{name}-" in line)]


def test_one_replica_leads_and_the_other_takes_over(cluster, namespace, replicas):
    lead, follow = leader_and_follower(cluster, namespace, replicas)
    assert "acquired Lease" in lead.output() and "acquired Lease" not in follow.output()
    first = lease(cluster, namespace)["spec"]
    assert first["leaseDurationSeconds"] == 15

    apply(cluster, namespace, SERVE)
    wait_ready(cluster, namespace, "one")
    assert len(applies(lead, "one")) == 5, applies(lead)  # ConfigMap, 2 Services, StatefulSet, PDB: once each
    assert applies(follow) == [], applies(follow)
    cluster.wait_until(lambda: lease(cluster, namespace)["spec"]["renewTime"] > first["renewTime"], timeout=15,
                       message="the leader renews")
    assert holder(cluster, namespace) == lead.identity()
    assert applies(follow) == [], applies(follow)

    lead.kill()
    t0 = time.monotonic()
    cluster.wait_until(lambda: holder(cluster, namespace) == follow.identity(), timeout=30, interval=0.2,
                       message="the follower holds the Lease")
    took = time.monotonic() - t0
    print(f"takeover {took:.1f}s after SIGKILL of the leader")
    assert took <= 20
    assert lease(cluster, namespace)["spec"]["leaseTransitions"] == first.get("leaseTransitions", 0) + 1

    second = {**SERVE, "metadata": {"name": "two"}}
    apply(cluster, namespace, second)
    wait_ready(cluster, namespace, "two")
    assert len(applies(follow, "two")) == 5, applies(follow)
    # On taking over it re-reconciled what already existed, and found nothing to change.
    assert applies(follow, "one") == [], applies(follow)


def test_graceful_shutdown_hands_over_at_once(cluster, namespace, replicas):
    lead, follow = leader_and_follower(cluster, namespace, replicas)
    t0 = time.monotonic()
    lead.stop()  # SIGTERM: kopf's cleanup releases the Lease
    cluster.wait_until(lambda: holder(cluster, namespace) == follow.identity(), timeout=30, interval=0.2,
                       message="the follower holds the Lease")
    took = time.monotonic() - t0
    print(f"handover {took:.1f}s after SIGTERM of the leader")
    assert took <= 8  # shutdown, then the follower's next look (every 2 s); no waiting for the 15 s expiry
    apply(cluster, namespace, SERVE)
    wait_ready(cluster, namespace, "one")
    assert len(applies(follow, "one")) == 5
