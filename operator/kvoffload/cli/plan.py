"""`kvoffload plan`: KV tokens per tier and pod memory for a model, without a cluster.

Options carry the names of the CRD fields and vLLM flags they stand for, and their defaults are the CRD's and the
operator's settings (one table each: api/crd.py, api/settings.py). `kvoffload plan -f FILE` plans KVOffloadServes as the
operator will: the same parse -> plan path, with the operator's settings (--operator-config).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, TypeVar

import yaml

from .. import backends
from ..api import crd, rules
from ..api import settings as settings_mod
from ..api.errors import ConfigError, InputError
from ..api.quantity import format_bytes, human, to_bytes
from ..controller import pipeline
from ..engine import images
from ..planning.catalog import ModelArch, resolve_model
from ..planning.sizing import (
    Bandwidths,
    Budget,
    MemoryDefaults,
    PlanInput,
    StorageDefaults,
    check,
    plan,
    prefill_from,
    prefill_tokens_per_s,
)
from .render import desired_from_file

DEFAULT_CONTEXT = 32768  # when the model's max_position_embeddings is not known

# The planner's input names (sizing.PlanInput, catalog) -> the option that sets each.
OPTION_FOR_INPUT = {
    "model": "--model",
    "architecture": "--layers/--kv-heads/--head-dim/--parameters",
    "layers": "--layers",
    "kv_heads": "--kv-heads",
    "attention_heads": "--attention-heads",
    "head_dim": "--head-dim",
    "params": "--parameters",
    "config_json": "--config-json",
    "kv_dtype": "--kv-cache-dtype",
    "max_model_len": "--max-model-len",
    "concurrency": "--max-num-seqs",
    "tp": "--tensor-parallel-size",
    "gpus": "--gpus",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "weight_dtype": "--dtype",
    "activation_reserve": "--activation-reserve",
    "prefill_tokens_per_s": "--prefill-tokens-per-second",
    "gpu_memory": "--gpu-memory",
    "engine_baseline": "--engine-baseline",
    "per_worker_overhead": "--per-worker-overhead",
    "staging_per_worker": "--staging-per-worker",
    "shm": "--shm",
    "headroom_percent": "--headroom-percent",
    "headroom_min": "--headroom-min",
    "cpu_size": "--cpu-size",
    "disk_size": "--disk-size",
    "cpu_read": "--cpu-read-gbps",
    "disk_read": "--disk-read-gbps",
    "chunk_size": "--chunk-size",
    "weight_download": "--download-mbps",
    "weight_load": "--disk-read-gbps",
    "backend": "--backend",
    "server_baseline": "--server-baseline",
    "shared": "--server",
}
# Weight dtypes: the CRD's spec.engine.dtype values (vLLM --dtype), and the planner's own (fp8 weights included).
DTYPES = {**pipeline.WEIGHT_DTYPE, "bf16": "bf16", "fp16": "fp16", "fp8": "fp8"}
KV_CACHE_DTYPES = (*crd.schema_at("model.kvDtype")["enum"], "fp16")

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


class _Help(argparse.HelpFormatter):
    """Shows a default once, and only when there is one (never "(default: None)")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text
                and action.option_strings):
            text += " (default: %(default)s)"
        return text


def _crd(path: str) -> Any:
    return crd.default_at(path)


def _setting(name: str) -> str:
    """Help for an option whose default is an operator setting: its name and value (--operator-config changes it)."""
    camel = settings_mod._camel(name)
    return f"(default: operator setting {camel}, {getattr(settings_mod.Settings(), name)})"


def _field(cls: Any, name: str) -> Any:
    return {f.name: f.default for f in dataclasses.fields(cls)}[name]


# The options that describe what to plan, and their defaults: -f takes none of them (the file says it all).
_PLAN_DEFAULTS: dict[str, Any] = {}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="size KV tiers and pod memory for a model", description=__doc__,
                              formatter_class=_Help)
    integer, count, number = _number(int, "an integer"), _number(_count, "an integer"), _number(float, "a number")
    src = p.add_argument_group("what to plan: a KVOffloadServe file, or the options below")
    src.add_argument("-f", "--filename", help="YAML file with KVOffloadServe documents ('-' "
                                              "for stdin), planned as the operator will")
    src.add_argument("--namespace", default="default", help="namespace for documents that name none (with -f)")
    src.add_argument("--operator-config", help="operator settings YAML (the chart's operator.config): the defaults of "
                                               "the memory terms, bandwidths and GPU memory below come from it")

    def opt(group: argparse._ArgumentGroup, *names: str, **kw: Any) -> None:
        action = group.add_argument(*names, **kw)
        _PLAN_DEFAULTS[action.dest] = action.default

    opt(p, "--model", help="spec.model.name: a Hugging Face id (see the "
                           "built-in catalog) or any name with --layers etc.")
    opt(p, "--max-model-len", type=integer,
        help="spec.engine.maxModelLen, vLLM --max-model-len: longest sequence in tokens "
              f"(default: the model's max_position_embeddings, else {DEFAULT_CONTEXT})")
    opt(p, "--max-num-seqs", type=integer, default=_crd("engine.maxNumSeqs"),
        help="spec.engine.maxNumSeqs, vLLM --max-num-seqs")
    opt(p, "--tensor-parallel-size", "-tp", type=integer, default=_crd("engine.tensorParallelSize"),
        help="spec.engine.tensorParallelSize, vLLM --tensor-parallel-size")
    opt(p, "--gpus", type=integer,
        help="GPUs per replica (default: --tensor-parallel-size; pipeline parallelism is not modelled)")
    opt(p, "--gpu-memory", help="spec.resources.gpuMemory: memory of one GPU (quantity) "
        + _setting("default_gpu_memory"))
    opt(p, "--gpu-memory-utilization", type=number, default=_crd("engine.gpuMemoryUtilization"),
        help="spec.engine.gpuMemoryUtilization, vLLM --gpu-memory-utilization")
    opt(p, "--cpu-size", default="0",
        help="spec.offload.cpu.size: pinned CPU tier per replica (quantity, all TP ranks together)")
    opt(p, "--disk-size", default="0", help="spec.offload.disk.size: disk tier per replica (quantity)")
    opt(p, "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=_crd("model.kvDtype"),
        help="spec.model.kvDtype, vLLM --kv-cache-dtype")
    opt(p, "--dtype", choices=tuple(DTYPES), default=_crd("engine.dtype"),
        help="spec.engine.dtype, vLLM --dtype (auto: bf16); fp8: fp8 weights")
    opt(p, "--chunk-size", type=integer, default=_crd("offload.chunkSize"),
        help="spec.offload.chunkSize: LMCache chunk, tokens")
    opt(p, "--backend", choices=backends.NAMES, default=backends.DEFAULT,
        help="spec.offload.backend: who holds the offload tiers (docs/backends.md)")
    opt(p, "--server", choices=rules.SERVER_PLACEMENTS, default=rules.SIDECAR,
        help="spec.offload.server: where --backend lmcache-server's LMCache server runs; PerNode sizes the node's "
             "shared server pod and replicas without the L1 (docs/shared-cache.md)")
    opt(p, "--activation-reserve", default=format_bytes(_field(PlanInput, "activation_reserve")),
        help="per-GPU memory kept for activations (quantity)")
    arch = p.add_argument_group("spec.model.architecture (wins over the catalog and --config-json)")
    for name in ("--layers", "--kv-heads", "--attention-heads", "--head-dim"):
        opt(arch, name, type=integer)
    opt(arch, "--parameters", type=count, help="parameter count, e.g. 8030261248 or 8.03e9")
    opt(arch, "--config-json", help="local path to the model's HF config.json")
    mem = p.add_argument_group("pod-memory terms, spec.resources (quantities)")
    opt(mem, "--engine-baseline", help="vLLM API server + engine core " + _setting("engine_baseline"))
    opt(mem, "--per-worker-overhead", help="each TP worker process " + _setting("per_worker_overhead"))
    opt(mem, "--staging-per-worker", help="pinned staging buffers per TP worker " + _setting("staging_per_worker"))
    opt(mem, "--server-baseline",
        help="LMCache server process, --backend lmcache-server " + _setting("server_baseline"))
    opt(mem, "--shm", help="/dev/shm size (default: 1Gi + 1Gi per TP rank)")
    opt(mem, "--headroom-percent", type=integer,
        help="headroom in percent of the terms " + _setting("headroom_percent"))
    opt(mem, "--headroom-min", default=format_bytes(_field(MemoryDefaults, "headroom_min")), help="least headroom")
    bw = p.add_argument_group("reload vs recompute (the figures behind each SLOWER verdict)")
    opt(bw, "--cpu-read-gbps", type=number, help="spec.offload.cpu.readGbps: pinned host->GPU copy, GB/s per GPU "
                                                  + _setting("cpu_read_gbps"))
    opt(bw, "--disk-read-gbps", type=number,
        help="spec.offload.disk.readGbps: disk read, GB/s (also the weights' read-back) "
              + _setting("disk_read_gbps"))
    opt(bw, "--prefill-tokens-per-second", type=number, help="prefill rate of one replica (default: operator setting "
                                                             "prefillTokensPerSecond, else derived from the model)")
    st = p.add_argument_group("weights and start-up")
    opt(st, "--download-mbps", type=number, default=Bandwidths().weight_download / 1e6,
        help="weight download rate in MB/s for the start-up budget")
    opt(st, "--weights-on-pvc", action="store_true",
        help="a PVC holds the weights (spec.model.cache): no pod volume for them")
    p.add_argument("--output", "-o", choices=("table", "json", "yaml"), default="table")
    p.set_defaults(func=run)


def _bytes(value: str | None, option: str, default: str | int | None) -> int | None:
    raw = default if value is None else value
    return None if raw is None else to_bytes(raw, option if value is not None else f"operator setting for {option}")


def _server_baseline(given: str | None, setting: str) -> int:
    """The LMCache server process's term, as the operator takes it for the image `plan` sizes (the default pair's):
    the setting raised to that LMCache's floor, and a smaller --server-baseline refused (api/spec.py does the same
    with spec.resources.serverBaseline)."""
    floor = images.server_baseline_floor(images.DEFAULT_PAIR.lmcache)
    floor_bytes = to_bytes(floor, "SERVER_BASELINE_FLOOR") if floor else 0
    if given is None:
        return max(to_bytes(setting, "operator setting for --server-baseline"), floor_bytes)
    value = to_bytes(given, "--server-baseline")
    if value < floor_bytes:
        raise ConfigError("--server-baseline", f"below {floor}, what LMCache {images.DEFAULT_PAIR.lmcache}'s server "
                                               f"process needs beside its CPU tier; set at least {floor}")
    return value


def build_input(args: argparse.Namespace, settings: settings_mod.Settings | None = None) -> PlanInput:
    s = settings or settings_mod.Settings()
    model = resolve_model(args.model, layers=args.layers, kv_heads=args.kv_heads, attention_heads=args.attention_heads,
                          head_dim=args.head_dim, params=args.parameters, config_json=args.config_json)

    def term(value: str | None, option: str, default: str) -> int:
        out = _bytes(value, option, default)
        assert out is not None
        return out

    memory = MemoryDefaults(
        engine_baseline=term(args.engine_baseline, "--engine-baseline", s.engine_baseline),
        per_worker_overhead=term(args.per_worker_overhead, "--per-worker-overhead", s.per_worker_overhead),
        staging_per_worker=term(args.staging_per_worker, "--staging-per-worker", s.staging_per_worker),
        server_baseline=_server_baseline(args.server_baseline, s.server_baseline),
        shm=_bytes(args.shm, "--shm", None),
        headroom_percent=s.headroom_percent if args.headroom_percent is None else args.headroom_percent,
        headroom_min=term(args.headroom_min, "--headroom-min", args.headroom_min))
    disk_read = s.disk_read_gbps if args.disk_read_gbps is None else args.disk_read_gbps
    prefill = args.prefill_tokens_per_second
    if prefill is None:
        prefill = s.prefill_tokens_per_second or None
    bandwidths = Bandwidths(
        cpu_read=(s.cpu_read_gbps if args.cpu_read_gbps is None else args.cpu_read_gbps) * 1e9,
        disk_read=disk_read * 1e9,
        prefill_tokens_per_s=prefill,
        weight_download=args.download_mbps * 1e6,
        weight_load=disk_read * 1e9,
        cpu_read_from="--cpu-read-gbps" if args.cpu_read_gbps is not None else "operator setting cpuReadGbps",
        disk_read_from="--disk-read-gbps" if args.disk_read_gbps is not None else "operator setting diskReadGbps",
        prefill_from="--prefill-tokens-per-second" if args.prefill_tokens_per_second is not None else
        "operator setting prefillTokensPerSecond" if prefill
        else "--prefill-tokens-per-second or operator setting prefillTokensPerSecond")
    return PlanInput(
        model=model,
        max_model_len=args.max_model_len if args.max_model_len is not None else model.max_context or DEFAULT_CONTEXT,
        concurrency=args.max_num_seqs,
        gpu_memory=to_bytes(args.gpu_memory or s.default_gpu_memory, "--gpu-memory", allow_zero=False),
        gpus=args.gpus, tp=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        weight_dtype=DTYPES[args.dtype], kv_dtype=args.kv_cache_dtype,
        cpu_size=to_bytes(args.cpu_size, "--cpu-size"),
        disk_size=to_bytes(args.disk_size, "--disk-size"),
        chunk_size=args.chunk_size,
        backend=args.backend, shared=args.server == rules.SHARED,
        activation_reserve=to_bytes(args.activation_reserve, "--activation-reserve"),
        memory=memory, bandwidths=bandwidths, weights_on_pvc=args.weights_on_pvc, storage=StorageDefaults())


def _planned(args: argparse.Namespace) -> list[tuple[str, PlanInput, Budget]]:
    """(title, input, budget) per plan: each KVOffloadServe of -f, or the one the options describe."""
    if args.filename:
        given = [dest for dest, default in _PLAN_DEFAULTS.items() if getattr(args, dest) != default]
        if given:
            raise ConfigError("--filename", "plans the file as the operator will; set "
                              + ", ".join("--" + d.replace("_", "-") for d in given) + " in the file instead")
        return [(title, pipeline.plan_input(d.spec), d.budget)
                for title, d in desired_from_file(args.filename, args.namespace, args.operator_config)]
    if not args.model:
        raise ConfigError("--model", "is required (or -f FILE with KVOffloadServes)")
    settings = settings_mod.load(args.operator_config) if args.operator_config else None
    try:
        inp = build_input(args, settings)
        check(inp)
        return [("", inp, plan(inp).named(OPTION_FOR_INPUT))]
    except InputError as exc:
        raise exc.named(OPTION_FOR_INPUT) from None


def run(args: argparse.Namespace) -> int:
    planned = _planned(args)
    if args.output == "table":
        print("\n\n".join((f"# {title}\n" if title else "") + render_table(inp, budget)
                          for title, inp, budget in planned))
        return 0
    docs = [{**({"resource": title} if title else {}), "inputs": inputs_dict(inp), **budget.to_dict()}
            for title, inp, budget in planned]
    doc: Any = docs[0] if len(docs) == 1 and not args.filename else docs
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
                           "prefillTokensPerSecond": round(prefill_tokens_per_s(inp), 4),
                           "cpuReadFrom": inp.bandwidths.cpu_read_from, "diskReadFrom": inp.bandwidths.disk_read_from,
                           "prefillFrom": prefill_from(inp)}}


def render_table(inp: PlanInput, b: Budget) -> str:
    m, L = inp.model, inp.max_model_len
    kv_dtype = inp.weight_dtype if inp.kv_dtype == "auto" else inp.kv_dtype
    window = f", {m.sliding_window_layers} layers windowed to {m.sliding_window} tokens" if m.sliding_window else ""
    lines = [
        f"model     {m.hf_id}: {m.layers} layers, {m.kv_heads} KV / {m.attention_heads} attention heads, "
        f"head_dim {m.head_dim}, {m.params / 1e9:.3g}B parameters{window}",
        f"engine    --max-model-len {L}, --max-num-seqs {inp.concurrency}, --tensor-parallel-size {inp.tp}, "
        f"{inp.weight_dtype} weights, {kv_dtype} KV, {human(inp.gpu_memory)} per GPU × {inp.gpu_memory_utilization}",
        f"offload   backend {inp.backend}",
        f"KV cache  {b.kv_bytes_per_token} B/token per replica ({human(b.kv_bytes_per_token)}), "
        f"{b.kv_bytes_per_token_per_gpu} B/token per GPU; one {L}-token request: {human(b.kv_bytes_per_sequence)}",
        "",
        f"{'tier':<6}{'per replica':>14}{'per worker':>14}{'tokens':>14}{'sequences':>11}",
    ]
    for t in b.tiers:
        lines.append(f"{t.name:<6}{human(t.bytes):>14}{human(t.bytes_per_worker):>14}{t.tokens:>14,}{t.sequences:>11,}")
    if b.shared:
        lines.append("cpu and disk: the node's shared LMCache server's L1 and L2 (--server PerNode), held once per "
                     "node for every replica there, not per replica")
    memory = (f"memory request = limit: {format_bytes(b.memory_limit)} ({human(b.memory_limit)})"
              if b.memory_request == b.memory_limit else
              f"memory request: {format_bytes(b.memory_request)} ({human(b.memory_request)}), limit: "
              f"{format_bytes(b.memory_limit)} ({human(b.memory_limit)})")
    lines += ["", f"{memory}, /dev/shm {format_bytes(b.shm)}"]
    lines += [f"  {t.name:<16}{human(t.bytes):>12}  {t.note}" for t in b.memory_terms]
    w = b.weights
    lines += ["", f"local disk (ephemeral-storage request): {format_bytes(w.ephemeral_storage)} "
                  f"({human(w.ephemeral_storage)})"]
    lines += [f"  {t.name:<16}{human(t.value):>12}  {t.note}" for t in w.storage_terms]
    lines += [f"start-up probe budget: {w.startup_seconds} s ({w.startup_seconds / 60:.3g} min)"]
    lines += [f"  {t.name:<16}{t.value:>10} s  {t.note}" for t in w.startup_terms]
    if b.shared:
        lines += ["", f"shared LMCache server pod, one per node with replicas: request = limit "
                      f"{format_bytes(b.server_memory)} ({human(b.server_memory)})"]
        lines += [f"  {t.name:<16}{human(t.bytes):>12}  {t.note}" for t in b.server_memory_terms]
    elif b.server_memory:
        lines += ["", f"LMCache server container request: {format_bytes(b.server_memory)} ({human(b.server_memory)}), "
                      f"limit: {format_bytes(b.server_memory_limit)} ({human(b.server_memory_limit)}, + the L1)"]
        lines += [f"  {t.name:<16}{human(t.bytes):>12}  {t.note}" for t in b.server_memory_terms]
    if b.reload:
        lines += ["", f"reload a {L}-token prefix vs recompute it:"]
        lines += [f"  {r.tier:<6}{human(r.bytes):>12}  reload {r.reload_s:8.3f} s  recompute {r.recompute_s:8.3f} s  "
                  f"{'SLOWER than recompute' if r.slower_than_recompute else 'ok'}" for r in b.reload]
        lines += [f"  {r.tier} read at {r.read_bytes_per_s / 1e9:.3g} GB/s ({r.read_from})" for r in b.reload]
        lines += [f"  recompute at {b.reload[0].prefill_tokens_per_s:,.0f} tokens/s ({b.reload[0].prefill_from})"]
    if b.warnings:
        lines += ["", "warnings:"] + [f"  - {w}" for w in b.warnings]
    return "\n".join(lines)

