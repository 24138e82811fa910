"""vLLM's command line, per vLLM version: which extra arguments the pinned vLLM accepts.

`data/vllm-<version>-flags.json` is generated from that vLLM's own `vllm serve` parser
(`make engine-tables`; a test regenerates it and compares). vLLM's FlexibleArgumentParser is
argparse with allow_abbrev, so `--kv-transfer` is read as `--kv-transfer-config` and `-t` as `-tp`:
a check by name alone misses those. `check_args` reads the arguments as that parser does and
refuses, naming the argument, the vLLM version and why:
- flags this vLLM does not have (e.g. `--swap-space`, `--disable-log-requests` in 0.26.0);
- abbreviations (allow_abbrev): spelt out they may be fine, abbreviated they silently become
  whatever flag they prefix, or a different one in the next vLLM;
- flags whose dest the operator sets, or that change the GPU count or the memory budget;
- `--no-disable-hybrid-kv-cache-manager` / `--enable-hybrid-kv-cache-manager` (0.33.0's spelling):
  LMCacheConnectorV1 does not support the hybrid manager;
- a value on a flag that takes none (`--enable-prefix-caching=False`), a missing value, a value
  outside the flag's choices or not a number where vLLM wants one, stray positional arguments.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..api.errors import ConfigError

DATA = Path(__file__).parent / "data"
FIELD = "spec.engine.extraArgs"

MANAGED = "the operator sets it from the spec"
# vLLM's KV block size on CUDA (its default). The operator counts in it: vllm-native's offload unit and the tier sizes
# it plans, and the block size the router indexes KV events in (spec.routing kv_aware, --kv-event-block-size).
BLOCK_TOKENS = 16
# Why a dest may not be set through extraArgs. Dests, not spellings: every alias of a dest is covered.
REFUSED_DESTS: dict[str, str] = {
    "model": MANAGED + " (spec.model.name)", "served_model_name": MANAGED + " (spec.model.servedName)",
    "host": MANAGED + " (the pod's probes and Service use it)", "port": MANAGED
    + " (the pod's probes and Service use it)",
    "max_model_len": MANAGED + " (spec.engine.maxModelLen)",
    "gpu_memory_utilization": MANAGED + " (spec.engine.gpuMemoryUtilization)",
    "max_num_seqs": MANAGED + " (spec.engine.maxNumSeqs)", "dtype": MANAGED + " (spec.engine.dtype)",
    "kv_cache_dtype": MANAGED + " (spec.model.kvDtype)",
    "kv_transfer_config": MANAGED + " (the LMCache connector; replacing it turns offloading off)",
    "tensor_parallel_size": MANAGED + " (spec.engine.tensorParallelSize; the pod asks for that many GPUs)",
    "pipeline_parallel_size": "it changes the GPU count (the pod asks for spec.engine.tensorParallelSize GPUs)",
    "prefill_context_parallel_size": "it changes the GPU count (vLLM's world size is TP x PP x PCP)",
    "cpu_offload_gb": "it changes the memory budget (weights in CPU memory the operator did not size)",
    "kv_cache_memory_bytes": "it changes the memory budget (overrides spec.engine.gpuMemoryUtilization's KV share)",
    "num_gpu_blocks_override": "it changes the memory budget (overrides the KV cache size vLLM measured)",
    "enable_shm_tensor_arena": "it changes the memory budget (vLLM 0.33's shared-memory "
                               "arena reserves /dev/shm the operator did not size)",
    "download_dir": "it moves the weights off the pod volume the operator "
                    "sized for them (HF_HOME, status.budget.weights)",
    "config": "it reads more flags from a file the operator cannot check",
    "help": "vLLM prints help and exits: the pod would restart forever",
    "headless": "it starts no API server: the pod's probes and Service would never answer",
    "api_key": "a literal key would sit in the pod spec: use spec.engine.apiKeySecretRef (VLLM_API_KEY from a Secret)",
    "hf_token": "a literal token would sit in the pod spec: use spec.model.hfTokenSecret (HF_TOKEN from a Secret)",
    # What clients or the engine could reach beyond the pod's contract (docs/security.md "vLLM flags").
    "allowed_local_media_path": "clients could read any file of the container below it through file:// media URLs",
    "kv_events_config": MANAGED + " (the KV event publisher the router reads, spec.routing, on a port it manages)",
    "uds": "vLLM would listen on a Unix socket instead of its port: the pod's probes and Service would never answer",
    "enable_ssl_refresh": "TLS on vLLM's port breaks the pod's HTTP probes "
                          "and the exporter's scrape: terminate TLS in front",
    "api_server_count": "it changes the memory budget (each API server is a process the operator did not size)",
    "nnodes": "multi-node serving: the pod is one node (spec.engine.tensorParallelSize GPUs)",
    "node_rank": "multi-node serving: the pod is one node (spec.engine.tensorParallelSize GPUs)",
    "master_addr": "multi-node serving: the pod is one node (spec.engine.tensorParallelSize GPUs)",
    "master_port": "multi-node serving: the pod is one node (spec.engine.tensorParallelSize GPUs)",
    "speculative_config": "it changes the memory budget (a draft model's "
                          "weights and KV cache the operator did not size)",
    "hf_overrides": "it changes the model's shape (layers, heads) the "
                    "KV bytes per token and the memory budget come from",
    "block_size": f"the operator counts in vLLM's {BLOCK_TOKENS}-token KV blocks (vllm-native's offload unit, the "
                  "router's KV index)",
}
REFUSED_DEST_PREFIXES: dict[str, str] = {
    "data_parallel_": "it changes the GPU count (data parallelism is spec.replicas: one pod per replica)",
    "kv_offloading_": "it changes the memory budget (a second KV offload path beside LMCache's tiers)",
    "offload_": "it changes the memory budget (weights offloaded into memory the operator did not size)",
    "cpu_offload_": "it changes the memory budget (weights in CPU memory the operator did not size)",
    "grpc": "a gRPC server (--grpc, and 0.33's --grpc-port) that the pod's probes, Service, NetworkPolicy and API key "
            "do not cover",
    "ssl_": "TLS on vLLM's port breaks the pod's HTTP probes and the exporter's scrape: terminate TLS in front",
}
HYBRID = "LMCacheConnectorV1 does not support vLLM's hybrid KV cache manager"
REFUSED_SPELLINGS: dict[str, str] = {  # the spellings that turn the hybrid manager back on: 0.26.0's, 0.33.0's
    "--no-disable-hybrid-kv-cache-manager": HYBRID, "--enable-hybrid-kv-cache-manager": HYBRID,
}
_NUMBER = re.compile(r"-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


@dataclass(frozen=True)
class Option:
    option_strings: tuple[str, ...]
    dest: str
    takes_value: bool
    nargs: int | str | None
    choices: tuple[str, ...] | None
    value: str | None  # "int", "float", "string", or None: richer (JSON, sizes), left to vLLM

    @property
    def name(self) -> str:
        """The flag's long spelling (--tensor-parallel-size for -tp)."""
        return next((s for s in self.option_strings if s.startswith("--") and not s.startswith("--no-")),
                    self.option_strings[0])


def refusal(option: Option, spelling: str) -> str | None:
    """Why the operator refuses this option (spelt `spelling`), or None."""
    if spelling in REFUSED_SPELLINGS:
        return REFUSED_SPELLINGS[spelling]
    if option.dest in REFUSED_DESTS:
        return REFUSED_DESTS[option.dest]
    return next((why for prefix, why in REFUSED_DEST_PREFIXES.items() if option.dest.startswith(prefix)), None)


@dataclass(frozen=True)
class FlagTable:
    vllm: str
    options: dict[str, Option]  # by every option string

    def refused_spellings(self) -> list[str]:
        """Every option string the operator refuses (for the API server's CEL rule)."""
        return sorted(s for s, o in self.options.items() if refusal(o, s))


def refused_spellings() -> tuple[str, ...]:
    """Every option string refused in any supported vLLM (for the API server's version-blind CEL rule)."""
    spellings = {s for v in supported_versions() for s in table(v).refused_spellings()}  # type: ignore[union-attr]
    return tuple(sorted(spellings))


def supported_versions() -> list[str]:
    return sorted((p.name.removeprefix("vllm-").removesuffix("-flags.json") for p in DATA.glob("vllm-*-flags.json")),
                  key=lambda v: tuple(int(x) for x in v.split(".")))


@functools.cache
def table(vllm: str) -> FlagTable | None:
    path = DATA / f"vllm-{vllm}-flags.json"
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    options: dict[str, Option] = {}
    for o in raw["options"]:
        opt = Option(tuple(o["option_strings"]), o["dest"], o["takes_value"], o["nargs"],
                     tuple(o["choices"]) if o["choices"] is not None else None, o["value"])
        options.update(dict.fromkeys(opt.option_strings, opt))
    return FlagTable(raw["vllm"], options)


def _spelling(arg: str) -> tuple[str, str | None, bool]:
    """(option string as vLLM's parser sees it, inline value, dotted JSON sub-key?): FlexibleArgumentParser
    turns `_` into `-` in a long flag's name and reads `--flag.key=v` as a key of the JSON flag `--flag`."""
    key, eq, value = arg.partition("=")
    dotted = "." in key
    key = key.split(".")[0]
    if key.startswith("--"):
        key = key.replace("_", "-")
    return key, (value if eq else None), dotted


def _looks_like_value(arg: str) -> bool:
    return not arg.startswith("-") or _NUMBER.fullmatch(arg) is not None


def check_args(args: tuple[str, ...] | list[str], vllm: str) -> None:
    """Refuse any extra argument that the vLLM `vllm` does not accept, or that would override the operator."""
    if not args:
        return
    flags = table(vllm)
    if flags is None:
        raise ConfigError(FIELD, f"vLLM {vllm} has no flag table in this operator (tables: "
                                 f"{', '.join(supported_versions())}), "
                                 "so extra arguments cannot be checked against it; use an image with a supported vLLM "
                                 "or leave extraArgs empty")
    i = 0
    while i < len(args):
        arg = args[i]
        where = f"{arg!r} (vLLM {vllm})"
        if arg == "--" or _looks_like_value(arg):
            raise ConfigError(FIELD, f"{where} is not a flag: vLLM takes the model as its only positional argument "
                                     "(the operator sets it), and a value must follow the flag that takes it")
        spelling, value, dotted = _spelling(arg)
        if spelling.startswith("-O") and not spelling.startswith("--"):  # -O3 is --optimization-level 3
            spelling, value = "--optimization-level", spelling[2:] or value
        option = flags.options.get(spelling)
        if option is None and not spelling.startswith("--") and len(spelling) > 2:
            short = flags.options.get(spelling[:2])  # -nX: a one-letter flag with its value attached
            if short is not None and short.takes_value:
                option, value = short, spelling[2:]
        if option is None:
            _unknown(flags, spelling, where)
        assert option is not None
        why = refusal(option, spelling)
        if why:
            raise ConfigError(FIELD, f"{where} sets {spelling if spelling in REFUSED_SPELLINGS else option.name}, "
                                     f"which extraArgs may not set: {why}")
        i += 1
        if not option.takes_value:
            if value is not None:
                longs = " or ".join(s for s in option.option_strings if s.startswith("--"))
                raise ConfigError(FIELD, f"{where}: {spelling} takes no value; write {longs} alone")
            continue
        values = [value] if value is not None else []
        if value is None:
            while i < len(args) and _looks_like_value(args[i]) and (not values or option.nargs in ("+", "*")):
                values.append(args[i])
                i += 1
        if not values and (option.nargs in (None, "+") or dotted):
            raise ConfigError(FIELD, f"{where}: {spelling} needs a value (as the next argument or {spelling}=VALUE)")
        for v in values:
            _check_value(option, spelling, v, where, dotted)


def _unknown(flags: FlagTable, spelling: str, where: str) -> None:
    # argparse's allow_abbrev: the option strings that start with what was written, one per flag.
    matches = sorted({flags.options[s].dest: s for s in sorted(flags.options, reverse=True)
                      if s.startswith(spelling)}.values())
    refused = [s for s in matches if refusal(flags.options[s], s)]
    if refused:
        option = flags.options[refused[0]]
        plain = refused[0] in REFUSED_SPELLINGS or refused[0] == option.name
        full = refused[0] if plain else f"{refused[0]} ({option.name})"
        raise ConfigError(FIELD, f"{where} abbreviates {full} (vLLM's parser accepts prefixes of flags), "
                                 f"which extraArgs may not set: {refusal(option, refused[0])}")
    if len(matches) > 1:
        raise ConfigError(FIELD, f"{where} is an ambiguous abbreviation "
                                 f"({', '.join(matches[:6])}{', ...' if len(matches) > 6 else ''}); "
                                 "write the whole flag")
    if matches:
        raise ConfigError(FIELD, f"{where} abbreviates {matches[0]}; write the whole flag (an abbreviation becomes "
                                 "another flag, or an error, when a later vLLM adds a flag with the same prefix)")
    close = difflib.get_close_matches(spelling, list(flags.options), n=3)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    raise ConfigError(FIELD, f"{where} is not a flag of vLLM {flags.vllm}'s `vllm serve` (vLLM would refuse the pod's "
                             f"command line){hint}")


def _check_value(option: Option, spelling: str, value: str, where: str, dotted: bool) -> None:
    if dotted:
        return  # a JSON sub-key: its value is JSON or a string, checked by vLLM's config classes
    if option.choices is not None and value not in option.choices:
        raise ConfigError(FIELD, f"{where}: {value!r} is not a value of {spelling}; allowed: "
                                 f"{', '.join(option.choices)}")
    convert = {"int": int, "float": float}.get(option.value or "")
    if convert is not None:
        try:
            convert(value)  # what vLLM's own converter accepts (the table's "value" was found by calling it)
        except ValueError:
            raise ConfigError(FIELD, f"{where}: {spelling} takes {'an integer' if convert is int else 'a number'}, "
                                     f"not {value!r}") from None


# vLLM refuses a KV connector with PyTorch's expandable segments (vllm/config/vllm.py,
# _verify_kv_transfer_compat): the pod would crash at start.
EXPANDABLE_SEGMENTS = re.compile(r"expandable_segments\s*:\s*True")


def check_env(env: Iterable[Mapping[str, object]], vllm: str) -> None:
    for var in env:
        if var.get("name") == "PYTORCH_CUDA_ALLOC_CONF" and EXPANDABLE_SEGMENTS.search(str(var.get("value", ""))):
            raise ConfigError("spec.engine.env", f"PYTORCH_CUDA_ALLOC_CONF={var.get('value')!r}: vLLM {vllm} refuses "
                                                 "expandable_segments:True with a KV connector (LMCacheConnectorV1)")


# From vLLM 0.33.0 on, an explicit 16-bit KV cache dtype must be the model's dtype
# (vllm/config/vllm.py:1492-1508, _reject_mismatched_float_kv_cache; vLLM 0.26.0 accepts the mix): the pod
# would crash at start. With spec.engine.dtype auto the model's own dtype decides (bf16 for the catalog).
MATCHING_KV_DTYPE_FROM = (0, 33, 0)


def check_dtypes(kv_dtype: str, dtype: str, vllm: str) -> None:
    if (kv_dtype == "bf16" and dtype not in ("auto", "bfloat16")
            and tuple(int(p) for p in vllm.split(".")) >= MATCHING_KV_DTYPE_FROM):
        raise ConfigError("spec.model.kvDtype", f"bf16 with spec.engine.dtype {dtype}: vLLM {vllm} refuses a bfloat16 "
                                                f"KV cache for a {dtype} model; allowed: kvDtype auto (the model's "
                                                "dtype) or fp8, or spec.engine.dtype bfloat16")
