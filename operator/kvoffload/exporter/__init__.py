"""`kvoffload exporter`: a sidecar beside vLLM that tells, per KV-cache tier, what the cache holds
and whether offloading works.

Inputs (each read so that a failure is counted, logged once and never fatal):
- vLLM's /metrics on localhost            -> `vllm_metrics`
- LMCache's prometheus multiprocess files -> `lmcache_metrics`
- the disk-tier directory (background, incremental) -> `disk_tier`
- the LMCache YAML the operator rendered  -> `capacity`

`collector` turns one look at those into `kvoffload_*` metric families; `server` serves them with
/healthz; `cli` wires the flags. The tests' stand-ins and launcher live in kvtest.exporter
(tests/support).
"""
