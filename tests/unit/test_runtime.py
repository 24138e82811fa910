"""The reconcile queue's order and coalescing, and where the reconcile still dry-runs."""

from __future__ import annotations

import asyncio
import threading

import pytest

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
        rt._serve()
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
        rt._serve()
        await asyncio.to_thread(started.wait, 5)
        for _ in range(20):  # a burst of pod events while it runs
            rt.kick("ns", "a", runtime.PROGRESS)
        assert not rt.queued  # coalesced into the running entry, not queued beside it
        release.set()
        await drain(rt)

    asyncio.run(scenario())
    assert runs == ["a", "a"]


def retried(first) -> tuple[runtime.Runtime, list[int]]:  # type: ignore[no-untyped-def]
    """Reconcile one resource whose first pass does `first()`, then "updated"; until the second pass."""
    calls: list[int] = []

    def reconcile_(kube, ns, name, settings):
        calls.append(1)
        return first() if len(calls) == 1 else "updated"

    async def scenario() -> runtime.Runtime:
        rt = runtime.Runtime(kube=None, settings=Settings(), reconcile=reconcile_)
        rt.kick("ns", "a")
        rt._serve()
        for _ in range(300):
            await asyncio.sleep(0.01)
            if len(calls) == 2:
                break
        return rt

    return asyncio.run(scenario()), calls


def test_a_failed_reconcile_is_retried_with_backoff():
    def down() -> str:
        raise ConnectionError("API server down")

    rt, calls = retried(down)
    assert rt.counts == {"failed": 1, "updated": 1}
    assert len(calls) == 2


def test_a_refused_status_is_counted_and_retried():
    rt, calls = retried(lambda: reconcile.REFUSED)
    assert rt.counts == {reconcile.REFUSED: 1, "updated": 1} and len(calls) == 2
    assert rt.metrics.status_refused._value.get() == 1
    assert rt.metrics.reconciles.labels(reconcile.REFUSED)._value.get() == 1


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
        rt._serve()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(runs) == 2:
                break

    asyncio.run(scenario())
    assert runs == ["a", "a"]


def test_a_field_removed_from_the_spec_is_not_taken_for_a_no_op():
    tolerated = {**SPEC, "scheduling": {"tolerations": [{"key": "gpu", "operator": "Exists"}]}}
    old, new = (pipeline.desired("a", "ns", "u", s, Settings()) for s in (tolerated, SPEC))
    live = {c["kind"]: c for c in old.applied}  # what the cluster holds from the earlier generation
    sts = {c["kind"]: c for c in new.children}["StatefulSet"]
    assert reconcile.covers(sts, live["StatefulSet"])  # everything still desired is there: the old check saw no change
    stamped = {c["kind"]: c for c in new.applied}
    assert not reconcile.covers(stamped["StatefulSet"], live["StatefulSet"])  # the rendered hash moved: applied
    assert all(reconcile.covers(stamped[k], live[k]) for k in stamped if k != "StatefulSet")  # the rest stays put
    covered = reconcile.Covered()
    live_sts = {**stamped["StatefulSet"], "metadata": {**stamped["StatefulSet"]["metadata"], "uid": "x",
                                                       "resourceVersion": "7"}}
    assert covered(stamped["StatefulSet"], live_sts) and covered.seen["x"][1] == "7"
    assert not covered(live["StatefulSet"], live_sts)  # another desired hash: walked again, not remembered


def test_the_liveness_probe_fails_once_a_worker_died():
    """kopf's own health endpoint (its probe handlers, served on 127.0.0.1) answers 200 while the
    Runtime's tasks live and 500 once a worker died of something its retry does not catch."""
    import socket

    import aiohttp
    import kopf
    from kopf._core.engines import indexing, probing

    from kvoffload.controller import handlers

    class Bug(BaseException):  # not an Exception: nothing in the worker catches it
        pass

    def reconcile_(kube, ns, name, settings):
        if name == "bug":
            raise Bug("a bug outside the retry")
        return "unchanged"

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def scenario() -> None:
        rt = runtime.Runtime(kube=None, settings=Settings(), reconcile=reconcile_, workers=2)
        memo = kopf.Memo(runtime=rt)
        ready = asyncio.Event()
        server = asyncio.create_task(probing.health_reporter(
            f"http://127.0.0.1:{port}/healthz", memo=memo, indices=indexing.OperatorIndexers().indices,
            registry=kopf.get_default_registry(), settings=kopf.OperatorSettings(), ready_flag=ready))
        await asyncio.wait_for(ready.wait(), 5)
        rt._serve()
        rt.kick("ns", "fine")
        await drain(rt)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/healthz") as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["runtime"]["reconciles"] == {"unchanged": 1}
            rt.kick("ns", "bug")
            for _ in range(200):
                await asyncio.sleep(0.01)
                if rt.died:
                    break
            assert rt.died and rt.died[0].startswith("worker ")
            await asyncio.sleep(10.1)  # kopf caches a probe's answer for 10 s
            async with session.get(f"http://127.0.0.1:{port}/healthz") as resp:
                assert resp.status == 500
        with pytest.raises(kopf.PermanentError, match="operator tasks died: worker"):
            handlers.runtime_health(memo=memo)
        assert rt.metrics.dead_tasks._value.get() == 1
        server.cancel()

    asyncio.run(scenario())



def test_a_refused_status_is_told_from_a_stale_resource_version():
    """Both are 422 Invalid from kube-apiserver 1.37 (bodies as it sends them): a failed resourceVersion
    test of our JSON patch names no field (someone wrote first: reconcile again), a schema refusal does."""
    from kvoffload.controller.kube import ApiError, Kube

    stale = ('{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"the server rejected our '
             'request due to an error in our request","reason":"Invalid","details":{},"code":422}')
    invalid = ('{"kind":"Status","status":"Failure","message":"KVOffloadServe.kvoffload.io \\"x\\" is invalid: '
               '[status.conditions[0].status: Unsupported value: '
               '\\"Maybe\\"]","reason":"Invalid","details":{"name":"x",'
               '"causes":[{"reason":"FieldValueNotSupported","field":"status.conditions[0].status"}]},"code":422}')

    class Refusing(Kube):
        def __init__(self, body: str) -> None:
            self.body = body

        def replace_status(self, path, status, resource_version):
            raise ApiError(422, "Unprocessable Entity", self.body)

    assert reconcile._write_status(Refusing(stale), "ns", "x", {}, "1") is None
    with pytest.raises(reconcile.StatusRefused, match="status.conditions"):
        reconcile._write_status(Refusing(invalid), "ns", "x", {}, "1")
