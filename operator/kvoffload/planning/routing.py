"""What the router is told about the tiers (spec.routing; docs/routing.md). Pure arithmetic over the Budget.

- A hit's credit in an offload tier: the share of the recompute time it saves. Reloading a max_model_len prefix
  from the tier takes reload_s, recomputing it recompute_s (Budget.reload, from status.budget.reloadFigures):
  credit = 1 - reload_s / recompute_s, and 0 when reloading is slower than recomputing, so such a tier never
  attracts a request (a GPU hit costs nothing to reload: credit 1, the router's own constant).
- cache_aware's per-replica budget (--max-tree-size): the tokens one replica holds in the tiers whose hits are
  worth having (the GPU tier, and each offload tier whose credit is above 0), so the router forgets a prefix when
  the replica can no longer serve it faster than recomputing, and a prefix left only in a tier slower than
  recompute no longer draws its requests there. Every computed chunk is stored to each offload tier (LMCache writes
  through; vLLM's native offload copies each block out), so the tiers hold overlapping prefixes, not disjoint ones:
  the largest worthwhile tier bounds what one replica serves from cache. The router's tree holds token ids, 8
  characters each (engine/router.TREE_CHARS_PER_TOKEN), whatever the text.
- spec.offload.server PerNode: the Budget's cpu and disk tiers are the node's shared server's L1 and L2, from which
  every replica on that node serves, so they count here as each replica's (the tree budget is that of the tiers a
  replica can reload from). vllm-router 0.1.17 has no notion of nodes (a tree and a KV index per worker): it cannot
  send a request to a replica because a node-mate computed its prefix. Such a request, placed by load on that node,
  hits anyway. Where k replicas share a node, each one's own prefixes are about 1/k of what the server holds, so the
  tree may remember prefixes the node has evicted: the bound is exact with one replica per node (the default spread).
"""

from __future__ import annotations

from ..engine import router as engine_router
from .sizing import Budget

OFFLOAD_TIERS = ("cpu", "disk")


def credit(budget: Budget, tier: str) -> float:
    """The credit of a hit in `tier` (cpu or disk); 0 when the tier is off or slower than recompute."""
    for est in budget.reload:
        if est.tier == tier:
            return 0.0 if est.slower_than_recompute else round(max(0.0, 1 - est.reload_s / est.recompute_s), 4)
    return 0.0


def credits(budget: Budget) -> dict[str, float]:
    """Each offload tier's credit (status.routing.credits; kv_aware's --kv-penalty-* flags)."""
    return {tier: credit(budget, tier) for tier in OFFLOAD_TIERS}


def cached_tokens(budget: Budget) -> int:
    """Tokens one replica can serve from cache: its largest tier among the GPU tier and the offload tiers whose hits
    beat recomputing (the tiers overlap: every chunk is written through to each)."""
    return max([budget.tier("gpu").tokens] + [budget.tier(t).tokens for t in OFFLOAD_TIERS if credit(budget, t) > 0])


def max_tree_size(budget: Budget) -> int:
    """cache_aware's --max-tree-size: the characters of token ids the router remembers per replica."""
    return max(1, cached_tokens(budget) * engine_router.TREE_CHARS_PER_TOKEN)
