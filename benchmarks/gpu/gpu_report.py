"""results.json of gpu_bench.py -> the markdown tables of docs/benchmarks.md ("GPU").

    python benchmarks/gpu/gpu_report.py RESULTS.json [RESULTS2.json ...] > report.md

Pure except `main` (which also asks `kvoffload plan` for its reload/recompute prediction with this
host's measured bandwidths, for the same prompt length, and with its built-in defaults).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from typing import Any

from kvoffload import backends

GiB = 2**30
PHASES = (("cold", "cold (first time)"), ("gpu", "again: prefix in GPU memory"),
          ("after_reset", "after POST /reset_prefix_cache"))


def med(rows: list[dict[str, Any]] | None, key: str = "ttft_s") -> float | None:
    vals = [r[key] for r in rows or [] if key in r]
    return statistics.median(vals) if vals else None


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.1f}x"


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / GiB:.1f} GiB"


def _n(rows: list[dict[str, Any]] | None) -> int:
    return len(rows or [])


def sources(rows: list[dict[str, Any]] | None) -> str:
    """Median prompt tokens by vLLM's source label: which tier served the phase."""
    if not rows:
        return "-"
    parts = [f"{k.replace('_', ' ')} {med(rows, k):,.0f}" for k in ("local_compute", "local_cache_hit",
                                                                    "external_kv_transfer")
             if (med(rows, k) or 0) > 0]
    return ", ".join(parts) or "none"


def ttft_table(runs: dict[str, Any], group: str) -> list[str]:
    con, base, disk = (runs.get(f"{k}-{group}", {}).get("phases", {}) for k in ("connector", "baseline", "disk"))
    lines = ["| phase | with the rendered LMCache config | tokens by source | same engine, no connector | tokens by "
             "source | no connector / with |",
             "|---|---|---|---|---|---|"]
    for key, label in PHASES:
        a, b = con.get(key), base.get(key)
        if a or b:
            lines.append(f"| {label} | {_s(med(a))} (n={_n(a)}) | {sources(a)} | {_s(med(b))} (n={_n(b)}) | "
                         f"{sources(b)} | {_ratio(med(b), med(a))} |")
    if disk.get("disk"):
        b = base.get("after_reset")
        lines.append(f"| disk tier alone (CPU tier too small, O_DIRECT, page cache dropped) | {_s(med(disk['disk']))} "
                     f"(n={_n(disk['disk'])}) | {sources(disk['disk'])} | {_s(med(b))} (recompute) | {sources(b)} | "
                     f"{_ratio(med(b), med(disk['disk']))} |")
        if disk.get("after_disk_reset"):
            lines.append(f"| the same prefix again after a reset (copied back to the CPU tier) | "
                         f"{_s(med(disk['after_disk_reset']))} (n={_n(disk['after_disk_reset'])}) | "
                         f"{sources(disk['after_disk_reset'])} | | | |")
    return lines


def disk_proof(run: dict[str, Any]) -> list[str]:
    lines = ["| rep | TTFT | tokens from LMCache (vLLM) | prompt KV bytes | LMCache 'Disk read size' lines / bytes | "
             "engine processes read_bytes | block devices read | LMCache retrieve throughput |",
             "|---|---|---|---|---|---|---|---|"]
    for i, (p, row) in enumerate(zip(run.get("disk_proof", []), run.get("phases", {}).get("disk", []))):
        lg = p["lmcache_log"]
        thr = ", ".join(f"{r['gbps']:.2f} GB/s" for r in lg.get("retrieved", [])) or "-"
        blk = ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in p.get("block_read_bytes", {}).items()) or "0"
        lines.append(f"| {i} | {row['ttft_s']:.3f} s | {row.get('external_kv_transfer', 0):,.0f} | "
                     f"{p['prompt_kv_bytes'] / 1e9:.2f} GB | {lg['disk_read_lines']} / "
                     f"{lg['disk_read_bytes'] / 1e9:.2f} GB | {p['proc_read_bytes'] / 1e9:.2f} GB | {blk} | {thr} |")
    return lines


def proven(p: dict[str, Any]) -> bool:
    """LMCache logged disk reads of at least half the prompt's KV bytes, and the engine's processes
    read at least that much from storage (O_DIRECT: no page cache) during the request."""
    want = 0.5 * p["prompt_kv_bytes"]
    return p["lmcache_log"]["disk_read_bytes"] >= want and p["proc_read_bytes"] >= want


def disk_verdict(run: dict[str, Any]) -> str:
    """Bytes came from disk iff LMCache logged disk reads of about the prompt's KV bytes and the
    engine's processes read about as many bytes from storage during that one request."""
    proofs = run.get("disk_proof", [])
    if not proofs:
        return "no disk run"
    ok = [proven(p) for p in proofs]
    return f"{sum(ok)} of {len(ok)} disk-phase requests proven to read from disk"


def memory_table(runs: dict[str, Any]) -> list[str]:
    lines = ["| run | computed pod limit | MemTotal-MemAvailable rise (peak) | Shmem rise (peak) | engine cgroup peak "
             "(memory.peak) | cgroup anon+shmem+kernel (peak) | engine RSS / PSS after the phases |",
             "|---|---|---|---|---|---|---|"]
    for tag, r in runs.items():
        m = r.get("memory", {})
        after = r.get("memory_after_phases", {})
        lines.append(f"| {tag} | {_gib(r.get('memory_limit'))} | {_gib(m.get('peak_used_rise'))} | "
                     f"{_gib(m.get('peak_shmem_rise'))} | {_gib(m.get('max_cg_peak'))} | "
                     f"{_gib(m.get('max_cg_anon_shmem_kernel'))} | "
                     f"{_gib(after.get('rss'))} / {_gib(after.get('pss'))} |")
    return lines


def memory_verdict(run: dict[str, Any]) -> str:
    if run.get("kind") != "connector":
        return "not the rendered tiers (no verdict): " + ("no connector" if run.get("kind") == "baseline"
                                                          else "smaller CPU tier")
    limit = run.get("memory_limit")
    m = run.get("memory", {})
    need = m.get("max_cg_anon_shmem_kernel") or m.get("peak_used_rise")
    if not limit or not need:
        return "not measured"
    share = need / limit
    verdict = "too small" if share > 1 else ("far too large" if share < 0.5 else "fits")
    return (f"non-reclaimable peak {need / GiB:.1f} GiB = {share:.0%} of the computed limit "
            f"{limit / GiB:.1f} GiB: {verdict}")


def per_rank(run: dict[str, Any]) -> list[str]:
    pw, dw = run.get("per_worker", {}), run.get("disk_by_worker", {})
    lines = ["| rank (worker_id) | lmcache:local_cache_usage | "
             "lmcache:local_storage_usage | chunk files on disk | bytes on disk |",
             "|---|---|---|---|---|"]
    for w in sorted(set(pw) | set(dw)):
        p, d = pw.get(w, {}), dw.get(w, {})
        lines.append(f"| {w} | {_gib(p.get('local_cache_usage'))} | {_gib(p.get('local_storage_usage'))} | "
                     f"{d.get('files', '-')} | {_gib(d.get('bytes'))} |")
    return lines


def checks_table(run: dict[str, Any]) -> list[str]:
    def f(x: float | None) -> str:
        if x is None:
            return "-"
        return f"{x:,.0f}" if abs(x) >= 1000 or x == int(x) else f"{x:.4g}"
    lines = ["| figure | exporter | engine (before..after) | engine source | agrees |", "|---|---|---|---|---|"]
    for c in run.get("checks", []):
        lo, hi = c["engine_lo"], c["engine_hi"]
        eng = "-" if lo is None else (f(lo) if lo == hi else f"{f(lo)}..{f(hi)}")
        lines.append(f"| `{c['metric']}{{{c['labels']}}}` | {f(c['exporter'])} | {eng} | {c['source']} | "
                     f"{ {True: 'yes', False: '**NO**', None: 'n/a'}[c['ok']] } |")
    return lines


def token_check(run: dict[str, Any]) -> str:
    """The token generated after each reload vs the one the same prompt gave from GPU memory (connector,
    baseline) or when computed cold (disk run): KV that came back wrong gives another token."""
    ph = run.get("phases", {})
    ref, reloads = ("gpu", ["after_reset"]) if "gpu" in ph else ("cold", ["disk", "after_disk_reset"])
    parts = []
    for b in reloads:
        got = [(x.get("output_token_ids"), y.get("output_token_ids")) for x, y in zip(ph.get(ref, []), ph.get(b, []))]
        got = [(x, y) for x, y in got if x is not None and y is not None]
        if got:
            parts.append(f"{b} = {ref}: {sum(x == y for x, y in got)}/{len(got)}")
    return "; ".join(parts) or "no tokens recorded"


def cold_cost_rows(runs: dict[str, Any], baseline: str) -> list[str]:
    """What storing into LMCache adds to a cold request, per LMCache setting (connector runs) against
    the same engine without the connector; and whether the reload stayed as fast. Only for a backend whose
    tiers live in the vLLM process (Backend.in_process): its config file takes the overrides and vLLM's log
    holds its store lines. A run without a backend predates the others: the default's."""
    base = med(runs.get(baseline, {}).get("phases", {}).get("cold"))
    lines = ["| run | LMCache overrides | cold | vs no connector | LMCache store per request (copy / put) | after "
             "reset (reload) | tokens |", "|---|---|---|---|---|---|---|"]
    for tag, r in runs.items():
        ph = r.get("phases", {})
        in_process = backends.get(r.get("backend", backends.DEFAULT)).in_process
        if r.get("kind") != "connector" or not ph.get("cold") or not in_process:
            continue
        cold = med(ph["cold"])
        over = next((c.split("overrides ", 1)[1] for c in r.get("changes", [])
                     if c.startswith("LMCache config overrides")), "-")
        cost = "-" if base is None or cold is None else f"+{(cold / base - 1) * 100:.1f} %"
        store = "-"
        if med(ph["cold"], "lmcache_store_ms") is not None:
            store = (f"{med(ph['cold'], 'lmcache_store_ms'):.0f} ms ({med(ph['cold'], 'lmcache_offload_ms'):.0f} / "
                     f"{med(ph['cold'], 'lmcache_put_ms'):.0f})")
        lines.append(f"| {tag} | `{over}` | {_s(cold)} | {cost} | {store} | "
                     f"{_s(med(ph.get('after_reset')))} | {token_check(r)} |")
    lines.append(f"| {baseline} | (no connector) | {_s(base)} | - | - | "
                 f"{_s(med(runs.get(baseline, {}).get('phases', {}).get('after_reset')))} (recompute) | |")
    return lines


def container_rows(runs: dict[str, Any]) -> list[str]:
    """Each container of each pod run under crun: its limit, peaks, OOM kills and exit code."""
    lines = ["| run | container | memory limit | memory.peak (max) | "
             "anon+shmem+kernel (max) | shmem (max) | OOM kills | exit |",
             "|---|---|---|---|---|---|---|---|"]
    for tag, r in runs.items():
        if r.get("runtime") != "crun":
            continue
        mems = {"vllm": {"limit": r.get("memory_limit"), **r.get("memory", {})}, **r.get("sidecar_memory", {})}
        for name, m in mems.items():
            ev = r.get("memory_events", {}).get(name, {})
            lines.append(f"| {tag} | {name} | {_gib(m.get('limit'))} | {_gib(m.get('max_cg_peak'))} | "
                         f"{_gib(m.get('max_cg_anon_shmem_kernel'))} | {_gib(m.get('max_cg_shmem'))} | "
                         f"{ev.get('oom_kill', '-')} | {r.get('exit_codes', {}).get(name, '-')} |")
    return lines


def pod_verdicts(run: dict[str, Any]) -> list[str]:
    """OOM kills, each container's peak against its limit, and (lmcache-server) how KV travelled and
    which container the L1's shared memory is charged to."""
    out = []
    kills = {n: e.get("oom_kill", 0) for n, e in run.get("memory_events", {}).items() if e.get("oom_kill", 0)}
    out.append("OOM-killed: " + ", ".join(f"{n} ({k}x)" for n, k in kills.items()) if kills else "no OOM kill")
    mems = {"vllm": {"limit": run.get("memory_limit"), **run.get("memory", {})}, **run.get("sidecar_memory", {})}
    for name, m in mems.items():
        if m.get("limit") and m.get("max_cg_peak"):
            share = m["max_cg_peak"] / m["limit"]
            out.append(f"{name}: memory.peak {m['max_cg_peak'] / GiB:.1f} GiB = {share:.0%} of its "
                       f"{m['limit'] / GiB:.1f} GiB limit")
    for name, f in run.get("sidecar_log_facts", {}).items():
        if f.get("transfer"):
            out.append(f"{name}: KV transfer {', '.join(sorted(set(f['transfer'])))}")
    shm = {n: m.get("max_cg_shmem", 0) for n, m in mems.items() if m.get("max_cg_shmem")}
    if len(shm) > 1:
        top = max(shm, key=shm.get)
        out.append(f"shared memory charged to {top} ({shm[top] / GiB:.1f} GiB; "
                   + ", ".join(f"{n} {v / GiB:.1f} GiB" for n, v in shm.items() if n != top) + ")")
    return out


def plan_rows(plans: dict[str, Any], runs: dict[str, Any], group: str) -> list[str]:
    """The plan's reload/recompute for the prompt vs the measured medians."""
    con, base, disk = (runs.get(f"{k}-{group}", {}).get("phases", {}) for k in ("connector", "baseline", "disk"))
    measured = {"cpu": med(con.get("after_reset")), "disk": med(disk.get("disk")), "recompute": med(base.get("cold"))}
    lines = ["| | plan, this host's bandwidths | plan, built-in defaults | measured TTFT (median) |",
             "|---|---|---|---|"]
    for tier in ("cpu", "disk"):
        cells = []
        for key in ("host", "defaults"):
            r = next((x for x in plans.get(key, {}).get("reload", []) if x["tier"] == tier), None)
            cells.append("-" if r is None else f"{r['reloadSeconds']:.3f} s")
        lines.append(f"| reload from {tier} | {cells[0]} | {cells[1]} | {_s(measured[tier])} |")
    rc = [next((x["recomputeSeconds"] for x in plans.get(k, {}).get("reload", [])), None) for k in ("host", "defaults")]
    lines.append(f"| recompute (prefill) | {_s(rc[0])} | {_s(rc[1])} | "
                 f"{_s(measured['recompute'])} (cold, no connector) |")
    return lines


def plan_argv(run: dict[str, Any], prompt_tokens: int, host: dict[str, Any] | None) -> list[str]:
    argv, lm = run["argv"], run.get("lmcache") or {}

    def flag(name: str) -> str | None:
        return argv[argv.index(name) + 1] if name in argv else None
    tp = int(flag("--tensor-parallel-size") or 1)
    out = ["--model", flag("--served-model-name") or "", "--max-model-len", str(prompt_tokens),
           "--tensor-parallel-size", str(tp),
           "--kv-cache-dtype", "fp8" if (flag("--kv-cache-dtype") or "").startswith("fp8") else "auto",
           "--gpu-memory-utilization", flag("--gpu-memory-utilization") or "0.9", "--gpu-memory", "141Gi",
           "--cpu-size", f"{float(lm.get('max_local_cpu_size', 0)) * tp}Gi",
           "--disk-size", f"{float(lm.get('max_local_disk_size', 0)) * tp}Gi", "-o", "json"]
    if host:
        if host.get("h2d_pinned_Bps"):
            out += ["--cpu-read-gbps", f"{host['h2d_pinned_Bps'] / 1e9:.3f}"]
        if host.get("disk_read_odirect_Bps"):
            out += ["--disk-read-gbps", f"{host['disk_read_odirect_Bps'] / 1e9:.3f}"]
    return out


def report(results: list[dict[str, Any]], plans: dict[str, dict[str, Any]]) -> str:
    runs: dict[str, Any] = {}
    host: dict[str, Any] = {}
    prompt = None
    for r in results:
        runs.update(r.get("runs", {}))
        host = host or r.get("host", {})
        prompt = prompt or r.get("args", {}).get("prompt_tokens")
    out = []
    versions = next((json.loads(i["output"].split("engine versions", 1)[1]) for r in runs.values()
                     for i in r.get("init", []) if "engine versions" in i.get("output", "")), {})
    for k in ("vllm", "lmcache", "torch"):
        if versions.get(k):
            host[f"{k}_version"] = versions[k]
    if host:
        torch = host.get("torch_version") or host.get("torch")
        out += [f"Host: {host.get('gpus')} x {host.get('name')}, {host.get('cpus')} cores, torch {torch}, "
                f"vLLM {host.get('vllm_version')}, LMCache {host.get('lmcache_version')}; pinned host->GPU "
                f"{(host.get('h2d_pinned_Bps') or 0) / 1e9:.1f} GB/s, "
                f"disk O_DIRECT read {(host.get('disk_read_odirect_Bps') or 0) / 1e9:.2f} GB/s.", ""]
    for group in sorted({t.split("-", 1)[1] for t in runs}):  # tp1, tp2, tp1-v1runner ...
        tp = int(group[2:].split("-", 1)[0])
        out += [f"### {group}: time to first token, {prompt:,}-token prompt of random ids, max_tokens 1 (medians)", ""]
        out += ttft_table(runs, group) + [""]
        if plans.get(group):
            out += [f"`kvoffload plan` for the same prompt ({group}) vs measured:",
                    ""] + plan_rows(plans[group], runs, group) + [""]
        disk = runs.get(f"disk-{group}")
        if disk and disk.get("disk_proof"):
            out += [f"Disk tier, {group}: {disk_verdict(disk)}.", ""] + disk_proof(disk) + [""]
        if tp > 1 and runs.get(f"connector-{group}"):
            out += [f"Per-rank split (connector run, {group}):", ""] + per_rank(runs[f"connector-{group}"]) + [""]
    out += ["### Host memory while the engine ran", ""] + memory_table(runs) + [""]
    out += [f"- {tag}: {memory_verdict(r)}" for tag, r in runs.items()] + [""]
    base = next((t for t, r in runs.items() if r.get("kind") == "baseline" and r.get("runtime") == "crun"), None)
    if base:
        out += ["### Cold-request cost of storing into LMCache, by setting", ""] + cold_cost_rows(runs, base) + [""]
    if any(r.get("runtime") == "crun" for r in runs.values()):
        out += ["### Each container under crun (the captured OCI spec's limits, enforced)",
                ""] + container_rows(runs) + [""]
        out += [f"- {tag}: tokens {token_check(r)}; " + "; ".join(pod_verdicts(r)) for tag, r in runs.items()
                if r.get("runtime") == "crun"] + [""]
    for tag, r in runs.items():
        if r.get("checks"):
            bad = [f"`{c['metric']}{{{c['labels']}}}`" for c in r.get("disagreements", [])]
            out += [f"### Exporter vs engine, {tag}: {len(bad)} disagreement(s){': ' + ', '.join(bad) if bad else ''}",
                    ""]
            out += checks_table(r) + [""]
        if r.get("error"):
            out += [f"**{tag} error:** {r['error']}", ""]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    results = [json.load(open(p)) for p in argv]
    plans: dict[str, dict[str, Any]] = {}
    host = next((r["host"] for r in results if r.get("host")), None)
    prompt = next((r["args"]["prompt_tokens"] for r in results), 32768)
    for r in results:
        for tag, run in r.get("runs", {}).items():
            if tag.startswith("connector-") and run.get("lmcache"):
                tp = tag.split("-", 1)[1]
                plans[tp] = {}
                for key, h in (("host", host), ("defaults", None)):
                    p = subprocess.run([sys.executable, "-m", "kvoffload.cli", "plan", *plan_argv(run, prompt, h)],
                                       capture_output=True, text=True)
                    if p.returncode == 0:
                        plans[tp][key] = json.loads(p.stdout)
                        plans[tp][key]["argv"] = plan_argv(run, prompt, h)
    print(report(results, plans))
    for tp, p in plans.items():
        for key, doc in p.items():
            print(f"\n<!-- plan TP {tp} {key}: kvoffload plan {' '.join(doc['argv'])} -->")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
