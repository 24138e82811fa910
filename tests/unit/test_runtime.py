"""The reconcile queue's order and coalescing, and where the reconcile still dry-runs."""

from __future__ import annotations

import asyncio
import threading

from kvoffload.api.settings import Settings
from kvoffload.api.spec import parse
from kvoffload.controller import pipeline, reconcile, runtime
from kvtest.operator import drain

SPEC = {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "engine": {"maxModelLen": 4096},
        "offload": {"cpu": {"size": "1Gi"}}, "resources": {"gpuMemory": "141Gi"}}


def test_progress_of_a_running_resource_is_not_queued_behind_first_passes():
    order: list[str] = []
    gate = threading.Event()

    def reconcile_(kube, ns, name, settings):
        if name == "first":
            gate.wait(5)  # one first pass holds the only worker while the others queue up
        order.append(name)
        return "updated"

    async def scenario() -> None:
        rt = runtime.Runtime(kube=None, settings=Settings(), reconcile=reconcile_, workers=1)
        rt.kick("ns", "first", runtime.CHANGE)
        await rt._serve()
        await asyncio.sleep(0.05)
        for i in range(5):
            rt.kick("ns", f"new-{i}", runtime.CHANGE)
        rt.kick("ns", "old", runtime.RESYNC)
        rt.kick("ns", "pods-running", runtime.PROGRESS)
        rt.kick("ns", "new-3", runtime.PROGRESS)  # a queued first pass whose children moved: moves up
        gate.set()
        await drain(rt)

    asyncio.run(scenario())
    assert order == ["first", "pods-running", "new-3", "new-0", "new-1", "new-2", "new-4", "old"]


def test_kicks_during_a_reconcile_make_exactly_one_more_pass():
    runs: list[str] = []
    started, release = threading.Event(), threading.Event()

    def reconcile_(kube, ns, name, settings):
        runs.append(name)
        started.set()
        release.wait(5)
        return "updated"

    async def scenario() -> None:
        rt = runtime.Runtime(kube=None, settings=Settings(), reconcile=reconcile_, workers=4)
        rt.kick("ns", "a")
        await rt._serve()
        await asyncio.to_thread(started.wait, 5)
        for _ in range(20):  # a burst of pod events while it runs
            rt.kick("ns", "a", runtime.PROGRESS)
        assert not rt.queued  # coalesced into the running entry, not queued beside it
        release.set()
        await drain(rt)

    asyncio.run(scenario())
    assert runs == ["a", "a"]


def test_a_failed_reconcile_is_retried_with_backoff():
    calls: list[int] = []

    def reconcile_(kube, ns, name, settings):
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("API server down")
        return "updated"

    async def scenario() -> None:
        rt = runtime.Runtime(kube=None, settings=Settings(), reconcile=reconcile_)
        rt.kick("ns", "a")
        await rt._serve()
        for _ in range(300):
            await asyncio.sleep(0.01)
            if len(calls) == 2:
                break
        assert rt.counts == {"failed": 1, "updated": 1}

    asyncio.run(scenario())
    assert len(calls) == 2


def test_dry_run_only_where_the_api_server_can_refuse():
    plain = parse(SPEC, Settings())
    assert not pipeline.unchecked(plain)
    for extra in ({"engine": {**SPEC["engine"], "env": [{"name": "X", "value": "1"}]}},
                  {"scheduling": {"tolerations": [{"key": "gpu", "operator": "Exists"}]}},
                  {"scheduling": {"affinity": {"nodeAffinity": {}}}}):
        assert pipeline.unchecked(parse({**SPEC, **extra}, Settings())), extra
    cm, svc, sts, pdb = ({"kind": k} for k in ("ConfigMap", "Service", "StatefulSet", "PodDisruptionBudget"))
    assert reconcile._to_validate([cm, svc, sts, pdb], unchecked=True) == [sts]  # written after others: check first
    assert reconcile._to_validate([sts, pdb], unchecked=True) == []  # the first write is its own check
    assert reconcile._to_validate([cm, svc, sts, pdb], unchecked=False) == []  # nothing the schema did not check


def test_progress_details_wait_for_the_spacing_but_what_readers_wait_for_does_not():
    def status(gen: int, **conds: str) -> dict:
        return {"observedGeneration": gen, "conditions": [{"type": t, "status": s} for t, s in conds.items()]}

    old = status(1, Ready="False", ConfigValid="True", Scheduled="Unknown")
    assert not reconcile.urgent(old, status(1, Ready="False", ConfigValid="True", Scheduled="True"))
    assert reconcile.urgent(old, status(1, Ready="True", ConfigValid="True", Scheduled="True"))
    assert reconcile.urgent(old, status(1, Ready="False", ConfigValid="False", Scheduled="Unknown"))
    assert reconcile.urgent(old, status(2, Ready="False", ConfigValid="True", Scheduled="Unknown"))
    assert reconcile.urgent({}, old)  # the first status


def test_a_deferred_status_is_reconciled_again_after_the_spacing(monkeypatch):
    monkeypatch.setattr(runtime, "STATUS_SPACING", 0.05)
    outcomes = iter(["deferred", "updated"])
    runs: list[str] = []

    def reconcile_(kube, ns, name, settings):
        runs.append(name)
        return next(outcomes)

    async def scenario() -> None:
        rt = runtime.Runtime(kube=None, settings=Settings(), reconcile=reconcile_)
        rt.kick("ns", "a")
        await rt._serve()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(runs) == 2:
                break

    asyncio.run(scenario())
    assert runs == ["a", "a"]
