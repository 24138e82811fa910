"""Run inside an engine venv: LMCache's own L2 adapter, built from the rendered --l2-adapter JSON, across a restart.

`store`: a fresh adapter stores one chunk and reports its usage. `reload`: a new adapter (a new server process)
over the same directory looks the chunk up, loads it and reports its usage. Prints one JSON line.
Usage: python l2_restart_check.py ADAPTER_JSON BASE_PATH store|reload
"""

import json
import os
import sys
import time

import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

SIZE = 1 << 16


def memory_obj(fill: int) -> TensorMemoryObj:
    # 4 KiB-aligned, as the server's L1 buffers are: the rendered adapter writes with O_DIRECT, which refuses
    # (EINVAL) a buffer malloc placed anywhere else, and the store fails.
    raw = torch.empty(SIZE + 4096, dtype=torch.uint8)
    start = -raw.data_ptr() % 4096
    t = raw[start:start + SIZE]
    t.fill_(fill)
    md = MemoryObjMetadata(shape=t.shape, dtype=torch.uint8, address=0, phy_size=SIZE, ref_count=1,
                           fmt=MemoryFormat.KV_2LTD)
    return TensorMemoryObj(t, md, None)


def wait(poll):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = poll()
        if got is not None:
            return got
        time.sleep(0.01)
    raise TimeoutError("the adapter did not complete the task in 30 s")


def main() -> None:
    spec, base, phase = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    spec["base_path"] = base
    adapter = create_l2_adapter_from_registry(get_l2_adapter_config_class(spec["type"]).from_dict(spec))
    key = ObjectKey(chunk_hash=bytes.fromhex("ab" * 16), model_name="meta-llama/Llama-3.1-8B-Instruct",
                    kv_rank=0x01000000)
    out: dict = {"phase": phase}
    if phase == "store":
        task = adapter.submit_store_task([key], [memory_obj(7)])
        result = wait(lambda: adapter.pop_completed_store_tasks().get(task))
        out["stored"] = int(result) >= 0  # L2StoreResult: an int, the bytes written, -1 on failure
    else:
        task = adapter.submit_lookup_and_lock_task([key], {})
        found = wait(lambda: adapter.query_lookup_and_lock_result(task))
        out["found"] = found.popcount()
        target = memory_obj(0)
        task = adapter.submit_load_task([key], [target])
        loaded = wait(lambda: adapter.query_load_result(task))
        out["loaded"] = loaded.popcount()
        out["bytes_match"] = bool(torch.equal(target.raw_data, torch.full((SIZE,), 7, dtype=torch.uint8)))
        out["aligned"] = target.raw_data.data_ptr() % 4096 == 0
        adapter.submit_unlock([key])
    out["usage_bytes"] = adapter.get_usage().total_bytes_used
    out["files"] = sorted(os.listdir(base))
    adapter.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
