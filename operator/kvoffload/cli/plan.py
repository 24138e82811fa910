"""`kvoffload plan`: KV tokens per tier and pod memory for a model, without a cluster."""

from __future__ import annotations

import argparse
import json
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, TypeVar

import yaml

from .. import backends
from ..api.errors import InputError
from ..api.quantity import format_bytes, human, to_bytes
from ..planning.catalog import ModelArch, resolve_model
from ..planning.sizing import Bandwidths, Budget, MemoryDefaults, PlanInput, check, plan, prefill_tokens_per_s

DEFAULT_CONTEXT = 32768  # when the model's max_position_embeddings is not known

# The planner's input names (sizing.PlanInput, catalog) -> the option that sets each.
OPTION_FOR_INPUT = {
    "model": "--model",
    "architecture": "--layers/--kv-heads/--head-dim/--params",
    "layers": "--layers",
    "kv_heads": "--kv-heads",
    "attention_heads": "--attention-heads",
    "head_dim": "--head-dim",
    "params": "--params",
    "config_json": "--config-json",
    "kv_dtype": "--kv-dtype",
    "max_model_len": "--context",
    "concurrency": "--concurrency",
    "tp": "--tp",
    "gpus": "--gpus",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "weight_dtype": "--dtype",
    "activation_reserve": "--activation-reserve",
    "prefill_tokens_per_s": "--prefill-tokens-per-s",
    "gpu_memory": "--gpu-memory",
    "engine_baseline": "--engine-baseline",
    "per_worker_overhead": "--worker-overhead",
    "staging_per_worker": "--staging-per-worker",
    "shm": "--shm",
    "headroom_percent": "--headroom-percent",
    "headroom_min": "--headroom-min",
    "cpu_size": "--cpu-tier",
    "disk_size": "--disk-tier",
    "cpu_read": "--cpu-read-gbps",
    "disk_read": "--disk-read-gbps",
    "chunk_size": "--chunk-size",
    "weight_download": "--download-mbps",
    "weight_load": "--disk-read-gbps",
    "backend": "--backend",
    "server_baseline": "--server-baseline",
}


T = TypeVar("T")


def _number(kind: Callable[[str], T], what: str) -> Callable[[str], T]:
    """argparse type that reports a bad value as argparse does (exit 2, naming the option)."""
    def parse(raw: str) -> T:
        try:
            return kind(raw)
        except (ValueError, InvalidOperation):
            raise argparse.ArgumentTypeError(f"{raw!r} is not {what}") from None
    return parse


def _count(raw: str) -> int:
    """An integer, also written as 8.03e9."""
    value = Decimal(raw)
    if value != value.to_integral_value():
        raise ValueError(raw)
    return int(value)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="size KV tiers and pod memory for a model",
                              description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    integer, count, number = _number(int, "an integer"), _number(_count, "an integer"), _number(float, "a number")
    p.add_argument("--model", required=True, help="Hugging Face id (see the built-in catalog) or any name with --layers etc.")
    p.add_argument("--context", type=integer, help=f"max model length in tokens (default: the model's, else {DEFAULT_CONTEXT})")
    p.add_argument("--concurrency", type=integer, default=1, help="max concurrent sequences (vLLM --max-num-seqs)")
    p.add_argument("--gpu-memory", default="80Gi", help="memory of one GPU (quantity)")
    p.add_argument("--gpus", type=integer, help="GPUs per replica (default: --tp)")
    p.add_argument("--tp", type=integer, default=1, help="tensor-parallel size")
    p.add_argument("--gpu-memory-utilization", type=number, default=0.9, help="vLLM --gpu-memory-utilization")
    p.add_argument("--cpu-tier", default="0", help="pinned CPU tier per replica (quantity, all TP ranks together)")
    p.add_argument("--disk-tier", default="0", help="disk tier per replica (quantity)")
    p.add_argument("--kv-dtype", default="auto", help="auto|bf16|fp16|fp8")
    p.add_argument("--dtype", default="bf16", help="weight dtype: bf16|fp16|fp8")
    p.add_argument("--chunk-size", type=integer, default=256, help="LMCache chunk size, tokens")
    p.add_argument("--backend", choices=backends.NAMES, default=backends.DEFAULT,
                   help="who holds the offload tiers (spec.offload.backend; docs/backends.md)")
    p.add_argument("--activation-reserve", default="2Gi", help="per-GPU memory kept for activations (quantity)")
    arch = p.add_argument_group("architecture overrides (win over the catalog and --config-json)")
    for opt in ("--layers", "--kv-heads", "--attention-heads", "--head-dim"):
        arch.add_argument(opt, type=integer)
    arch.add_argument("--params", type=count, help="parameter count, e.g. 8030261248 or 8.03e9")
    arch.add_argument("--config-json", help="local path to the model's HF config.json")
    mem = p.add_argument_group("pod-memory terms (quantities)")
    mem.add_argument("--engine-baseline", help="vLLM API server + engine core (default 4Gi)")
    mem.add_argument("--worker-overhead", help="per TP worker process (default 2Gi)")
    mem.add_argument("--staging-per-worker", help="pinned staging buffers per TP worker (default 1Gi)")
    mem.add_argument("--server-baseline", help="LMCache server process, --backend lmcache-server (default 2Gi)")
    mem.add_argument("--shm", help="/dev/shm size (default 1Gi + 1Gi per TP rank)")
    mem.add_argument("--headroom-percent", type=integer, help="headroom in percent of the terms (default 10)")
    mem.add_argument("--headroom-min", help="least headroom (default 1Gi)")
    bw = p.add_argument_group("reload vs recompute (defaults: measured on one H200 host)")
    bw.add_argument("--cpu-read-gbps", type=number, help="pinned host->GPU copy, GB/s per GPU")
    bw.add_argument("--disk-read-gbps", type=number, help="disk read, GB/s")
    bw.add_argument("--prefill-tokens-per-s", type=number, help="prefill rate of one replica")
    st = p.add_argument_group("weights and start-up")
    st.add_argument("--download-mbps", type=number, help="weight download rate in MB/s for the start-up budget (default 50)")
    st.add_argument("--weights-on-pvc", action="store_true", help="a PVC holds the weights (spec.model.cache): no pod volume for them")
    p.add_argument("--output", "-o", choices=("table", "json", "yaml"), default="table")
    p.set_defaults(func=run)


def build_input(args: argparse.Namespace) -> PlanInput:
    model = resolve_model(args.model, layers=args.layers, kv_heads=args.kv_heads, attention_heads=args.attention_heads,
                          head_dim=args.head_dim, params=args.params, config_json=args.config_json)
    d = MemoryDefaults()

    def opt(value: str | None, name: str, default: int | None) -> int | None:
        return default if value is None else to_bytes(value, name)

    memory = MemoryDefaults(
        engine_baseline=opt(args.engine_baseline, "--engine-baseline", d.engine_baseline),
        per_worker_overhead=opt(args.worker_overhead, "--worker-overhead", d.per_worker_overhead),
        staging_per_worker=opt(args.staging_per_worker, "--staging-per-worker", d.staging_per_worker),
        server_baseline=opt(args.server_baseline, "--server-baseline", d.server_baseline),
        shm=opt(args.shm, "--shm", d.shm),
        headroom_percent=d.headroom_percent if args.headroom_percent is None else args.headroom_percent,
        headroom_min=opt(args.headroom_min, "--headroom-min", d.headroom_min))
    b = Bandwidths()
    bandwidths = Bandwidths(
        cpu_read=b.cpu_read if args.cpu_read_gbps is None else args.cpu_read_gbps * 1e9,
        disk_read=b.disk_read if args.disk_read_gbps is None else args.disk_read_gbps * 1e9,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        weight_download=b.weight_download if args.download_mbps is None else args.download_mbps * 1e6,
        weight_load=b.weight_load if args.disk_read_gbps is None else args.disk_read_gbps * 1e9)
    return PlanInput(
        model=model,
        max_model_len=args.context if args.context is not None else model.max_context or DEFAULT_CONTEXT,
        concurrency=args.concurrency,
        gpu_memory=to_bytes(args.gpu_memory, "--gpu-memory", allow_zero=False),
        gpus=args.gpus, tp=args.tp,
        gpu_memory_utilization=args.gpu_memory_utilization,
        weight_dtype=args.dtype, kv_dtype=args.kv_dtype,
        cpu_size=to_bytes(args.cpu_tier, "--cpu-tier"),
        disk_size=to_bytes(args.disk_tier, "--disk-tier"),
        chunk_size=args.chunk_size,
        backend=args.backend,
        activation_reserve=to_bytes(args.activation_reserve, "--activation-reserve"),
        memory=memory, bandwidths=bandwidths, weights_on_pvc=args.weights_on_pvc)


def run(args: argparse.Namespace) -> int:
    try:
        inp = build_input(args)
        check(inp)
        budget = plan(inp).named(OPTION_FOR_INPUT)
    except InputError as exc:
        raise exc.named(OPTION_FOR_INPUT) from None
    if args.output == "table":
        print(render_table(inp, budget))
        return 0
    doc = {"inputs": inputs_dict(inp), **budget.to_dict()}
    print(json.dumps(doc, indent=2) if args.output == "json" else yaml.safe_dump(doc, sort_keys=False), end="\n")
    return 0


def _model_dict(m: ModelArch) -> dict[str, Any]:
    return {"name": m.hf_id, "layers": m.layers, "attentionHeads": m.attention_heads, "kvHeads": m.kv_heads,
            "headDim": m.head_dim, "parameters": m.params, "slidingWindow": m.sliding_window,
            "slidingWindowLayers": m.sliding_window_layers, "maxContext": m.max_context}


def inputs_dict(inp: PlanInput) -> dict[str, Any]:
    return {"model": _model_dict(inp.model), "maxModelLen": inp.max_model_len, "maxNumSeqs": inp.concurrency,
            "gpuMemory": inp.gpu_memory, "gpus": inp.gpus or inp.tp, "tensorParallelSize": inp.tp,
            "gpuMemoryUtilization": inp.gpu_memory_utilization, "dtype": inp.weight_dtype, "kvDtype": inp.kv_dtype,
            "cpuTier": inp.cpu_size, "diskTier": inp.disk_size, "chunkSize": inp.chunk_size, "backend": inp.backend,
            "activationReserve": inp.activation_reserve,
            "bandwidths": {"cpuReadBytesPerSecond": round(inp.bandwidths.cpu_read, 4),
                           "diskReadBytesPerSecond": round(inp.bandwidths.disk_read, 4),
                           "prefillTokensPerSecond": round(prefill_tokens_per_s(inp), 4)}}


def render_table(inp: PlanInput, b: Budget) -> str:
    m, L = inp.model, inp.max_model_len
    kv_dtype = inp.weight_dtype if inp.kv_dtype == "auto" else inp.kv_dtype
    window = f", {m.sliding_window_layers} layers windowed to {m.sliding_window} tokens" if m.sliding_window else ""
    lines = [
        f"model     {m.hf_id}: {m.layers} layers, {m.kv_heads} KV / {m.attention_heads} attention heads, "
        f"head_dim {m.head_dim}, {m.params / 1e9:.3g}B parameters{window}",
        f"engine    --context {L}, --concurrency {inp.concurrency}, --tp {inp.tp}, {inp.weight_dtype} weights, "
        f"{kv_dtype} KV, {human(inp.gpu_memory)} per GPU × {inp.gpu_memory_utilization}",
        f"offload   backend {inp.backend}",
        f"KV cache  {b.kv_bytes_per_token} B/token per replica ({human(b.kv_bytes_per_token)}), "
        f"{b.kv_bytes_per_token_per_gpu} B/token per GPU; one {L}-token request: {human(b.kv_bytes_per_sequence)}",
        "",
        f"{'tier':<6}{'per replica':>14}{'per worker':>14}{'tokens':>14}{'sequences':>11}",
    ]
    for t in b.tiers:
        lines.append(f"{t.name:<6}{human(t.bytes):>14}{human(t.bytes_per_worker):>14}{t.tokens:>14,}{t.sequences:>11,}")
    lines += ["", f"memory request = limit: {format_bytes(b.memory_limit)} ({human(b.memory_limit)}), /dev/shm {format_bytes(b.shm)}"]
    lines += [f"  {t.name:<16}{human(t.bytes):>12}  {t.note}" for t in b.memory_terms]
    w = b.weights
    lines += ["", f"local disk (ephemeral-storage request): {format_bytes(w.ephemeral_storage)} ({human(w.ephemeral_storage)})"]
    lines += [f"  {t.name:<16}{human(t.value):>12}  {t.note}" for t in w.storage_terms]
    lines += [f"start-up probe budget: {w.startup_seconds} s ({w.startup_seconds / 60:.3g} min)"]
    lines += [f"  {t.name:<16}{t.value:>10} s  {t.note}" for t in w.startup_terms]
    if b.server_memory:
        lines += ["", f"LMCache server container request: {format_bytes(b.server_memory)} ({human(b.server_memory)}), "
                      f"limit: {format_bytes(b.server_memory_limit)} ({human(b.server_memory_limit)}, + the L1)"]
        lines += [f"  {t.name:<16}{human(t.bytes):>12}  {t.note}" for t in b.server_memory_terms]
    if b.reload:
        lines += ["", f"reload a {L}-token prefix vs recompute it:"]
        lines += [f"  {r.tier:<6}{human(r.bytes):>12}  reload {r.reload_s:8.3f} s  recompute {r.recompute_s:8.3f} s  "
                  f"{'SLOWER than recompute' if r.slower_than_recompute else 'ok'}" for r in b.reload]
    if b.warnings:
        lines += ["", "warnings:"] + [f"  - {w}" for w in b.warnings]
    return "\n".join(lines)

