"""Register KV caches with a running `lmcache server` the way vLLM's LMCacheMPConnector worker does:
through LMCache's own LMCacheMPWorkerAdapter, with the kv_connector_extra_config the operator renders
for vLLM. CPU tensors in vLLM's flash-attention layout stand in for the GPU's (no GPU here), so the
adapter takes its engine-driven shared-memory path, the one the rendered pod uses. Runs inside the
engine venv; prints REGISTERED <instance id> and stays connected until killed.

    python mp_worker_register.py 'KV_TRANSFER_CONFIG_JSON' MODEL_NAME
"""

from __future__ import annotations

import json
import sys
import time

import torch
import zmq
from lmcache.integration.vllm.vllm_multi_process_adapter import LMCacheMPWorkerAdapter, ParallelStrategy


def main() -> None:
    kv_transfer_config, model = json.loads(sys.argv[1]), sys.argv[2]
    extra = kv_transfer_config["kv_connector_extra_config"]
    url = f"{extra['lmcache.mp.host']}:{extra['lmcache.mp.port']}"
    strategy = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1, n_servers=1)
    adapter = LMCacheMPWorkerAdapter(url, zmq.Context.instance(), model, 16, strategy, extra_config=extra)
    # Per layer [2 (K, V), blocks, block_size, kv_heads, head_dim].
    kv = {f"model.layers.{i}.self_attn.attn": torch.zeros(2, 64, 16, 4, 128, dtype=torch.bfloat16) for i in range(4)}
    adapter.register_kv_caches(kv)
    print("REGISTERED", adapter.instance_id, flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
