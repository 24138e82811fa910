"""The OCI spec a real node's containerd generated for a container of the rendered pod, rewritten for
the GPU host (crun 1.8.1, cgroup v2, the host's Python as the image). Pure: no I/O.

Kept from the captured spec (what kubelet + containerd decided): process.user (uid, gid, groups
from fsGroup), capabilities, noNewPrivileges, oomScoreAdj, root.readonly, the runtime's own mounts
(/proc, /dev, /dev/pts, /dev/mqueue, /sys, /sys/fs/cgroup) with their options, every volume mount's
destination and options, linux.resources (memory limit, cpu), maskedPaths, readonlyPaths, seccomp,
sysctls, the namespaces' kinds. Changed, each one listed by `rewrite` (the results show them):
- ociVersion -> 1.0.2-dev: crun 1.8.1 refuses containerd 2.4's 1.3.0 (the fields used are 1.0's);
- root.path -> a directory of the GPU host whose /usr, /opt, /etc are the host's, read-only (the
  serving image cannot travel; the host's Python/torch and the carried wheels stand in for it);
- process.args/env -> the rendered container's (`gpu_manifests.containerize`), with the image
  environment of the stand-in image (PATH, LD_LIBRARY_PATH, PYTHONPATH of the host's Python);
- mount sources: kubelet's volume directories -> the host directories of the same volumes; the
  sandbox's /dev/shm, /etc/hosts, /etc/hostname, /etc/resolv.conf, /dev/termination-log -> files
  of this pod;
- the GPU as the NVIDIA container toolkit adds it (CDI): /dev/nvidia* in linux.devices and an allow
  rule for each in linux.resources.devices; the driver libraries are the host's /usr/local/nvidia,
  inside the read-only /usr;
- the network, IPC and UTS namespaces -> the pod's (paths given), as containers join the sandbox's;
- linux.cgroupsPath -> the captured pod cgroup's parent + the container's name (cgroup v2, cgroupfs);
- rlimits above the host's hard limit -> the host's hard limit; resources the host's cgroup v2 has no
  controller for (hugetlb) and cgroup v1-only memory fields -> dropped; an AppArmor profile the host
  does not have -> dropped.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

OCI_VERSION = "1.0.2-dev"
# Mounts the runtime makes itself (kept as captured), by destination.
RUNTIME_MOUNTS = ("/proc", "/dev", "/dev/pts", "/dev/mqueue", "/sys", "/sys/fs/cgroup")
# Files kubelet or containerd put into every container, by destination -> the pod file's name.
POD_FILES = {"/etc/hosts": "hosts", "/etc/hostname": "hostname", "/etc/resolv.conf": "resolv.conf",
             "/dev/termination-log": "termination-log"}
SANDBOX_SHM = "/dev/shm"
V1_ONLY_MEMORY = ("kernel", "kernelTCP", "swappiness", "disableOOMKiller")
JOINED = ("network", "ipc", "uts")


class SpecError(ValueError):
    pass


@dataclass(frozen=True)
class Device:
    path: str
    major: int
    minor: int
    mode: int = 0o666


@dataclass(frozen=True)
class Host:
    """What the rewrite needs to know of the GPU host (gathered by gpu_pod.host_facts)."""
    image_dirs: tuple[str, ...]  # host directories bound read-only into every root at the same path
    devices: tuple[Device, ...]  # /dev/nvidia*
    rlimit_hard: dict[str, int]  # RLIMIT_NOFILE -> the host's hard limit
    controllers: frozenset[str]  # cgroup v2 controllers of the host's root
    hugepage_sizes: frozenset[str] = frozenset()  # "2MB", "1GB"
    apparmor_profiles: frozenset[str] = frozenset()
    existing: frozenset[str] = frozenset()  # destinations under image_dirs that exist on the host
    swap_accounting: bool = True  # memory.swap.max exists in the pod's cgroup
    memory_capacity: int = 0  # MemTotal: kubelet's machine capacity, for oomScoreAdj


@dataclass(frozen=True)
class Placement:
    """Where this pod's things are on the host."""
    rootfs: str
    pod_files: str  # directory holding hosts, hostname, resolv.conf, termination-log-<container>
    sandbox_shm: str  # the sandbox's 64 MiB /dev/shm tmpfs
    namespaces: dict[str, str]  # network/ipc/uts -> namespace file
    image_env: dict[str, str]  # PATH, LD_LIBRARY_PATH, PYTHONPATH, ... of the stand-in image
    volume_mounts: dict[str, tuple[str, bool]]  # destination -> (host path, read-only): the rendered mounts
    cgroup_leaf: str  # the container's cgroup name under the captured pod cgroup
    memory_limit: int | None = None  # the rendered limit (replaces a captured one that differs, listed)
    # The rendered sizes kubelet derives the rest from (a capture on the CPU node is of a pod scaled down to fit
    # it, capture.for_cpu_node): CPU shares from the CPU request, oomScoreAdj from the memory request.
    cpu_shares: int | None = None
    oom_score_adj: int | None = None
    # The capture is of a pod of another shape (another backend): a rendered volume mount the capture
    # lacks is added with the options kubelet gives volume mounts, one the rendered pod lacks is dropped;
    # both listed. False: such a capture is refused.
    other_shape: bool = False
    hostname: str = ""  # the pod's (the runtime's HOSTNAME variable)
    changes: list[str] = field(default_factory=list)


def _env_list(env: dict[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in env.items()]


def _env_dict(env: list[str]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in env if "=" in e)


def pod_cgroup(spec: dict[str, Any]) -> str:
    """The captured container's pod-level cgroup ('/kubepods/burstable/pod<uid>'), cgroupfs style.
    systemd style ('kubepods-burstable-pod<uid>.slice:cri-containerd:<id>') is turned into the same."""
    path = (spec.get("linux") or {}).get("cgroupsPath") or ""
    if ":" in path:  # systemd driver: slice:prefix:name
        sl = path.split(":", 1)[0].removesuffix(".slice")
        parts = sl.split("-")
        return "/" + "/".join(parts[:i + 1][-1] for i in range(len(parts)))
    parent = path.rsplit("/", 1)[0]
    if not parent.startswith("/"):
        raise SpecError(f"linux.cgroupsPath {path!r}: not a cgroupfs path")
    return parent


def rewrite(spec: dict[str, Any], argv: list[str], env: dict[str, str], host: Host, at: Placement,
            name: str) -> tuple[dict[str, Any], list[str]]:
    """The captured spec of container `name`, for crun on the GPU host; and what changed."""
    s = copy.deepcopy(spec)
    ch: list[str] = []
    if s.get("ociVersion") != OCI_VERSION:
        ch.append(f"ociVersion {s.get('ociVersion')} -> {OCI_VERSION} (crun 1.8.1 knows OCI 1.0)")
        s["ociVersion"] = OCI_VERSION
    root = s.get("root") or {}
    s["root"] = {"path": at.rootfs, "readonly": bool(root.get("readonly"))}
    ch.append(f"root {root.get('path')} (image snapshot) -> {at.rootfs}: "
              f"the host's {', '.join(host.image_dirs)} read-only")

    p = s["process"]
    captured_env = _env_dict(p.get("env") or [])
    # kubelet's own variables (the kubernetes Service's, which enableServiceLinks=false keeps) and the
    # runtime's HOSTNAME stay; the rest that is not the rendered env came from the captured image.
    kept = {k: v for k, v in captured_env.items() if k.startswith("KUBERNETES_") or k == "HOSTNAME"}
    if "HOSTNAME" in kept and at.hostname:
        kept["HOSTNAME"] = at.hostname
    p["args"] = list(argv)
    p["env"] = _env_list({**at.image_env, **kept, **env})
    image_only = sorted(k for k in captured_env if k not in env and k not in kept)
    ch.append(f"process.env: the rendered env, kubelet's {sorted(kept)} as captured, the stand-in image's "
              f"{sorted(at.image_env)} (the captured image's own {image_only} dropped)")
    p["terminal"] = False
    p.pop("consoleSize", None)
    for rl in p.get("rlimits") or []:
        hard = host.rlimit_hard.get(rl["type"])
        if hard is not None and rl.get("hard", 0) > hard:
            ch.append(f"rlimit {rl['type']} {rl['soft']}/{rl['hard']} -> at most the host's hard limit {hard}")
            rl["hard"] = hard
            rl["soft"] = min(rl["soft"], hard)
    prof = p.get("apparmorProfile")
    if prof and prof not in host.apparmor_profiles:
        ch.append(f"apparmorProfile {prof} dropped (not loaded on the GPU host)")
        p.pop("apparmorProfile")
    p.pop("selinuxLabel", None)

    s["mounts"] = _mounts(s.get("mounts") or [], host, at, name, ch)
    s.pop("hooks", None) and ch.append("hooks dropped")
    s.pop("hostname", None)

    lx = s.setdefault("linux", {})
    ns = []
    for n in lx.get("namespaces") or []:
        if n["type"] in JOINED:
            ns.append({"type": n["type"], "path": at.namespaces[n["type"]]})
        else:
            ns.append({"type": n["type"]})
    if {n["type"] for n in ns} & set(JOINED) != set(JOINED):
        raise SpecError(f"container {name}: the captured spec does not join "
                        f"the sandbox's {', '.join(JOINED)} namespaces")
    lx["namespaces"] = ns
    ch.append("network/ipc/uts namespaces -> the pod's (loopback only)")
    parent = pod_cgroup(spec)
    lx["cgroupsPath"] = f"{parent}/{at.cgroup_leaf}"
    ch.append(f"cgroupsPath {(spec.get('linux') or {}).get('cgroupsPath')} -> {lx['cgroupsPath']} (cgroup v2)")
    lx.pop("mountLabel", None)

    res = lx.setdefault("resources", {})
    mem = res.get("memory") or {}
    for k in V1_ONLY_MEMORY:
        if k in mem:
            ch.append(f"resources.memory.{k} dropped (cgroup v1 only)")
            mem.pop(k)
    if at.memory_limit is not None and mem.get("limit") != at.memory_limit:
        # A capture on a small CPU node holds a pod sized for it (a 55 GiB request cannot schedule there).
        ch.append(f"resources.memory.limit {mem.get('limit')} (the captured pod's) -> {at.memory_limit} (as rendered "
                  "for the GPU host), swap the same")
        mem["limit"] = at.memory_limit
        if "swap" in mem:
            mem["swap"] = at.memory_limit
    cpu = res.get("cpu") or {}
    if at.cpu_shares is not None and cpu.get("shares") != at.cpu_shares:
        ch.append(f"resources.cpu.shares {cpu.get('shares')} (the captured "
                  f"pod's) -> {at.cpu_shares} (the rendered CPU request)")
        res["cpu"] = {**cpu, "shares": at.cpu_shares}
    if at.oom_score_adj is not None and p.get("oomScoreAdj") != at.oom_score_adj:
        ch.append(f"process.oomScoreAdj {p.get('oomScoreAdj')} (the captured pod's request on the CPU node) -> "
                  f"{at.oom_score_adj} (kubelet's, for the rendered request on this host)")
        p["oomScoreAdj"] = at.oom_score_adj
    if res.get("hugepageLimits"):
        keep = [h for h in res["hugepageLimits"] if "hugetlb" in host.controllers
                and h["pageSize"] in host.hugepage_sizes]
        if keep != res["hugepageLimits"]:
            ch.append(f"hugepageLimits {[h['pageSize'] for h in res['hugepageLimits']]} -> "
                      f"{[h['pageSize'] for h in keep]} "
                      "(page sizes / hugetlb controller of the GPU host)")
        res["hugepageLimits"] = keep
    for key, controller in (("pids", "pids"), ("cpu", "cpu"), ("blockIO", "io")):
        if res.get(key) and controller not in host.controllers:
            ch.append(f"resources.{key} dropped (the GPU host's cgroup v2 has no {controller} controller)")
            res.pop(key)
    if "swap" in mem and not host.swap_accounting:
        ch.append("resources.memory.swap dropped (no swap accounting on the GPU host: no memory.swap.max)")
        mem.pop("swap")
    res.pop("unified", None)
    rules = res.setdefault("devices", [])
    devs = lx.setdefault("devices", [])
    for d in host.devices:
        devs.append({"path": d.path, "type": "c", "major": d.major, "minor": d.minor, "fileMode": d.mode, "uid": 0,
                     "gid": 0})
        rules.append({"allow": True, "type": "c", "major": d.major, "minor": d.minor, "access": "rwm"})
    ch.append(f"GPU as the NVIDIA toolkit adds it (CDI): devices {[d.path for d in host.devices]} with allow rules; "
              "driver libraries from the host's /usr/local/nvidia (in /usr)")
    return s, ch


def _millicpu(q: str | None) -> int:
    if not q:
        return 0
    return int(q[:-1]) if q.endswith("m") else int(float(q) * 1000)


def cpu_shares(cpu_request: str | None) -> int:
    """kubelet's MilliCPUToShares."""
    return max(2, _millicpu(cpu_request) * 1024 // 1000)


def qos(spec: dict[str, Any]) -> str:
    """The pod's QoS class, from the captured cgroup (kubepods/<class>/pod..., Guaranteed directly under kubepods)."""
    parts = pod_cgroup(spec).strip("/").split("/")
    return parts[1] if len(parts) > 2 and parts[1] in ("burstable", "besteffort") else "guaranteed"


def oom_score_adj(qos_class: str, memory_request: int | None, capacity: int, sidecar_floor: int | None = None) -> int:
    """kubelet's GetContainerOOMScoreAdjust: Guaranteed -997, BestEffort 1000, Burstable 1000 - 1000 x request /
    capacity in [3, 999]; a native sidecar's request counts as at least the smallest regular container's."""
    if qos_class == "guaranteed":
        return -997
    if qos_class == "besteffort":
        return 1000
    req = max(memory_request or 0, sidecar_floor or 0)
    adj = 1000 - 1000 * req // capacity
    return 3 if adj < 3 else 999 if adj == 1000 else adj


def from_template(template: dict[str, Any], security: dict[str, Any], cpu_request: str | None,
                  memory_limit: int | None) -> tuple[dict[str, Any], list[str]]:
    """A container's spec from the real node's CRI spec of another pod (the template), with what
    containerd's CRI derives from this container's securityContext and resources set as it derives
    them: user (runAsUser/runAsGroup; fsGroup and supplementalGroups as extra groups), capabilities
    (drop ALL + add: bounding = effective = permitted = the added ones), noNewPrivileges
    (allowPrivilegeEscalation false), read-only root, CPU shares (kubelet's MilliCPUToShares), the memory
    limit. Everything else (runtime mounts, masked paths, seccomp RuntimeDefault, namespaces) is the
    template's. Listed: the caller records it as a re-creation."""
    s = copy.deepcopy(template)
    uid, gid = int(security.get("runAsUser", 0)), int(security.get("runAsGroup", 0))
    groups = sorted({gid, *([int(security["fsGroup"])] if "fsGroup" in security else []),
                     *map(int, security.get("supplementalGroups") or [])})
    s["process"]["user"] = {"uid": uid, "gid": gid, "additionalGids": groups}
    caps = security.get("capabilities") or {}
    if "ALL" not in (caps.get("drop") or []):
        raise SpecError("from_template: only securityContexts that drop ALL capabilities are derived here")
    added = sorted(f"CAP_{c}" for c in caps.get("add") or [])
    s["process"]["capabilities"] = {k: added for k in ("bounding", "effective", "permitted")} if added else {}
    s["process"]["noNewPrivileges"] = security.get("allowPrivilegeEscalation") is False
    s["root"]["readonly"] = bool(security.get("readOnlyRootFilesystem"))
    res = s["linux"].setdefault("resources", {})
    res["cpu"] = {"shares": cpu_shares(cpu_request), "period": 100000}
    if memory_limit is not None:
        res["memory"] = {"limit": memory_limit, "swap": memory_limit}
    tname = (template.get("annotations") or {}).get("io.kubernetes.cri.sandbox-name", "?")
    return s, [f"spec derived from the real node's CRI spec of pod {tname} (no capture of this pod): user {uid}:{gid} "
               f"groups {groups}, capabilities {added or 'none'}, noNewPrivileges {s['process']['noNewPrivileges']}, "
               f"read-only root {s['root']['readonly']}, cpu shares {res['cpu']['shares']} set from the rendered "
               "securityContext and requests as containerd's CRI sets them"]


def _mounts(captured: list[dict[str, Any]], host: Host, at: Placement, name: str,
            ch: list[str]) -> list[dict[str, Any]]:
    out = [{"destination": d, "type": "bind", "source": d, "options": ["rbind", "ro", "nosuid", "nodev"]}
           for d in host.image_dirs]
    seen = set()
    for m in captured:
        dest = m["destination"].rstrip("/") or "/"
        seen.add(dest)
        if dest in at.volume_mounts:
            src, ro = at.volume_mounts[dest]
            opts = m.get("options") or ["rbind", "rprivate"]
            if ro != ("ro" in opts):
                raise SpecError(f"container {name}: {dest} read-only is {'ro' in opts} in the capture, {ro} rendered")
            out.append({**m, "source": src})
        elif dest in POD_FILES:
            if any(dest.startswith(d + "/") for d in host.image_dirs) and dest not in host.existing:
                ch.append(f"{dest} not mounted: no such file in the host's read-only image directory to mount over")
                continue
            fname = POD_FILES[dest] + (f"-{name}" if dest == "/dev/termination-log" else "")
            out.append({**m, "source": f"{at.pod_files}/{fname}"})
        elif dest == SANDBOX_SHM:
            out.append({**m, "source": at.sandbox_shm})
        elif dest in RUNTIME_MOUNTS and m.get("type") != "bind":
            out.append(m)
        elif at.other_shape and "/kubelet/pods/" in m.get("source", ""):
            ch.append(f"captured volume mount {dest} dropped (the rendered pod has no such mount)")
        else:
            raise SpecError(f"container {name}: captured mount {dest} (source {m.get('source')}) is neither a rendered "
                            "volume mount nor one kubelet/containerd adds to every container")
    missing = sorted(set(at.volume_mounts) - seen)
    if missing and not at.other_shape:
        raise SpecError(f"container {name}: rendered volume mounts {missing} are not in the captured spec")
    for dest in missing:  # kubelet's volume mounts: rbind, rprivate, ro or rw (containerd's CRI)
        src, ro = at.volume_mounts[dest]
        out.append({"destination": dest, "type": "bind", "source": src,
                    "options": ["rbind", "rprivate", "ro" if ro else "rw"]})
        ch.append(f"volume mount {dest} added as kubelet mounts volumes (not in the capture of another pod shape)")
    ch.append("mount sources: kubelet's volume directories -> this pod's host directories; hosts/hostname/resolv.conf/"
              "termination-log/sandbox shm -> this pod's files")
    return out
