"""From `kvoffload render` output to local processes on a GPU host. Pure (no I/O but YAML text).

`parse_rendered` reads the rendered stream (ConfigMap + StatefulSet) into the vLLM container's exact
command, arguments and environment, the exporter sidecar's, the volumes and the memory limit.
`localize` turns that into argv/env/files for processes on this host, changing only what must
change outside a cluster, and lists every change (`LocalRun.changes`) so the report can show them:

- model: a local directory holding a config.json (written from the operator's catalog) with
  `--load-format dummy` (random weights of the right shapes) and `--skip-tokenizer-init`
  (prompts are token ids): no download;
- `--host 0.0.0.0` -> 127.0.0.1, `--port` -> a free local port, `$(POD_IP)` -> 127.0.0.1, downward-API
  env (POD_NAME, POD_NAMESPACE) -> the StatefulSet's first pod's values;
- every mounted volume -> a host directory (ConfigMap files written there, emptyDir fresh, the
  disk-tier hostPath -> the chosen disk directory), paths in args/env/LMCache config rewritten;
- `/dev/shm` (memory-backed emptyDir) is the host's /dev/shm;
- `vllm`/`kvoffload` console scripts -> `python -m` of the same entry points;
- VLLM_SERVER_DEV_MODE=1 (for POST /reset_prefix_cache) and the caller's extra env;
- the baseline ("no connector") drops `--kv-transfer-config` (backends lmcache, lmcache-server) or
  `--kv-offloading-backend`/`--kv-offloading-size` (vllm-native), runs no offload sidecar, and
  changes nothing else;
- native sidecars (init containers with restartPolicy Always: the lmcache-server backend's `lmcache
  server`) run as local processes started before vLLM, with their startup probe as the readiness
  check; `lmcache` -> `python -m lmcache.cli.main`; paths inside JSON arguments mapped too.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from kvoffload import backends

_UNITS = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
CONNECTOR_FLAG = "--kv-transfer-config"
# Flags (with their value) that turn offloading on, per how the operator renders it; the baseline drops them.
OFFLOAD_FLAGS = (CONNECTOR_FLAG, "--kv-offloading-backend", "--kv-offloading-size")
VLLM_ENTRY = ["-m", "vllm.entrypoints.cli.main"]
KVOFFLOAD_ENTRY = ["-m", "kvoffload.cli"]
CONSOLE_ENTRY = {"lmcache": ["-m", "lmcache.cli.main"], "vllm": VLLM_ENTRY, "kvoffload": KVOFFLOAD_ENTRY}


class ManifestError(ValueError):
    pass


def quantity(value: Any) -> int:
    """Kubernetes memory quantity (55194Mi, 2Gi, 128974848) -> bytes."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([KMGT]i?|k)?", str(value).strip())
    if not m:
        raise ManifestError(f"not a memory quantity: {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


@dataclass(frozen=True)
class Mount:
    volume: str
    path: str
    read_only: bool = False
    sub_path: str = ""  # subPath, or subPathExpr ($(VAR) from the container's env)


@dataclass(frozen=True)
class Container:
    name: str
    command: tuple[str, ...]
    args: tuple[str, ...]
    env: dict[str, str]  # literal values
    env_fields: dict[str, str]  # name -> downward-API fieldPath
    mounts: tuple[Mount, ...]
    memory_limit: int | None
    restart_policy: str | None = None  # "Always" on an init container: a native sidecar
    startup_probe: tuple[str, ...] = ()  # exec probe argv, if any
    image: str = ""
    security: dict[str, Any] = field(default_factory=dict)  # the pod's securityContext, then the container's over it
    cpu_request: str | None = None
    memory_request: int | None = None


@dataclass(frozen=True)
class Rendered:
    name: str
    namespace: str
    vllm: Container
    exporter: Container | None
    volumes: dict[str, dict[str, Any]]  # name -> pod volume source
    config_maps: dict[str, dict[str, str]]  # ConfigMap name -> data
    tp: int
    init: tuple[Container, ...] = ()  # run-to-completion init containers, in order
    sidecars: tuple[Container, ...] = ()  # native sidecars (restartPolicy Always), started before vLLM

    @property
    def backend(self) -> str:
        """spec.offload.backend, as the exporter sidecar is told (--backend); the exporter's default without one."""
        return (flag(self.exporter.args, "--backend") if self.exporter else None) or backends.DEFAULT

    def lmcache_config(self) -> dict[str, Any] | None:
        """The LMCache YAML the vLLM container would read (LMCACHE_CONFIG_FILE), parsed."""
        path = self.vllm.env.get("LMCACHE_CONFIG_FILE")
        if not path:
            return None
        for m in self.vllm.mounts:
            if path.startswith(m.path.rstrip("/") + "/"):
                source = self.volumes.get(m.volume, {})
                data = self.config_maps.get((source.get("configMap") or {}).get("name", ""), {})
                text = data.get(path[len(m.path.rstrip("/")) + 1:])
                if text is not None:
                    return yaml.safe_load(text) or {}
        raise ManifestError(f"LMCACHE_CONFIG_FILE {path} is not in a mounted ConfigMap")


def _container(c: dict[str, Any], pod_security: dict[str, Any] | None = None) -> Container:
    env, fields = {}, {}
    for e in c.get("env") or []:
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif "fieldRef" in (e.get("valueFrom") or {}):
            fields[e["name"]] = e["valueFrom"]["fieldRef"]["fieldPath"]
        else:
            raise ManifestError(f"container {c['name']}: env {e['name']} has a source this benchmark cannot resolve")
    limit = ((c.get("resources") or {}).get("limits") or {}).get("memory")
    request = ((c.get("resources") or {}).get("requests") or {}).get("memory", limit)  # a limit alone: the request too
    probe = ((c.get("startupProbe") or {}).get("exec") or {}).get("command") or ()
    return Container(name=c["name"], command=tuple(c.get("command") or ()),
                     args=tuple(str(a) for a in c.get("args") or ()),
                     env=env, env_fields=fields,
                     mounts=tuple(Mount(m["name"], m["mountPath"], bool(m.get("readOnly")), m.get("subPathExpr")
                                        or m.get("subPath") or "")
                                  for m in c.get("volumeMounts") or ()),
                     memory_limit=None if limit is None else quantity(limit), restart_policy=c.get("restartPolicy"),
                     startup_probe=tuple(str(a) for a in probe), image=c.get("image", ""),
                     security={**(pod_security or {}), **(c.get("securityContext") or {})},
                     cpu_request=((c.get("resources") or {}).get("requests") or {}).get("cpu"),
                     memory_request=None if request is None else quantity(request))


def flag(args: tuple[str, ...] | list[str], name: str) -> str | None:
    """Value of `--name value` or `--name=value` in an argument list."""
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def parse_rendered(text: str) -> Rendered:
    """The rendered YAML stream -> Rendered. Exactly one StatefulSet with a `vllm` container."""
    docs = [d for d in yaml.safe_load_all(text) if d]
    if any(d.get("kind") == "KVOffloadServe" for d in docs):
        raise ManifestError("this is a KVOffloadServe file; render it first (`kvoffload render -f FILE`)")
    sets = [d for d in docs if d.get("kind") == "StatefulSet"]
    if len(sets) != 1:
        raise ManifestError(f"expected one StatefulSet in the rendered stream, found {len(sets)}")
    sts = sets[0]
    pod = sts["spec"]["template"]["spec"]
    sec = pod.get("securityContext") or {}
    containers = {c["name"]: _container(c, sec) for c in pod["containers"]}
    if "vllm" not in containers:
        raise ManifestError(f"no container named vllm (found {', '.join(containers)})")
    vllm = containers["vllm"]
    tp = int(flag(exec_argv(vllm)[0], "--tensor-parallel-size") or 1)
    inits = [_container(c, sec) for c in pod.get("initContainers") or ()]
    return Rendered(name=sts["metadata"]["name"], namespace=sts["metadata"].get("namespace", "default"),
                    vllm=vllm, exporter=containers.get("exporter"),
                    volumes={v["name"]: {k: x for k, x in v.items() if k != "name"} for v in pod.get("volumes") or []},
                    config_maps={d["metadata"]["name"]: dict(d.get("data") or {}) for d in docs
                                 if d.get("kind") == "ConfigMap"},
                    tp=tp, init=tuple(c for c in inits if c.restart_policy != "Always"),
                    sidecars=tuple(c for c in inits if c.restart_policy == "Always"))


@dataclass(frozen=True)
class Layout:
    """Where things go on this host."""
    root: str  # work directory: volumes/<name>/ for every non-disk volume
    model_dir: str
    disk_dir: str  # the disk tier (the hostPath volume's per-pod sub-directory)
    port: int  # vLLM
    exporter_port: int
    python: str = "python3"


@dataclass(frozen=True)
class Sidecar:
    """A native sidecar as a local process: started before vLLM, ready when `probe` exits 0."""
    name: str
    argv: list[str]
    env: dict[str, str]  # to add to the inherited environment
    probe: list[str]  # its startupProbe's exec command (python3 -> layout.python); [] = none
    memory_limit: int | None


@dataclass
class LocalRun:
    engine_argv: list[str]
    engine_env: dict[str, str]  # to add to the inherited environment
    exporter_argv: list[str] | None
    exporter_env: dict[str, str]
    files: dict[str, str]  # host path -> content
    fresh_dirs: list[str]  # emptied before the run
    init_argvs: list[list[str]]  # init containers run as local processes, in order, before vLLM
    lmcache: dict[str, Any] | None  # the LMCache config as written
    lmcache_path: str | None
    multiproc_dir: str | None
    changes: list[str] = field(default_factory=list)
    sidecars: list[Sidecar] = field(default_factory=list)


def _volume_dirs(r: Rendered, layout: Layout) -> dict[str, str]:
    out = {}
    tmp = {m.volume for m in r.vllm.mounts if m.path.rstrip("/") == "/tmp"}
    for name, source in r.volumes.items():
        if "hostPath" in source:
            out[name] = layout.disk_dir
        elif name in tmp:
            # TMPDIR: LMCache binds ZMQ ipc sockets under it, whose paths may not exceed 107 characters
            # (sockaddr_un); a long work dir made LMCache's init fail at TP 2 on the H200.
            out[name] = f"/tmp/kvb-{layout.port}"
        elif (source.get("emptyDir") or {}).get("medium") == "Memory":
            out[name] = "/dev/shm"
        else:
            out[name] = f"{layout.root}/volumes/{name}"
    return out


def _mapper(mounts: tuple[Mount, ...], dirs: dict[str, str]):
    by_len = sorted(mounts, key=lambda m: len(m.path), reverse=True)

    def host(path: str) -> str:
        for m in by_len:
            base = m.path.rstrip("/")
            if path == base or path.startswith(base + "/"):
                return dirs[m.volume] + path[len(base):]
        return path
    return host


def _expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def _field_values(r: Rendered) -> dict[str, str]:
    return {"metadata.name": f"{r.name}-0", "metadata.namespace": r.namespace, "status.podIP": "127.0.0.1",
            "spec.nodeName": "localhost"}


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _configmap_files(r: Rendered, dirs: dict[str, str]) -> dict[str, str]:
    """ConfigMap volumes: host path -> content, in the volume's host directory."""
    files = {}
    for name, source in r.volumes.items():
        cm = (source.get("configMap") or {}).get("name")
        if cm is not None:
            for key, text in r.config_maps.get(cm, {}).items():
                files[f"{dirs[name]}/{key}"] = text
    return files


def _overridden(lmcache: dict[str, Any], overrides: dict[str, Any] | None, changes: list[str]) -> dict[str, Any]:
    if not overrides:
        return lmcache
    changes.append(f"LMCache config overrides {json.dumps(overrides, sort_keys=True)}")
    return _deep_merge(lmcache, overrides)


def _map_json_paths(value: str, host) -> str:
    """A JSON object argument (e.g. lmcache server --l2-adapter) with its absolute paths mapped."""
    try:
        doc = json.loads(value)
    except ValueError:
        return value
    if not isinstance(doc, dict):
        return value
    mapped = {k: host(v) if isinstance(v, str) and v.startswith("/") else v for k, v in doc.items()}
    return value if mapped == doc else json.dumps(mapped, sort_keys=True)


def _sidecar(c: Container, dirs: dict[str, str], fields: dict[str, str], python: str,
             changes: list[str]) -> Sidecar:
    host = _mapper(c.mounts, dirs)
    env = {k: host(v) if v.startswith("/") else v for k, v in c.env.items()}
    env.update({k: fields[p] for k, p in c.env_fields.items() if p in fields})
    cmd, prelude = exec_argv(c)
    if not cmd or cmd[0] not in CONSOLE_ENTRY:
        raise ManifestError(f"sidecar {c.name} runs {cmd[:1]}, expected one of {sorted(CONSOLE_ENTRY)}")
    if prelude:
        # A host process: its /dev/shm is the host's, where the prelude's file is no business of this run's.
        changes.append(f"sidecar {c.name}: its prelude {prelude!r} not run (a host process here)")
    args = []
    for a in cmd[1:]:
        x = _expand(a, env)
        y = host(x) if x.startswith("/") else _map_json_paths(x, host) if x.startswith("{") else x
        if y != a:
            changes.append(f"sidecar {c.name}: {a} -> {y}")
        args.append(y)
    changes.append(f"sidecar {c.name}: {cmd[0]} -> python -m {CONSOLE_ENTRY[cmd[0]][1]}, started before vLLM")
    probe = list(c.startup_probe)
    if probe[:1] in (["python3"], ["python"]):
        probe[0] = python
    return Sidecar(name=c.name, argv=[python, *CONSOLE_ENTRY[cmd[0]], *args], env=env, probe=probe,
                   memory_limit=c.memory_limit)


def exec_argv(c: Container) -> tuple[list[str], str | None]:
    """The argv the container finally runs (`vllm serve ARGS`, `lmcache server ARGS`), and its shell prelude if any.
    A rendered command may be `/bin/sh -c 'PRELUDE; exec "$0" "$@"' vllm serve` + args (vLLM's prelude empties the
    multiprocess dir at every container start, the server's removes a killed server's L1 segment): then $0 $@ is
    the argv."""
    cmd = list(c.command)
    if cmd[:2] in (["/bin/sh", "-c"], ["sh", "-c"]) and len(cmd) >= 4 and 'exec "$0" "$@"' in cmd[2]:
        return cmd[3:] + list(c.args), cmd[2]
    return cmd + list(c.args), None


def engine_args(args: list[str], extra_args: list[str] | None, kv_extra: dict[str, Any] | None,
                changes: list[str]) -> list[str]:
    """vLLM's arguments with a measurement's additions, each listed in `changes`: `kv_extra` merged into the
    --kv-transfer-config's kv_connector_extra_config (e.g. LMCache's lazy store), `extra_args` appended."""
    out = list(args)
    if kv_extra:
        if "--kv-transfer-config" not in out:
            raise ManifestError("--kv-extra: the rendered vLLM has no --kv-transfer-config (the baseline drops it)")
        i = out.index("--kv-transfer-config") + 1
        cfg = json.loads(out[i])
        cfg["kv_connector_extra_config"] = {**(cfg.get("kv_connector_extra_config") or {}), **kv_extra}
        out[i] = json.dumps(cfg, separators=(",", ":"))
        changes.append(f"--kv-transfer-config kv_connector_extra_config += {json.dumps(kv_extra, sort_keys=True)}")
    if extra_args:
        out += extra_args
        changes.append(f"vLLM arguments added: {' '.join(extra_args)}")
    return out


def localize(r: Rendered, layout: Layout, *, connector: bool = True, model_config: dict[str, Any] | None = None,
             lmcache_overrides: dict[str, Any] | None = None, extra_env: dict[str, str] | None = None,
             extra_args: list[str] | None = None, kv_extra: dict[str, Any] | None = None) -> LocalRun:
    dirs = _volume_dirs(r, layout)
    fields = _field_values(r)
    changes: list[str] = []
    v = r.vllm
    full, prelude = exec_argv(v)
    if full[:2] != ["vllm", "serve"]:
        raise ManifestError(f"vllm container runs {full[:2]}, expected ['vllm', "
                            "'serve'] (optionally after a sh -c prelude)")
    if prelude is not None:
        changes.append(f"shell prelude not run ({prelude!r}); the benchmark "
                       "empties every emptyDir volume before each run")
    host = _mapper(v.mounts, dirs)

    # Environment: literal values (paths mapped), downward-API fields resolved.
    env = {k: host(val) if val.startswith("/") else val for k, val in v.env.items()}
    env.update({k: fields[p] for k, p in v.env_fields.items() if p in fields})
    for k, val in v.env.items():
        if env[k] != val:
            changes.append(f"env {k}: {val} -> {env[k]}")
    env["VLLM_SERVER_DEV_MODE"] = "1"
    changes.append("env VLLM_SERVER_DEV_MODE=1 (POST /reset_prefix_cache)")
    for k, val in (extra_env or {}).items():
        env[k] = val
        changes.append(f"env {k}={val}")

    # Arguments: model -> local dir, host/port local, dummy weights, no tokenizer; baseline drops the connector.
    args = full[2:]
    if not args or args[0].startswith("-"):
        raise ManifestError("vllm serve has no model argument")
    model = args[0]
    args[0] = layout.model_dir
    changes.append(f"model {model} -> {layout.model_dir} (config.json only) "
                   "+ --load-format dummy --skip-tokenizer-init")
    out: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--host":
            out += [a, "127.0.0.1"]
            changes.append(f"--host {args[i + 1]} -> 127.0.0.1")
            i += 2
        elif a == "--port":
            out += [a, str(layout.port)]
            changes.append(f"--port {args[i + 1]} -> {layout.port}")
            i += 2
        elif a in OFFLOAD_FLAGS and not connector:
            changes.append(f"baseline: dropped {a} {args[i + 1]}")
            i += 2
        elif i == 0:  # the local model dir: a host path already (it may lie under a mounted /tmp)
            out.append(a)
            i += 1
        else:
            out.append(host(_expand(a, env)) if a.startswith("/") else _expand(a, env))
            i += 1
    if "--host" not in out:
        out += ["--host", "127.0.0.1"]
    if "--port" not in out:
        out += ["--port", str(layout.port)]
    out = engine_args(out, extra_args, kv_extra if connector else None, changes)
    out += ["--load-format", "dummy", "--skip-tokenizer-init"]
    engine_argv = [layout.python, *VLLM_ENTRY, "serve", *out]
    changes.append("vllm -> python -m vllm.entrypoints.cli.main")

    files = _configmap_files(r, dirs)
    fresh = sorted({d for d in dirs.values() if d != "/dev/shm"})
    lmcache = r.lmcache_config()
    lmcache_path = env.get("LMCACHE_CONFIG_FILE")
    if lmcache is not None and lmcache_path:
        local_disk = lmcache.get("local_disk")
        if local_disk:
            raw = str(local_disk)
            path = raw[len("file://"):] if raw.startswith("file://") else raw
            mapped = host(path.rstrip("/") or "/")
            lmcache["local_disk"] = ("file://" if raw.startswith("file://") else "") + mapped.rstrip("/") + "/"
            changes.append(f"LMCache local_disk {raw} -> {lmcache['local_disk']}")
        lmcache = _overridden(lmcache, lmcache_overrides, changes)
        files[lmcache_path] = yaml.safe_dump(lmcache, sort_keys=True)
    if model_config is not None:
        files[f"{layout.model_dir}/config.json"] = json.dumps(model_config, indent=2, sort_keys=True) + "\n"

    # Init containers: Python ones run locally (paths mapped); shell ones that empty volumes are what
    # the benchmark does itself before each run (fresh_dirs).
    init_argvs: list[list[str]] = []
    for c in r.init:
        if c.command[:1] in (("python3",), ("python",)):
            ih = _mapper(c.mounts, dirs)
            init_argvs.append([layout.python, *[ih(a) if a.startswith("/") else a for a in [*c.command[1:], *c.args]]])
            changes.append(f"init container {c.name}: run as {layout.python} with mapped paths")
        else:
            changes.append(f"init container {c.name} not run ({' '.join(c.command)[:60]}...): "
                           "the benchmark empties every volume before the run")

    sidecars = [_sidecar(c, dirs, fields, layout.python, changes) for c in r.sidecars] if connector else []
    if r.sidecars and not connector:
        changes.append(f"baseline: sidecars {', '.join(c.name for c in r.sidecars)} not run")

    exporter_argv, exporter_env = None, {}
    if r.exporter is not None:
        e = r.exporter
        if e.command[:1] != ("kvoffload",):
            raise ManifestError(f"exporter command is {list(e.command)}, expected ['kvoffload']")
        ehost = _mapper(e.mounts, dirs)
        eenv = dict(e.env)
        eenv.update({k: fields[p] for k, p in e.env_fields.items() if p in fields})
        eargs: list[str] = []
        i = 0
        while i < len(e.args):
            a = e.args[i]
            if a == "--listen":
                eargs += [a, f"127.0.0.1:{layout.exporter_port}"]
                changes.append(f"exporter --listen {e.args[i + 1]} -> 127.0.0.1:{layout.exporter_port}")
                i += 2
            elif a == "--vllm-metrics-url":
                url = re.sub(r"//[^/]+/", f"//127.0.0.1:{layout.port}/", e.args[i + 1], count=1)
                eargs += [a, url]
                if url != e.args[i + 1]:
                    changes.append(f"exporter --vllm-metrics-url {e.args[i + 1]} -> {url}")
                i += 2
            else:
                x = _expand(a, eenv)
                eargs.append(ehost(x) if x.startswith("/") else x)
                i += 1
        exporter_argv = [layout.python, *KVOFFLOAD_ENTRY, *e.command[1:], *eargs]
        exporter_env = {k: val for k, val in eenv.items()}

    return LocalRun(engine_argv=engine_argv, engine_env=env, exporter_argv=exporter_argv, exporter_env=exporter_env,
                    files=files, fresh_dirs=fresh, init_argvs=init_argvs, lmcache=lmcache, lmcache_path=lmcache_path,
                    multiproc_dir=env.get("PROMETHEUS_MULTIPROC_DIR"), changes=changes, sidecars=sidecars)


# ---------------------------------------------------------------- containers (gpu_pod: crun)

POD_IP = "127.0.0.1"  # the pod's network namespace has loopback only (gpu_pod)
MODEL_DIR = "kvbench-model"  # in the models volume: config.json for --load-format dummy


@dataclass(frozen=True)
class PodContainer:
    """One container of the rendered pod as a container runtime runs it: the rendered paths stay
    (volumes are mounted where the pod mounts them); only what `containerize` lists changes."""
    name: str
    role: str  # init | sidecar | main | exporter
    image: str
    argv: list[str]
    env: dict[str, str]
    mounts: dict[str, tuple[str, bool]]  # mountPath -> (host path, read-only), subPath(Expr) resolved
    memory_limit: int | None
    probe: list[str]  # exec startupProbe, run inside the container; [] = none
    security: dict[str, Any] = field(default_factory=dict)
    cpu_request: str | None = None
    memory_request: int | None = None


@dataclass
class PodRun:
    containers: list[PodContainer]
    volume_dirs: dict[str, str]  # volume -> host directory
    memory_volumes: dict[str, int | None]  # medium: Memory emptyDirs -> sizeLimit (a tmpfs of that size)
    files: dict[str, str]  # host path -> content
    fresh_dirs: list[str]
    lmcache: dict[str, Any] | None
    multiproc_dir: str | None  # host directory of PROMETHEUS_MULTIPROC_DIR
    disk_dir: str | None  # host directory the exporter's --disk-dir is
    port: int  # vLLM's, in the pod's network namespace
    exporter_port: int | None
    status_url: str | None  # the LMCache server's /status (lmcache-server)
    changes: list[str] = field(default_factory=list)
    host_path_volumes: tuple[str, ...] = ()

    def container(self, role: str) -> PodContainer | None:
        return next((c for c in self.containers if c.role == role), None)


def _pod_volume_dirs(volumes: dict[str, dict[str, Any]], root: str, disk_root: str,
                     host_paths: dict[str, str] | None = None) -> dict[str, str]:
    """Each volume's host directory: hostPath -> `host_paths[volume]`, else disk_root (the node's directory), others
    under root."""
    return {name: (host_paths or {}).get(name, disk_root) if "hostPath" in src else f"{root}/volumes/{name}"
            for name, src in volumes.items()}


def _env_of(c: Container, fields: dict[str, str]) -> dict[str, str]:
    env = dict(c.env)
    env.update({k: fields[p] for k, p in c.env_fields.items() if p in fields})
    return env


def _mounts_of(c: Container, env: dict[str, str], dirs: dict[str, str]) -> dict[str, tuple[str, bool]]:
    out = {}
    for m in c.mounts:
        missing = sorted({v for v in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", m.sub_path) if not env.get(v)})
        if missing:  # kubelet's ExpandContainerVolumeMounts: the container is never created
            raise ManifestError(f"container {c.name}: volumeMount {m.path} subPathExpr {m.sub_path!r}: missing value "
                                f"for {', '.join(missing)} (kubelet: CreateContainerConfigError)")
        sub = _expand(m.sub_path, env).strip("/")
        out[m.path.rstrip("/") or "/"] = (dirs[m.volume] + (f"/{sub}" if sub else ""), m.read_only)
    return out


def containerize(r: Rendered, root: str, disk_root: str, *, connector: bool = True,
                 model_config: dict[str, Any] | None = None, lmcache_overrides: dict[str, Any] | None = None,
                 extra_env: dict[str, str] | None = None, serving_env: dict[str, str] | None = None,
                 kept: dict[str, str] | None = None, extra_args: list[str] | None = None,
                 kv_extra: dict[str, Any] | None = None, host_paths: dict[str, str] | None = None,
                 pod_name: str | None = None) -> PodRun:
    """The rendered pod's containers for a container runtime. Changes, each listed in `changes`:
    the model -> a directory in the models volume holding config.json, + --load-format dummy
    --skip-tokenizer-init; downward-API values of the first pod (POD_IP: loopback); the
    $(VAR) expansion kubelet does in command and args; VLLM_SERVER_DEV_MODE=1 and `serving_env`
    (offline, no usage reports) for the serving image's containers and `extra_env` for vLLM; the
    LMCache config overrides; the baseline drops the offload flags and the sidecars. `kept` maps
    emptyDir volumes to host directories that outlive the run (vLLM's compile cache in home). `host_paths`: a host
    directory per hostPath volume (default: every one is disk_root); `pod_name`: another replica's name than the
    first's (downward API)."""
    fields = {**_field_values(r), "status.podIP": POD_IP, **({"metadata.name": pod_name} if pod_name else {})}
    dirs = {**_pod_volume_dirs(r.volumes, root, disk_root, host_paths), **(kept or {})}
    changes = [f"env from the downward API: {json.dumps(fields, sort_keys=True)}"]
    changes += [f"volume {n}: {d}, kept across runs (a new pod's emptyDir starts empty): start-up time only"
                for n, d in (kept or {}).items()]
    containers: list[PodContainer] = []

    def add(c: Container, role: str) -> PodContainer:
        env = _env_of(c, fields)
        if c.image == r.vllm.image:
            env.update(serving_env or {})
        argv = [_expand(a, env) for a in [*c.command, *c.args]]
        probe = [_expand(a, env) for a in c.startup_probe]
        pc = PodContainer(c.name, role, c.image, argv, env, _mounts_of(c, env, dirs), c.memory_limit, probe, c.security,
                          c.cpu_request, c.memory_request)
        containers.append(pc)
        return pc

    for c in r.init:
        add(c, "init")
    if connector:
        for c in r.sidecars:
            add(c, "sidecar")
    elif r.sidecars:
        changes.append(f"baseline: sidecars {', '.join(c.name for c in r.sidecars)} not run")
    main = add(r.vllm, "main")
    if r.exporter is not None:
        add(r.exporter, "exporter")
    if serving_env:
        changes.append(f"env of the serving image's containers: {json.dumps(serving_env, sort_keys=True)}")

    # vLLM: the model, dev mode, the baseline's flags.
    full, prelude = exec_argv(r.vllm)
    if full[:2] != ["vllm", "serve"]:
        raise ManifestError(f"vllm container runs {full[:2]}, expected ['vllm', "
                            "'serve'] (optionally after a sh -c prelude)")
    models = main.mounts.get(main.env.get("HF_HOME", "/models").rstrip("/"))
    if models is None:
        raise ManifestError("the vllm container mounts no volume at HF_HOME: nowhere to put the model's config.json")
    model_path = f"{main.env.get('HF_HOME', '/models').rstrip('/')}/{MODEL_DIR}"
    head = len(main.argv) - len(full)  # the sh -c prelude's words before $0
    argv = main.argv[:head]
    rest = main.argv[head + 2:]
    changes.append(f"model {rest[0]} -> {model_path} (config.json only) + --load-format dummy --skip-tokenizer-init")
    rest[0] = model_path
    i = 1
    args = [rest[0]]
    while i < len(rest):
        if rest[i] in OFFLOAD_FLAGS and not connector:
            changes.append(f"baseline: dropped {rest[i]} {rest[i + 1]}")
            i += 2
            continue
        args.append(rest[i])
        i += 1
    args = engine_args(args, extra_args, kv_extra if connector else None, changes)
    argv += ["vllm", "serve", *args, "--load-format", "dummy", "--skip-tokenizer-init"]
    env = {**main.env, "VLLM_SERVER_DEV_MODE": "1", **(extra_env or {})}
    changes.append("env VLLM_SERVER_DEV_MODE=1 (POST /reset_prefix_cache)")
    changes += [f"env {k}={v}" for k, v in (extra_env or {}).items()]
    containers[containers.index(main)] = main = dataclasses.replace(main, argv=argv, env=env)

    files = _configmap_files(r, dirs)
    lmcache = r.lmcache_config()
    cfg_path = main.env.get("LMCACHE_CONFIG_FILE")
    if lmcache is not None and cfg_path:
        lmcache = _overridden(lmcache, lmcache_overrides, changes)
        files[_host_path(main, cfg_path)] = yaml.safe_dump(lmcache, sort_keys=True)
    if model_config is not None:
        files[f"{models[0]}/{MODEL_DIR}/config.json"] = json.dumps(model_config, indent=2, sort_keys=True) + "\n"

    x = next((c for c in containers if c.role == "exporter"), None)
    port = int(flag(args, "--port") or 8000)
    exporter_port = int((flag(x.argv, "--listen") or ":9400").rsplit(":", 1)[1]) if x else None
    disk = flag(x.argv, "--disk-dir") if x else None
    status = flag(x.argv, "--lmcache-server-url") if x and connector and r.sidecars else None
    mp = main.env.get("PROMETHEUS_MULTIPROC_DIR")
    memory = {n: quantity(s["emptyDir"]["sizeLimit"]) if (s["emptyDir"] or {}).get("sizeLimit") else None
              for n, s in r.volumes.items() if (s.get("emptyDir") or {}).get("medium") == "Memory"}
    fresh = sorted({d for n, d in dirs.items() if "hostPath" not in r.volumes[n] and n not in (kept or {})}
                   | ({disk_root} if not host_paths else set()))
    return PodRun(containers=containers, volume_dirs=dirs, memory_volumes=memory, files=files, fresh_dirs=fresh,
                  lmcache=lmcache if connector else None, multiproc_dir=_host_path(main, mp) if mp else None,
                  disk_dir=_host_path(x, disk) if x and disk else None, port=port, exporter_port=exporter_port,
                  status_url=status, changes=changes,
                  host_path_volumes=tuple(n for n, src in r.volumes.items() if "hostPath" in src))


def plain_pod(doc: dict[str, Any], root: str, host_paths: dict[str, str], pod_name: str,
              serving_image: str, serving_env: dict[str, str] | None = None) -> PodRun:
    """A rendered Deployment's pod (PerNode's shared LMCache server: no vLLM) for a container runtime: its init
    containers, then its containers (the first one "main"), changing only the downward-API values (this pod's name,
    loopback IP) and, for the serving image's containers, `serving_env`; hostPath volumes -> `host_paths` (each must
    be named: nothing of the node's is emptied here), the others fresh under root."""
    pod = doc["spec"]["template"]["spec"]
    sec = pod.get("securityContext") or {}
    volumes = {v["name"]: {k: x for k, x in v.items() if k != "name"} for v in pod.get("volumes") or []}
    missing = sorted(n for n, v in volumes.items() if "hostPath" in v and n not in host_paths)
    if missing:
        raise ManifestError(f"hostPath volumes without a host directory: {', '.join(missing)}")
    meta = doc["metadata"]
    fields = {"metadata.name": pod_name, "metadata.namespace": meta.get("namespace", "default"),
              "status.podIP": POD_IP, "spec.nodeName": "localhost"}
    dirs = _pod_volume_dirs(volumes, root, "", host_paths)
    changes = [f"env from the downward API: {json.dumps(fields, sort_keys=True)}"]
    containers = []
    roles = [*(("init", c) for c in pod.get("initContainers") or ()),
             *(("main" if i == 0 else "sidecar", c) for i, c in enumerate(pod["containers"]))]
    for role, c in ((role, _container(x, sec)) for role, x in roles):
        env = _env_of(c, fields)
        if c.image == serving_image:
            env.update(serving_env or {})
        containers.append(PodContainer(c.name, role, c.image, [_expand(a, env) for a in [*c.command, *c.args]], env,
                                       _mounts_of(c, env, dirs), c.memory_limit,
                                       [_expand(a, env) for a in c.startup_probe], c.security, c.cpu_request,
                                       c.memory_request))
    if serving_env:
        changes.append(f"env of the serving image's containers: {json.dumps(serving_env, sort_keys=True)}")
    memory = {n: quantity(s["emptyDir"]["sizeLimit"]) if (s["emptyDir"] or {}).get("sizeLimit") else None
              for n, s in volumes.items() if (s.get("emptyDir") or {}).get("medium") == "Memory"}
    main = containers[len([c for c in containers if c.role == "init"])]
    http = flag(main.argv, "--http-port")
    return PodRun(containers=containers, volume_dirs=dirs, memory_volumes=memory, files={},
                  fresh_dirs=sorted(d for n, d in dirs.items() if "hostPath" not in volumes[n]), lmcache=None,
                  multiproc_dir=None, disk_dir=None, port=int(http or 0), exporter_port=None,
                  status_url=f"http://127.0.0.1:{http}/status" if http else None, changes=changes,
                  host_path_volumes=tuple(n for n, src in volumes.items() if "hostPath" in src))


def _host_path(c: PodContainer, path: str) -> str:
    """Where a path inside container c lies on the host (through its longest matching mount)."""
    for dest in sorted(c.mounts, key=len, reverse=True):
        if path == dest or path.startswith(dest.rstrip("/") + "/"):
            return c.mounts[dest][0] + path[len(dest.rstrip("/")):]
    raise ManifestError(f"container {c.name}: {path} is on no volume")


# Hugging Face config.json fields the catalog does not carry (it holds what KV sizing needs). Each
# entry's parameter count, recomputed by `params_of`, must equal the catalog's: a cross-check.
HF_EXTRA: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-3.1-8B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "vocab_size": 128256, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]},
    "Qwen/Qwen2.5-7B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "vocab_size": 152064, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
        "use_sliding_window": False, "bos_token_id": 151643, "eos_token_id": 151645},
}


def params_of(cfg: dict[str, Any]) -> int:
    """Parameter count of a Llama/Qwen2-style decoder from its config.json."""
    h, i, v, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    qkv_bias = cfg["model_type"] == "qwen2"
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h + ((heads + 2 * kv) * hd if qkv_bias else 0)
    per_layer = attn + 3 * h * i + 2 * h
    return v * h * (1 if cfg.get("tie_word_embeddings") else 2) + L * per_layer + h


def model_config(hf_id: str, layers: int, attention_heads: int, kv_heads: int, head_dim: int,
                 max_context: int | None, params: int) -> dict[str, Any]:
    """config.json for `--load-format dummy`: the catalog's KV-shaping facts + HF_EXTRA; checked."""
    extra = next((x for k, x in HF_EXTRA.items() if k.lower() == hf_id.lower()), None)
    if extra is None:
        raise ManifestError(f"no config.json fields for {hf_id}; pass --config-json (known: {', '.join(HF_EXTRA)})")
    cfg = {**extra, "num_hidden_layers": layers, "num_attention_heads": attention_heads,
           "num_key_value_heads": kv_heads, "head_dim": head_dim,
           "max_position_embeddings": max_context or 32768}
    if params_of(cfg) != params:
        raise ManifestError(f"{hf_id}: config gives {params_of(cfg)} parameters, the catalog {params}")
    return cfg


def kv_bytes_per_token(cfg: dict[str, Any], kv_cache_dtype: str) -> int:
    """Per replica: 2 x layers x KV heads x head_dim x bytes (fp8 1, else the model dtype's 2)."""
    per = 1 if kv_cache_dtype.startswith("fp8") else 2
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * hd * per
