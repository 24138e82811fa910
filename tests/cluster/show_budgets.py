"""Print each KVOffloadServe's conditions and computed budget (reads `kubectl get kvs -o json` on stdin)."""

import json
import sys

from kvoffload.api.quantity import human


def show(item: dict) -> None:
    status, name = item.get("status", {}), item["metadata"]["name"]
    print(f"\n{name}")
    for c in status.get("conditions", []):
        print(f"  {c['type']:<14} {c['status']:<8} {c['reason']}: {c['message'][:160]}")
    budget = status.get("budget")
    if not budget:
        return
    print(f"  KV bytes/token {budget['kvBytesPerToken']:,} ({human(budget['kvBytesPerToken'])}); "
          f"one max-length sequence {human(budget['kvBytesPerSequence'])}")
    for t in budget["tiers"]:
        print(f"  tier {t['name']:<5} {human(t['bytes']):>10}  "
              f"{t['tokens']:>12,} tokens  {t['sequences']:>6,} sequences")
    memory = budget["memory"]
    print(f"  memory request = limit {human(memory['limit'])}: "
          + " + ".join(f"{x['name']} {human(x['bytes'])}" for x in memory["terms"]))
    weights = budget.get("weights")
    if weights:
        print(f"  weights {human(weights['bytes'])}: ephemeral-storage request {human(weights['ephemeralStorage'])} "
              f"(weights volume {human(weights['volume'])}), start-up budget {weights['startupSeconds']} s")
    for r in budget.get("reload", []):
        flag = "  SLOWER than recompute" if r["slowerThanRecompute"] else ""
        print(f"  reload {r['tier']:<5} {r['reloadSeconds']:.3f}s vs recompute {r['recomputeSeconds']:.3f}s{flag}")


for entry in json.load(sys.stdin)["items"]:
    show(entry)
