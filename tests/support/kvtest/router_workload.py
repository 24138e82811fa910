"""What the tests ask of vLLM's router (vllm-router 0.1.17) in front of STAND-IN replicas, and the cache_aware
workload that shows its affinity. The replicas are tests/fixtures/fake_vllm in its recorded mode (the slim stand-in
engine image's `vllm serve`): each answer names the replica that served it, and GET /standin/counts says what a
replica was asked. Used by tests/unit/test_router_standin.py (the router and two stand-ins as host processes on
127.0.0.1) and tests/integration/test_real_node_routing.py (the rendered router pod in front of two serving pods on
the real node), so the workload the real node runs was first run here against the real router.

cache_aware in 0.1.17 (src/policies/cache_aware.rs): for each request the router asks every replica for the
request's token ids (POST /v1/completions/render) and sends it to the replica whose tree of earlier requests shares
the longest prefix with it, if that match rate passes its threshold; otherwise (a new prompt) to the least loaded
replica, which is the first one when all are idle. So one request at a time, every new prompt lands on the first
replica and "repeats stay on one replica" proves nothing. `affinity` makes the second document arrive while the
first is still in flight (`kvoffload_stand_in_hold_s`): load places it on the other replica, and each document's
later requests follow their own document, prefix hits the router counts in vllm_router_prefix_routing_decisions_total.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

# The field of a stand-in answer that names the replica (tests/fixtures/fake_vllm recorded mode).
STAND_IN = "kvoffload_stand_in"
HOLD = "kvoffload_stand_in_hold_s"
PREFIX_DECISIONS = "vllm_router_prefix_routing_decisions_total"
# kv_aware's debug line per decision (src/policies/kv_aware.rs): the worker it chose, the prefix tokens credited there.
KV_DECISION = re.compile(r'KV prefix decision outcome="[a-z_]+" worker="([^"]+)" input_tokens=\d+ '
                         r'new_prefill_tokens=\d+ credited_prefix_tokens=(\d+)')


def get_json(url: str, timeout: float = 10) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - pod, bridge or loopback addresses only
        return json.loads(r.read())


def post_json(url: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - pod, bridge or loopback addresses only
        return r.status, json.loads(r.read())


def metrics_text(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - pod, bridge or loopback addresses only
        return r.read().decode()


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample of a Prometheus text page."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, dict(s.labels), float(s.value)) for f in text_string_to_metric_families(text) for s in f.samples]


def total(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when there is none)."""
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == want for k, want in labels.items()))


def by_label(samples: list[tuple[str, dict[str, str], float]], name: str, label: str) -> dict[str, float]:
    """{value of `label`: sample value} of `name` (e.g. vllm_router_worker_health by worker)."""
    return {lab[label]: v for n, lab, v in samples if n == name and label in lab}


def workers(router: str) -> set[str]:
    """The worker URLs the router routes to now (GET /list_workers); empty while it does not answer."""
    try:
        return set(get_json(f"{router}/list_workers").get("urls") or [])
    except OSError:
        return set()


def documents(n: int, words: int, seed: str) -> list[str]:
    """`n` distinct documents of `words` words (one stand-in token per word), `seed` keeps runs apart."""
    return [" ".join(f"{seed}d{k}w{j}" for j in range(words)) for k in range(n)]


def complete(router: str, model: str, prompt: str, hold_s: float = 0.0) -> dict[str, Any]:
    """One /v1/completions through the router; the stand-in's answer. Anything but 200 raises."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": 1}
    if hold_s:
        body[HOLD] = hold_s
    status, answer = post_json(f"{router}/v1/completions", body)
    assert status == 200, (status, answer)
    assert answer["system_fingerprint"].startswith("kvoffload-stand-in-engine"), answer
    return answer


def counts(replicas: list[str]) -> list[dict[str, Any]]:
    """Each replica's GET /standin/counts (`replicas`: their base URLs, as the router names them)."""
    return [get_json(f"{r}/standin/counts") for r in replicas]


def affinity(router: str, replicas: list[str], model: str, *, rounds: int = 3, words: int = 300, seed: str = "aff",
             hold_s: float = 5.0, wait: Callable[..., Any]) -> dict[int, list[str]]:
    """Two new documents, the first kept in flight on the replica it reached while the second arrives, then `rounds`
    further questions on each, one at a time. -> {document: [the replica that answered each of its requests]}.
    `wait(fn, timeout=, interval=, message=)` is kvtest.wait_until."""
    docs = documents(2, words, seed)
    served: dict[int, list[str]] = {0: [], 1: []}
    first: dict[str, Any] = {}
    errors: list[BaseException] = []

    def held() -> None:
        try:
            first["answer"] = complete(router, model, f"{docs[0]} question 0", hold_s=hold_s)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
            errors.append(e)

    thread = threading.Thread(target=held, daemon=True)
    thread.start()
    try:
        wait(lambda: errors or any(c["in_flight"] for c in counts(replicas)), timeout=max(hold_s - 1, 1), interval=0.05,
             message="the first document's request in flight at a replica")
        assert not errors, errors
        served[1].append(complete(router, model, f"{docs[1]} question 0")[STAND_IN]["replica"])
    finally:
        thread.join(timeout=hold_s + 60)
    assert not errors and "answer" in first, errors
    served[0].append(first["answer"][STAND_IN]["replica"])
    for r in range(1, rounds + 1):
        for k in (0, 1):
            served[k].append(complete(router, model, f"{docs[k]} question {r}")[STAND_IN]["replica"])
            time.sleep(0.05)
    return served


def plain(log: str) -> str:
    """The router's log without its colour codes."""
    return re.sub(r"\x1b\[[0-9;]*m", "", log)


def flag_values(args: list[str], flag: str) -> list[str]:
    """The value after each occurrence of a repeated flag in a rendered command line (--kv-event-source ...)."""
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def worker_urls(args: list[str]) -> list[str]:
    """The URLs a rendered router command line lists after --worker-urls (none without it)."""
    if "--worker-urls" not in args:
        return []
    rest = args[args.index("--worker-urls") + 1:]
    return rest[:next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]


def kv_decided(router: str, model: str, prompt: str,
               log: Callable[[], str] | None) -> tuple[str, str, int, dict[str, int]]:
    """One request through a kv_aware router, and the router's account of it where its debug log is at hand: (replica
    that answered, worker the router chose, prefix tokens it credited there, the answer's hit tokens per tier); without
    a log the worker is "" and the credit -1."""
    answer = complete(router, model, prompt)[STAND_IN]
    worker, credited = KV_DECISION.findall(plain(log()))[-1] if log else ("", "-1")
    return answer["replica"], worker, int(credited), answer.get("hit_tokens") or {}


def kv_seeded(router: str, model: str, holder: str, tiers: tuple[str, ...], log: Callable[[], str] | None, *,
              evict: str | None = None, words: int = 320) -> Callable[[], tuple[str, str, int, dict[str, int]]]:
    """A try for wait_until: each call a new document of `words` tokens put in replica `holder`'s `tiers` (POST
    /standin/seed: their BlockStored), evicted again from `evict` if given (its BlockRemoved), then asked for through
    the router: kv_decided. KV events reach the router asynchronously, as a real engine's do: a try that came too early
    leaves its document elsewhere, and the next one, a little later, uses another."""
    tries = itertools.count()
    tag = f"{'-'.join(tiers)}{evict or ''}{time.monotonic_ns()}"

    def attempt() -> tuple[str, str, int, dict[str, int]]:
        k = next(tries)
        doc = " ".join(f"kv{tag}d{k}w{j}" for j in range(words))
        post_json(f"{holder}/standin/seed", {"prompt": doc, "tiers": list(tiers)})
        if evict:
            post_json(f"{holder}/standin/evict", {"tier": evict})
        time.sleep(min(0.1 * 2 ** k, 2.0))  # how long the events had to reach the router: longer each try
        return kv_decided(router, model, f"{doc} question", log)
    return attempt
