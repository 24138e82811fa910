"""Stand-in vLLM engines with a prefix cache, for the routing tests and benchmark (kwok runs no containers).

`StandInPrefixEngine` serves, on one serving pod's loopback address and vLLM's port, what vLLM's router talks to:
/health, /v1/models, /v1/completions (and /v1/completions/render, the router's tokenizer call), and vLLM-shaped
/metrics. It says it is a stand-in (served model "stand-in", every answer's `system_fingerprint`). Its cache models
what the engine keeps per replica with the operator's capacities (status.budget.tiers: tokens per tier):

- a prompt is split into KV blocks of BLOCK tokens, each keyed by its whole prefix (so a block matches only after
  the same blocks before it, as vLLM's chained block hashes do); a request hits the longest run of leading blocks
  cached in any tier, and the tier of each hit block is counted (GPU first, then CPU, then disk);
- every computed block is stored in the GPU tier and written through to each offload tier (LMCache stores every
  chunk to each tier at store time); each tier evicts least-recently-used blocks on its own when full; a hit in an
  offload tier is copied back into the GPU tier.

Tokens: one per whitespace-separated word, its id a stable hash (the router only compares them).

With `seconds_per_token` (per tier and "recompute": the Budget's reload and recompute figures per token), each request
also takes its modelled prefill time before it answers: its recomputed tokens at the recompute rate plus its hit tokens
at their tier's reload rate (a GPU hit costs nothing). One replica runs its prefills one after another (prefill is
compute-bound: requests arriving together share the GPU and wait for each other), so a router that piles requests on
one replica sees its load (requests in flight) grow and its clients wait, as with a real engine.

With `kv_events` (the engine's rendered --kv-events-config), it also does what kv_aware needs from an engine that lets
the router index it: GET /get_server_info (kv_block_size) and GET /kv_event_sources, and a ZMQ PUB socket on the pod
address and the port the config's endpoint names (its replay endpoint beside it, on the port that one names) that
publishes vLLM's own event classes (vllm.distributed.kv_events: BlockStored / BlockRemoved in a KVEventBatch,
msgpack-encoded and framed as vLLM's ZmqEventPublisher does: topic, 8-byte sequence, payload), one medium per tier.
Those need vLLM's event classes: run it with the engine venv's python (`python -m kvtest.standin_prefix_engine`,
below), or beside the STAND-IN module tests/fixtures/fake_vllm/vllm/distributed/kv_events.py (the slim stand-in image
copies this file there: its recorded `vllm serve` publishes through KvEvents and PrefixCache).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

BLOCK = 16  # tokens per KV block (vLLM's default block size)
TIERS = ("gpu", "cpu", "disk")
SERVED = "stand-in"


def tokens(text: str) -> list[int]:
    return [int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "big") % 150_000 for w in text.split()]


class LruTier:
    """One tier: block keys, least recently used first, at most `capacity` tokens."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens // BLOCK
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.evicted = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.blocks

    def put(self, key: bytes) -> tuple[bool, list[bytes]]:
        """(was it new here, the keys it evicted)."""
        if self.capacity <= 0:
            return False, []
        new = key not in self.blocks
        self.blocks[key] = None
        self.blocks.move_to_end(key)
        out = []
        while len(self.blocks) > self.capacity:
            out.append(self.blocks.popitem(last=False)[0])
            self.evicted += 1
        return new, out


@dataclass
class Counts:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    computed_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)  # with seconds_per_token: arrival to the end of its prefill


TOPIC = ""  # vLLM's default topic, the one the operator renders (rendering/routing.KV_EVENTS_TOPIC)


def config_ports(config: dict[str, Any]) -> tuple[int, int]:
    """The ports of a --kv-events-config's publisher and replay endpoints (tcp://*:PORT each), where vLLM binds them:
    the stand-in takes them from what the operator rendered, as the engine does, and knows no port of its own."""
    if config.get("topic", "") != TOPIC or not config.get("endpoint") or not config.get("replay_endpoint"):
        raise ValueError(f"stand-in vLLM publishes on topic {TOPIC!r} with a replay endpoint; the config asks {config}")
    return int(config["endpoint"].rsplit(":", 1)[1]), int(config["replay_endpoint"].rsplit(":", 1)[1])


class KvEvents:
    """vLLM's KV events of one stand-in engine, framed as vLLM's ZmqEventPublisher frames them (topic, 8-byte sequence,
    msgpack payload), on a PUB socket bound to its pod address only, with vLLM's replay endpoint beside it (a ROUTER
    socket on `replay_port`: a subscriber that joins late asks it for what it missed, from a sequence number)."""

    def __init__(self, host: str, port: int, replay_port: int) -> None:
        import msgspec
        import zmq
        from vllm.distributed import kv_events

        self.kv, self.encoder = kv_events, msgspec.msgpack.Encoder()
        # The medium of each tier's events: vLLM's own for GPU and CPU. vLLM's disk medium (MEDIUM_FS, "FS") is not one
        # vllm-router 0.1.17 credits (its disk tier reads "DISK": docs/routing.md), so the disk tier says DISK.
        self.medium = {"gpu": kv_events.MEDIUM_GPU, "cpu": kv_events.MEDIUM_CPU, "disk": "DISK"}
        self.socket = zmq.Context.instance().socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.endpoint, self.replay_endpoint = f"tcp://{host}:{port}", f"tcp://{host}:{replay_port}"
        self.socket.bind(self.endpoint)
        self.replay = zmq.Context.instance().socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.bind(self.replay_endpoint)
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=10_000)
        self.lock = threading.Lock()
        threading.Thread(target=self._serve_replay, daemon=True).start()

    def _serve_replay(self) -> None:
        """vLLM's ZmqEventPublisher._service_replay: (client, b"", start seq) -> every buffered batch from there, then
        an end marker (sequence -1)."""
        import zmq

        while True:
            try:
                frames = self.replay.recv_multipart()
            except zmq.ZMQError:
                return
            if len(frames) != 3:
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            with self.lock:
                batches = [(seq, buf) for seq, buf in self.buffer if seq >= start]
            for seq, buf in batches:
                self.replay.send_multipart((client, b"", TOPIC.encode(), seq.to_bytes(8, "big"), buf))
            self.replay.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))

    def publish(self, events: list[Any]) -> None:
        if not events:
            return
        batch = self.kv.KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)
        payload = self.encoder.encode(batch)
        with self.lock:
            self.socket.send_multipart((TOPIC.encode(), self.seq.to_bytes(8, "big"), payload))
            self.buffer.append((self.seq, payload))
            self.seq += 1

    def stored(self, chain: list[tuple[bytes, list[int]]], parent: bytes | None, tier: str) -> Any:
        return self.kv.BlockStored(block_hashes=[_h(k) for k, _ in chain], parent_block_hash=_h(parent) if parent
                                   else None,
                                   token_ids=[t for _, ids in chain for t in ids], block_size=BLOCK, lora_id=None,
                                   medium=self.medium[tier], lora_name=None)

    def removed(self, keys: list[bytes], tier: str) -> Any:
        return self.kv.BlockRemoved(block_hashes=[_h(k) for k in keys], medium=self.medium[tier])


def _h(key: bytes) -> int:
    return int.from_bytes(key[:8], "big") >> 1  # an ExternalBlockHash that fits msgpack's int64


class PrefixCache:
    def __init__(self, capacity: dict[str, int], events: KvEvents | None = None) -> None:
        self.tiers = {t: LruTier(capacity.get(t, 0)) for t in TIERS}
        self.counts = Counts()
        self.lock = threading.Lock()
        self.events = events

    def reset(self) -> None:
        with self.lock:
            removed = {t: list(self.tiers[t].blocks) for t in TIERS}
            for t in TIERS:
                self.tiers[t].blocks.clear()
            self.counts = Counts()
            if self.events:
                self.events.publish([self.events.removed(keys, t) for t, keys in removed.items() if keys])

    @staticmethod
    def keys(ids: list[int]) -> list[bytes]:
        out, h = [], hashlib.blake2b(digest_size=16)
        for i in range(len(ids) // BLOCK):
            h.update(json.dumps(ids[i * BLOCK:(i + 1) * BLOCK]).encode())
            out.append(h.copy().digest())
        return out

    def serve(self, ids: list[int]) -> dict[str, int]:
        """Count one prompt's hits per tier and recomputed tokens, then store its blocks; returns the hits."""
        with self.lock:
            keys, hits = self.keys(ids), dict.fromkeys(TIERS, 0)
            n = 0
            for key in keys:
                tier = next((t for t in TIERS if key in self.tiers[t]), None)
                if tier is None:
                    break
                hits[tier] += BLOCK
                n += 1
            c = self.counts
            c.requests += 1
            c.prompt_tokens += len(ids)
            c.computed_tokens += len(ids) - n * BLOCK
            for t in TIERS:
                c.hit_tokens[t] += hits[t]
            self.store(ids, TIERS)  # computed or reloaded: in the GPU tier now; written through to every offload tier
            return hits

    def store(self, ids: list[int], tiers: tuple[str, ...]) -> None:
        """Put a prompt's blocks in `tiers`, publishing what each tier stored and evicted."""
        keys, events = self.keys(ids), []
        for t in tiers:
            chain, parent, evicted = [], None, []
            for i, key in enumerate(keys):
                new, out = self.tiers[t].put(key)
                evicted += out
                if new:
                    if not chain:
                        parent = keys[i - 1] if i else None
                    chain.append((key, ids[i * BLOCK:(i + 1) * BLOCK]))
            if self.events and chain:
                events.append(self.events.stored(chain, parent, t))
            if self.events and evicted:
                events.append(self.events.removed(evicted, t))
        if self.events:
            self.events.publish(events)

    def evict(self, tier: str) -> int:
        """Drop every block of `tier` (as the engine evicts under pressure), publishing a BlockRemoved; the count."""
        with self.lock:
            keys = list(self.tiers[tier].blocks)
            self.tiers[tier].blocks.clear()
            if self.events and keys:
                self.events.publish([self.events.removed(keys, tier)])
            return len(keys)


class StandInPrefixEngine:
    """A stand-in engine on (host, port) with a PrefixCache of the operator's tier capacities."""

    def __init__(self, name: str, host: str, port: int, capacity: dict[str, int],
                 kv_events: dict[str, Any] | None = None, seconds_per_token: dict[str, float] | None = None) -> None:
        self.name = name
        self.seconds_per_token = seconds_per_token
        self.prefill = threading.Lock()  # one prefill at a time per replica (with seconds_per_token)
        self.waiting = 0  # requests that wait for the prefill lock (a test may hold it to keep this replica busy)
        # With KV events the engine starts "starting": vllm-router 0.1.17 subscribed to the publishers of workers that
        # became healthy after it started, and in our runs never to those already healthy at its first check.
        self.healthy = kv_events is None
        self.events = KvEvents(host, *config_ports(kv_events)) if kv_events is not None else None
        self.cache = PrefixCache(capacity, self.events)
        self.prompts: list[str] = []
        self.asked: set[str] = set()  # the GET paths asked so far (what the router wanted to know)
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: Any, ctype: str = "application/json") -> None:
                raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:  # noqa: N802
                engine.asked.add(self.path)
                if self.path == "/health":  # 503 while "starting" (a real engine loads its weights first)
                    self._send(200 if engine.healthy else 503, "")
                elif self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": SERVED, "object": "model",
                                                                 "owned_by": "stand-in"}]})
                elif self.path == "/metrics":
                    self._send(200, engine.metrics(), "text/plain; version=0.0.4")
                elif self.path == "/get_server_info" and engine.events:
                    self._send(200, {"model_id": SERVED, "model_path": SERVED, "instance_id": engine.name,
                                     "kv_block_size": BLOCK})
                elif self.path == "/kv_event_sources" and engine.events:
                    self._send(200, {"0": {"endpoint": engine.events.endpoint,
                                           "replay_endpoint": engine.events.replay_endpoint,
                                           "topic": TOPIC}})
                elif self.path == "/standin/counts":
                    self._send(200, {"replica": engine.name, **engine.cache.counts.__dict__,
                                     "prompts": len(engine.prompts),
                                     "asked": sorted(engine.asked - {"/standin/counts"})})
                else:
                    self._send(404, {"error": self.path})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
                prompt = body.get("prompt", "")
                prompt = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
                if self.path == "/v1/completions/render":
                    self._send(200, [{"token_ids": tokens(prompt), "sampling_params": {}, "model": SERVED}])
                elif self.path == "/v1/completions":
                    self._send(200, engine.complete(prompt))
                elif self.path in ("/standin/start", "/standin/stop"):  # the test ends (or restarts) the start-up
                    engine.healthy = self.path == "/standin/start"
                    self._send(200, {"healthy": engine.healthy})
                elif self.path == "/standin/reset":  # empty every tier and the counters (a benchmark's next run)
                    engine.cache.reset()
                    self._send(200, {"reset": engine.name})
                elif self.path == "/standin/seed":  # the test puts a prompt's blocks in some tiers of this replica
                    engine.cache.store(tokens(prompt), tuple(body["tiers"]))
                    self._send(200, {"seeded": engine.name})
                else:
                    self._send(404, {"error": self.path})

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def complete(self, prompt: str) -> dict[str, Any]:
        ids = tokens(prompt)
        if self.seconds_per_token is None:
            hits = self.cache.serve(ids)
        else:
            rate, arrived = self.seconds_per_token, time.monotonic()
            self.waiting += 1
            with self.prefill:  # looked up when its prefill starts, as vLLM's scheduler does
                self.waiting -= 1
                hits = self.cache.serve(ids)
                time.sleep((len(ids) - sum(hits.values())) * rate["recompute"]
                           + sum(n * rate.get(t, 0.0) for t, n in hits.items()))
                self.cache.counts.ttft_s.append(time.monotonic() - arrived)
        self.prompts.append(prompt)
        cached = sum(hits.values())
        return {"id": f"cmpl-standin-{self.name}-{len(self.prompts)}", "object": "text_completion", "model": SERVED,
                "system_fingerprint": f"kvoffload-stand-in-engine {self.name}",
                "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1,
                          "prompt_tokens_details": {"cached_tokens": cached}},
                "kvoffload_stand_in": {"replica": self.name, "hit_tokens": hits}}

    def metrics(self) -> str:
        c, m = self.cache.counts, f'engine="0",model_name="{SERVED}"'
        local, external = c.hit_tokens["gpu"], c.hit_tokens["cpu"] + c.hit_tokens["disk"]
        used = len(self.cache.tiers["gpu"].blocks) / max(1, self.cache.tiers["gpu"].capacity)
        lines = ["# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{m}}} 0",
                 "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{{{m}}} 0",
                 "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{{{m}}} {used}",
                 "# TYPE vllm:prefix_cache_queries_total counter",
                 f"vllm:prefix_cache_queries_total{{{m}}} {c.prompt_tokens}",
                 "# TYPE vllm:prefix_cache_hits_total counter", f"vllm:prefix_cache_hits_total{{{m}}} {local}",
                 "# TYPE vllm:external_prefix_cache_queries_total counter",
                 f"vllm:external_prefix_cache_queries_total{{{m}}} {c.prompt_tokens - local}",
                 "# TYPE vllm:external_prefix_cache_hits_total counter",
                 f"vllm:external_prefix_cache_hits_total{{{m}}} {external}",
                 "# TYPE vllm:prompt_tokens_by_source_total counter"]
        for source, v in (("local_compute", c.computed_tokens), ("local_cache_hit", local),
                          ("external_kv_transfer", external)):
            lines.append(f'vllm:prompt_tokens_by_source_total{{{m},source="{source}"}} {v}')
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def main() -> None:
    """Stand-in engines in their own process (the engine venv's python has vLLM's event classes):
    python -m kvtest.standin_prefix_engine '{"engines": [{"name": ..., "host": ..., "port": ...}], "capacity": {...},
    "kv_events": {the rendered --kv-events-config}, "seconds_per_token": {...}}'; runs until stdin closes."""
    import sys

    conf = json.loads(sys.argv[1])
    engines = [StandInPrefixEngine(e["name"], e["host"], e["port"], conf["capacity"], conf.get("kv_events"),
                                   conf.get("seconds_per_token")) for e in conf["engines"]]
    print("stand-in engines ready:", " ".join(e.url for e in engines), flush=True)
    sys.stdin.read()
    for e in engines:
        e.close()


if __name__ == "__main__":
    main()
