"""The slim stand-in engine's KV events are vLLM's bytes: tests/fixtures/fake_vllm/vllm/distributed/kv_events.py (the
STAND-IN module the image holds instead of vLLM) and vLLM 0.26.0's own vllm.distributed.kv_events, in the engine
venv, encode the same batch of BlockStored / BlockRemoved / AllBlocksCleared to the same msgpack bytes, and vLLM's
decoder reads the stand-in's batch back. Skipped without the engine venv, unless KVO_REQUIRE_ENGINE=1."""

from __future__ import annotations

import subprocess

import engine_venv

MIRROR = engine_venv.ROOT / "tests" / "fixtures" / "fake_vllm" / "vllm" / "distributed" / "kv_events.py"
SCRIPT = r'''
import importlib.util, sys
import msgspec
from vllm.distributed import kv_events as real
spec = importlib.util.spec_from_file_location("standin_kv_events", sys.argv[1])
mirror = importlib.util.module_from_spec(spec); spec.loader.exec_module(mirror)

def batch(m):
    return m.KVEventBatch(ts=1.5, data_parallel_rank=0, events=[
        m.BlockStored(block_hashes=[7, 9], parent_block_hash=None, token_ids=list(range(32)), block_size=16,
                      lora_id=None, medium=m.MEDIUM_CPU, lora_name=None),
        m.BlockStored(block_hashes=[11], parent_block_hash=9, token_ids=list(range(16)), block_size=16, lora_id=None,
                      medium=m.MEDIUM_GPU, lora_name=None, group_idx=0),
        m.BlockRemoved(block_hashes=[7], medium=m.MEDIUM_GPU), m.AllBlocksCleared()])

enc = msgspec.msgpack.Encoder()
ours, theirs = enc.encode(batch(mirror)), enc.encode(batch(real))
assert ours == theirs, (ours, theirs)
back = msgspec.msgpack.Decoder(type=real.KVEventBatch).decode(ours)
assert back == batch(real), back
assert (mirror.MEDIUM_GPU, mirror.MEDIUM_CPU) == (real.MEDIUM_GPU, real.MEDIUM_CPU)
print("same bytes", len(ours))
'''


def test_the_standin_kv_events_encode_as_vllms():
    venv = engine_venv.require(engine_venv.PAIR_026.vllm, engine_venv.PAIR_026.lmcache)
    out = subprocess.run([str(venv / "bin" / "python"), "-c", SCRIPT, str(MIRROR)], capture_output=True, text=True,
                         timeout=300, env={"HOME": "/tmp", "PATH": "/usr/bin:/bin", "VLLM_NO_USAGE_STATS": "1",
                                           "DO_NOT_TRACK": "1"})
    assert out.returncode == 0 and "same bytes" in out.stdout, out.stderr[-3000:]
