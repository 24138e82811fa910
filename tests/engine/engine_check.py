"""The pinned engine's own checks, run inside the engine venv (tests/engine/build-venv.sh), never
inside the operator's: vLLM and LMCache are not operator dependencies.

    python engine_check.py table OUT.json        the flag table of this vLLM's `vllm serve` parser
    python engine_check.py check IN.json OUT.json  for every command line: vLLM's real `vllm serve`
                                                   parser, its serve validation and create_engine_config();
                                                   for every LMCache config: LMCache's own loader
    python engine_check.py serve-args serve MODEL ARGS...
                                                   one `vllm serve` command line through vLLM's parser and
                                                   serve validation: exit 2 with vLLM's error if it refuses
                                                   (the stand-in engine image checks its arguments so)

One process serves every case (importing vLLM takes ~20 s). No GPU here: vLLM's CPU platform is
selected the way vLLM's own `vllm bench` does it, and nothing touches the network (HF_HUB_OFFLINE).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import logging
import os
import sys
import tempfile
import traceback
from importlib.metadata import version

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")


def cpu_platform() -> None:
    """Without a GPU vLLM's platform is 'unspecified' and its config classes cannot infer a device;
    `vllm bench` switches to the CPU platform in exactly this way (vllm/entrypoints/cli/main.py)."""
    from vllm import platforms
    from vllm.platforms.cpu import CpuPlatform

    if platforms.current_platform.is_unspecified():
        platforms.current_platform = CpuPlatform()


@functools.cache
def serve_parser():
    """`vllm serve`'s parser, built as vllm/entrypoints/cli/main.py builds it (once: parsing leaves it as it was)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    root = FlexibleArgumentParser(description="vLLM CLI")
    subparsers = root.add_subparsers(required=False, dest="subparser")
    serve = ServeSubcommand()
    serve.subparser_init(subparsers)
    return root, subparsers.choices["serve"], serve


PROBES = ("7", "-1", "1.5", "1k", "abc", "true", "{}")


def _value_kind(action: argparse.Action) -> str | None:
    """What values the action's type converter accepts, found by calling it (not by its name)."""
    conv = action.type
    if conv is None or conv is str:
        return "string"
    accepted = set()
    for probe in PROBES:
        try:
            conv(probe)
            accepted.add(probe)
        except Exception:  # noqa: BLE001 - any refusal counts
            pass
    if accepted == {"7", "-1"}:
        return "int"
    if accepted == {"7", "-1", "1.5"}:
        return "float"
    return None  # something richer (JSON, human-readable sizes, ...): left to vLLM


def table() -> dict:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    _, parser, _ = serve_parser()
    # The deprecated actions: a class-wide set in vLLM 0.26.0, the parser's own in 0.33.0.
    deprecated = getattr(parser, "_deprecated", FlexibleArgumentParser.__dict__.get("_deprecated", set()))
    options = []
    for action in parser._actions:
        if not action.option_strings:
            continue
        takes_value = action.nargs != 0
        options.append({
            "option_strings": sorted(action.option_strings),
            "dest": action.dest,
            "takes_value": takes_value,
            "nargs": action.nargs,
            "choices": sorted(map(str, action.choices)) if action.choices is not None else None,
            "value": _value_kind(action) if takes_value else None,
            "deprecated": action in deprecated,
        })
    options.sort(key=lambda o: o["option_strings"])
    return {
        "vllm": version("vllm"),
        "generated_by": "tests/engine/engine_check.py table (vLLM's own `vllm serve` parser)",
        "allow_abbrev": parser.allow_abbrev,
        "prefix_chars": parser.prefix_chars,
        "positionals": [a.dest for a in parser._actions if not a.option_strings],
        "options": options,
    }


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}")


def _write_model(root: str, case_id: str, config: dict) -> str:
    path = os.path.join(root, f"model-{case_id}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def check_vllm(case: dict, root_dir: str) -> dict:
    """One rendered command line: vLLM's parser, its serve validation and create_engine_config()."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    root, _, serve = serve_parser()
    argv = list(case["argv"])
    assert argv[:2] == ["vllm", "serve"], argv[:2]
    model_dir = _write_model(root_dir, case["id"], case["model_config"])
    argv = ["serve", model_dir, *argv[3:]]  # the model id -> a local directory with its config.json
    env = case.get("env", {})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    err = io.StringIO()
    out: dict = {"id": case["id"]}
    try:
        with contextlib.redirect_stderr(err):
            args = root.parse_args(argv)
        serve.validate(args)
        args.model = args.model_tag  # as ServeSubcommand.cmd does
        config = AsyncEngineArgs.from_cli_args(args).create_engine_config(
            usage_context=UsageContext.OPENAI_API_SERVER)
        out.update(ok=True, parsed={
            "max_model_len": config.model_config.max_model_len,
            "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
            "world_size": config.parallel_config.world_size,
            "gpu_memory_utilization": config.cache_config.gpu_memory_utilization,
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "served_model_name": config.model_config.served_model_name,
            "cache_dtype": str(config.cache_config.cache_dtype),
            "dtype": str(config.model_config.dtype),
            "kv_connector": config.kv_transfer_config.kv_connector if config.kv_transfer_config else None,
            "kv_role": config.kv_transfer_config.kv_role if config.kv_transfer_config else None,
            "disable_hybrid_kv_cache_manager": config.scheduler_config.disable_hybrid_kv_cache_manager,
            "kv_connector_extra_config": (config.kv_transfer_config.kv_connector_extra_config
                                          if config.kv_transfer_config else None),
            "connector_class": _connector_class(config),
            "kv_events_config": (vars(config.kv_events_config).copy() if getattr(config, "kv_events_config", None)
                                 else None),
            "host": args.host, "port": args.port,
        })
        if case.get("native_pinned"):
            out["native_pinned"] = native_pinned(config, case["native_pinned"]["gpu_kv_bytes"])
    except SystemExit as exc:  # argparse refused the command line
        out.update(ok=False, stage="parse", error=err.getvalue().strip().splitlines()[-1:] or [str(exc)])
    except Exception as exc:  # noqa: BLE001 - report every refusal, keep going
        out.update(ok=False, stage="config", error=[f"{type(exc).__name__}: {exc}"],
                   trace=traceback.format_exc(limit=3))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out


def native_pinned(config, gpu_kv_bytes: int) -> dict:
    """What each worker's CPUOffloadingWorker would pin, from vLLM's own pieces: the layers' KV cache
    specs (vLLM's head count per worker and head size for this config), vLLM's KV cache config for
    them, build_offloading_config and CPUOffloadingSpec.num_blocks; the worker then allocates
    torch.zeros((num_blocks, page × blocks_per_chunk), pin_memory=True) per KV cache tensor."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    model, parallel, cache = config.model_config, config.parallel_config, config.cache_config
    cpu_block_size = cache.block_size
    cache.block_size = 16  # the CUDA platform's default (the CPU platform picks its own)
    dtype = kv_cache_dtype_str_to_dtype(cache.cache_dtype, model)  # as the GPU model runner does
    spec = FullAttentionSpec(block_size=cache.block_size, num_kv_heads=model.get_num_kv_heads(parallel),
                             head_size=model.get_head_size(), dtype=dtype)
    layers = model.get_num_layers(parallel)
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(layers)}
    (kv_cache_config,) = get_kv_cache_configs(config, [specs], [gpu_kv_bytes])
    offloading = build_offloading_config(config, kv_cache_config)
    cpu = CPUOffloadingSpec(offloading)
    per_tensor_page = spec.page_size_bytes * cpu.blocks_per_chunk
    return {"cpu_platform_block_size": cpu_block_size, "block_size": cache.block_size, "layers": layers,
            "world_size": offloading.parallel.world_size, "kv_heads_per_worker": spec.num_kv_heads,
            "kv_dtype": str(dtype), "page_size_bytes": spec.page_size_bytes, "blocks_per_chunk": cpu.blocks_per_chunk,
            "gpu_kv_cache_tensors": len(kv_cache_config.kv_cache_tensors), "num_blocks": cpu.num_blocks,
            "tensor_bytes": cpu.num_blocks * per_tensor_page}


def _connector_class(config) -> str | None:
    """The class vLLM's own KVConnectorFactory resolves for the engine config (what the workers build)."""
    if config.kv_transfer_config is None or config.kv_transfer_config.kv_connector is None:
        return None
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cls = KVConnectorFactory.get_connector_class(config.kv_transfer_config)
    return f"{cls.__module__}.{cls.__qualname__}"


def server_parser():
    """`lmcache server`'s parser, built as lmcache/cli/main.py builds it (every registered sub-command)."""
    from lmcache.cli.commands import ALL_COMMANDS

    root = argparse.ArgumentParser(prog="lmcache")
    subparsers = root.add_subparsers(dest="command")
    for cmd in ALL_COMMANDS:
        cmd.register(subparsers)
    return root


def check_server(case: dict) -> dict:
    """One rendered `lmcache server` command line: LMCache's own parser, then the same converters its
    `server` command runs before it starts (l1 size, eviction, transfer mode, L2 adapter JSON...)."""
    from lmcache.v1.distributed.config import parse_args_to_config
    from lmcache.v1.mp_observability.config import parse_args_to_observability_config
    from lmcache.v1.multiprocess.config import parse_args_to_http_frontend_config, parse_args_to_mp_server_config

    argv = list(case["argv"])
    assert argv[:2] == ["lmcache", "server"], argv[:2]
    err = io.StringIO()
    out: dict = {"id": case["id"]}
    try:
        with contextlib.redirect_stderr(err):
            args = server_parser().parse_args(argv[1:])
        mp = parse_args_to_mp_server_config(args)
        sm = parse_args_to_config(args)
        http = parse_args_to_http_frontend_config(args)
        parse_args_to_observability_config(args)
        mem = sm.l1_manager_config.memory_config
        out.update(ok=True, parsed={
            "host": mp.host, "port": mp.port, "chunk_size": mp.chunk_size,
            "supported_transfer_mode": mp.supported_transfer_mode,
            "l1_size_bytes": mem.size_in_bytes,
            # As parsed, before LMCache's platform fallback (this CPU host cannot pin, so LMCache turns
            # lazy L1 off here by itself; on a GPU host the parsed value is the one in force).
            "l1_use_lazy": bool(args.l1_use_lazy), "shm_name": mem.shm_name,
            "eviction_policy": sm.eviction_config.eviction_policy,
            "http_host": http.http_host, "http_port": http.http_port,
            "l2_adapters": [{"class": type(a).__name__, **{k: v for k, v in vars(a).items()
                                                           if isinstance(v, (str, int, float, bool))}}
                            for a in sm.l2_adapter_config.adapters],
            # None: LMCache builds no L2 eviction for the adapter, and max_capacity_gb bounds nothing.
            "l2_eviction": [vars(a.eviction_config) if a.eviction_config is not None else None
                            for a in sm.l2_adapter_config.adapters],
        })
    except SystemExit as exc:
        out.update(ok=False, stage="parse", error=err.getvalue().strip().splitlines()[-1:] or [str(exc)])
    except Exception as exc:  # noqa: BLE001
        out.update(ok=False, stage="config", error=[f"{type(exc).__name__}: {exc}"],
                   trace=traceback.format_exc(limit=3))
    return out


def check_lmcache(case: dict, root_dir: str) -> dict:
    """One rendered LMCache config file through LMCache's own loader; every warning it logs is kept."""
    from lmcache.v1.config import LMCacheEngineConfig

    path = os.path.join(root_dir, f"lmcache-{case['id']}.yaml")
    with open(path, "w") as f:
        f.write(case["text"])
    capture = _Capture()
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.startswith("lmcache")]
    for lg in loggers:
        lg.addHandler(capture)
    try:
        config = LMCacheEngineConfig.from_file(path)
        values = {k: getattr(config, k) for k in case["keys"]}
        return {"id": case["id"], "ok": True, "values": values, "warnings": capture.records}
    except Exception as exc:  # noqa: BLE001
        return {"id": case["id"], "ok": False, "error": [f"{type(exc).__name__}: {exc}"], "warnings": capture.records}
    finally:
        for lg in loggers:
            lg.removeHandler(capture)


def check(request: dict) -> dict:
    cpu_platform()
    import lmcache.v1.config  # noqa: F401 - creates LMCache's loggers before they are captured

    with tempfile.TemporaryDirectory() as root_dir:
        return {
            "versions": {"vllm": version("vllm"), "lmcache": version("lmcache"), "torch": version("torch")},
            "vllm": [check_vllm(c, root_dir) for c in request.get("vllm", [])],
            "lmcache": [check_lmcache(c, root_dir) for c in request.get("lmcache", [])],
            "server": [check_server(c) for c in request.get("server", [])],
        }


def serve_args(argv: list[str]) -> None:
    """What `vllm serve` does with a command line before it loads a model: parse, then validate."""
    root, _, serve = serve_parser()
    args = root.parse_args(argv)  # exits 2 with vLLM's own message on a refused flag or value
    serve.validate(args)


def main() -> None:
    mode, *paths = sys.argv[1:] or [""]
    if mode == "serve-args" and paths[:1] == ["serve"]:
        cpu_platform()
        serve_args(paths)
        return
    if mode == "table" and len(paths) == 1:
        cpu_platform()
        result = table()
    elif mode == "check" and len(paths) == 2:
        with open(paths.pop(0)) as f:
            result = check(json.load(f))
    else:
        sys.exit(__doc__)
    # A file, not stdout: vLLM logs to stdout.
    with open(paths[0], "w") as f:
        f.write(dumps(result))


def dumps(obj: dict) -> str:
    """Stable JSON with one list item per line (a flag table's diff shows the flags that changed)."""
    parts = []
    for key in sorted(obj):
        value = obj[key]
        if isinstance(value, list) and value and isinstance(value[0], dict):
            items = ",\n  ".join(json.dumps(v, sort_keys=True) for v in value)
            parts.append(f" {json.dumps(key)}: [\n  {items}\n ]")
        else:
            parts.append(f" {json.dumps(key)}: {json.dumps(value, sort_keys=True)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


if __name__ == "__main__":
    main()
