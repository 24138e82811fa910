"""Run inside an engine venv: vLLM's side of LMCacheMPConnector (LMCache's own scheduler and worker adapters, with the
kv_connector_extra_config the operator renders) against a running `lmcache server`. CPU tensors in vLLM's
flash-attention layout stand in for the GPU's, so the worker takes the engine-driven shared-memory path the rendered
pod uses. Prints one JSON line.

  store:   register, look a fixed prompt of TOKENS tokens up (a miss), store it, wait until the server acknowledges it
  lookup:  register (a new vLLM process, as after a restart), look the same prompt up: the tokens the server finds, and
           whether they load the stored bytes
  restart: store as above, print STORED; at a line on stdin (the test killed the server) look up as a request in an
           outage does (it times out), print LOOKED; at the next line (the server is back) wait until both adapters
           are healthy again (their heartbeats re-register, as a running vLLM's do; at most 60 s), then lookup as above

Usage: python l2_reload_check.py 'KV_TRANSFER_CONFIG_JSON' MODEL_NAME TOKENS store|lookup|restart
"""

from __future__ import annotations

import json
import sys
import time

import torch
import zmq
from lmcache.integration.vllm.vllm_multi_process_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
    ParallelStrategy,
)

BLOCK = 16


class NoEvent:
    """The engine-driven (non-CUDA) transfer never waits on vLLM's CUDA event."""

    def ipc_handle(self):
        return None

    def wait(self, stream=None):
        return None


def main() -> None:
    kv_transfer_config, model, tokens, phase = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    extra = kv_transfer_config["kv_connector_extra_config"]
    url = f"{extra['lmcache.mp.host']}:{extra['lmcache.mp.port']}"
    strategy = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1, n_servers=1)
    ctx = zmq.Context.instance()
    worker = LMCacheMPWorkerAdapter(url, ctx, model, BLOCK, strategy, extra_config=extra)
    scheduler = LMCacheMPSchedulerAdapter([url], ctx, model, BLOCK, strategy, extra_config=extra)
    blocks = tokens // BLOCK
    # Per layer [2 (K, V), blocks, block_size, kv_heads, head_dim]; each block holds its own index, so a load is seen.
    kv = {f"model.layers.{i}.self_attn.attn": torch.zeros(2, blocks, BLOCK, 4, 128, dtype=torch.bfloat16)
          for i in range(4)}
    if phase in ("store", "restart"):
        for t in kv.values():
            t.copy_(torch.arange(blocks, dtype=torch.bfloat16).view(1, blocks, 1, 1, 1).expand_as(t))
    worker.register_kv_caches(kv)
    prompt = [(7 * i + 3) % 32000 for i in range(tokens)]
    blocks_all = [list(range(blocks))]
    out: dict = {"phase": phase}

    def lookup(request_id: str) -> int | None:
        deadline = time.monotonic() + 60
        found = None
        while found is None and time.monotonic() < deadline:
            scheduler.maybe_submit_lookup_request(request_id, prompt)
            found = scheduler.check_lookup_result(request_id)
            time.sleep(0.05)
        return found

    def finished(request_id: str, store: bool) -> bool:
        deadline, done = time.monotonic() + 60, set()
        while request_id not in done and time.monotonic() < deadline:
            stores, loads = worker.get_finished({request_id} if store else set())
            done |= (stores if store else loads) or set()
            time.sleep(0.05)
        return request_id in done

    if phase in ("store", "restart"):
        out["found_before"] = lookup("req-store")
        worker.submit_store_request("req-store", LoadStoreOp(token_ids=prompt, block_ids=blocks_all, start=0,
                                                             end=tokens), NoEvent())
        out["stored"] = finished("req-store", store=True)
        scheduler.cleanup_lookup_result("req-store")
    if phase == "restart":
        print("STORED", flush=True)
        sys.stdin.readline()
        out["found_in_outage"] = lookup("req-outage")
        print("LOOKED", flush=True)
        sys.stdin.readline()
        deadline = time.monotonic() + 60
        while not (worker.is_healthy and scheduler.is_healthy) and time.monotonic() < deadline:
            time.sleep(0.2)
        out["worker_healthy"], out["scheduler_healthy"] = worker.is_healthy, scheduler.is_healthy
    if phase in ("lookup", "restart"):
        found = out["found_tokens"] = lookup("req-lookup")
        if found:
            for t in kv.values():
                t.zero_()
            worker.submit_retrieve_request("req-lookup", LoadStoreOp(token_ids=prompt, block_ids=blocks_all, start=0,
                                                                     end=found), NoEvent())
            finished("req-lookup", store=False)
            first = next(iter(kv.values()))
            out["loaded"] = [int(first[0, b, 0, 0, 0].item()) for b in range(blocks)] == list(range(blocks))
    print(json.dumps(out), flush=True)
    worker.shutdown()
    scheduler.shutdown()


if __name__ == "__main__":
    main()
