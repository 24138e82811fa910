"""The disk tier kept across pod restarts, on the real node (issue 35): backend lmcache-server's pod, deleted and
recreated by its StatefulSet on the same node, finds its pod directory's chunk files where the earlier pod left them
(LMCache's fs_native L2 looks a chunk up by its file name, so a new server reads them); a spec change that changes
the disk fingerprint (chunkSize: the chunk hashes and sizes) rolls the pod, and its directory is emptied.
DiskTierReady says which, and why, from what the init step (the operator's image, as root) reported to kubelet.

The chunk files are written here as the stand-in server would (UID 1000, LMCache's file names): the stand-in engine
loads no KV. What LMCache itself does with kept files is read from its source (docs/disk-tier.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvtest import condition, node

pytestmark = pytest.mark.cluster

CHUNK = "meta-llama-SEP-Llama-3.1-8B-Instruct@0x01000000@0@" + "ab" * 16 + ".data"  # fs_native's name for a chunk


def pod_uid(demo, ns: str, name: str) -> str | None:
    pods = [p for p in demo.client.list("pods", ns) if p["metadata"]["name"] == name
            and not p["metadata"].get("deletionTimestamp")]
    return pods[0]["metadata"]["uid"] if pods else None


def disk_tier_says(demo, ns: str, name: str, reason: str, words: str, other_than: str | None = None) -> str:
    """Waits until DiskTierReady is True with `reason` and `words` in its message, for a pod other than
    `other_than` (a pod uid); returns that pod's uid."""
    def said():
        c = condition(demo.client.get("kvs", name, ns), "DiskTierReady")
        uid = pod_uid(demo, ns, f"{name}-0")
        if uid and uid != other_than and c.get("status") == "True" and c.get("reason") == reason \
                and words in c.get("message", ""):
            return uid
        return None
    return demo.wait_until(said, timeout=300, interval=1, message=f"DiskTierReady {reason}: {words!r}")


def chunk(d: Path, name: str, data: bytes) -> Path:
    f = d / name
    f.write_bytes(data)
    os.chown(f, 1000, 1000)  # as the server (UID 1000) writes them
    return f


def test_a_recreated_pod_keeps_its_chunks_until_the_fingerprint_changes(demo, node_ns, engine_image, disk_base):
    demo.client.create(node.serve_spec("w", engine_image, disk_base), node_ns)
    try:
        first = disk_tier_says(demo, node_ns, "w", "DirectoriesPrepared", "w-0 emptied: no owner marker")
        d = disk_base / node_ns / "w" / "w-0"
        marker = json.loads((d.parent / ".kvoffload-owner-w-0.json").read_text())
        assert marker["uid"] == demo.client.get("kvs", "w", node_ns)["metadata"]["uid"]
        assert {"chunkSize", "image", "kvDtype", "pythonHashSeed", "layout"} <= marker["fingerprint"].keys(), marker
        data = os.urandom(4096)
        kept = chunk(d, CHUNK, data)
        junk = chunk(d, CHUNK.replace(".data", ".tmp"), b"half-written")  # a killed writer's temporary file

        demo.client.delete("pods", "w-0", node_ns)  # the StatefulSet makes w-0 again, on this node (the only one)
        second = disk_tier_says(demo, node_ns, "w", "DirectoriesKept", "w-0 kept (4Ki): the same resource and "
                                "fingerprint", other_than=first)
        assert second != first
        assert kept.read_bytes() == data and kept.stat().st_uid == 1000  # the very file, untouched
        assert not junk.exists()  # not a chunk file: removed
        assert (d.stat().st_uid, d.stat().st_mode & 0o777) == (1000, 0o750)

        # A fingerprint-changing change: other chunk boundaries give other hashes and sizes.
        demo.client.patch("kvs", "w", {"spec": {"offload": {"chunkSize": 512}}}, node_ns)
        disk_tier_says(demo, node_ns, "w", "DirectoriesPrepared",
                       "w-0 emptied: the fingerprint changed (chunkSize)", other_than=second)
        assert not kept.exists()
        assert all(not p.name.endswith(".data") for p in d.iterdir()), sorted(p.name for p in d.iterdir())
    finally:
        demo.client.delete("kvs", "w", node_ns, missing_ok=True)
