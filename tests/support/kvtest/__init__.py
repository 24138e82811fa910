"""kvoffload's test support, installed editable by `make venv` (`import kvtest`, never a sys.path edit).

  kvtest.paths       where things are: the repository, the cluster state dir, the cached binaries, kubectl
  kvtest.procs       processes and ports: liveness, free ports, listeners, killing a process group, wait_until
  kvtest.pki         the control plane's certificates and kubeconfigs
  kvtest.fleet       kwok GPU nodes (pools -> Node objects on loopback addresses)
  kvtest.components  one table: each control-plane component's ports, flags and health check
  kvtest.client      Client: the one API client of the tests (JSON over HTTPS, kubectl-style resource names)
  kvtest.cluster     Cluster: up/down/status, one component's stop/start/restart, its client, kubectl and helm
  kvtest.node        the real node (containerd, runc, CNI bridge, kubelet, kube-proxy): host set-up, guard, teardown
  kvtest.operator    the operator as a subprocess (`kvoffload run`), the CRD installed
  kvtest.exporter    stand-ins for vLLM and LMCache, the exporter as a subprocess
  kvtest.router_workload  vLLM's router in front of stand-in replicas: its workers, metrics, a cache_aware workload
  kvtest.readme      the commands the README shows
  kvtest.gitops      Argo CD's Lua health runner and the kstatus checker (tests/gitops/build.sh), fixture helpers
  kvtest.flux        Flux's source-controller and kustomize-controller as processes, a git server on 127.0.0.1
  python -m kvtest up|down|status   the CLI behind `make cluster-up/down/status`
"""

from . import node
from .client import ApiError, Client, condition
from .cluster import Cluster, ClusterError, KubectlError
from .fleet import load_fleet, make_fleet
from .operator import OperatorProcess, sentinel
from .paths import ROOT, bin_dir, missing_binaries, missing_node_binaries
from .procs import listening_sockets, proc_stat, wait_until

__all__ = ["ROOT", "ApiError", "Client", "Cluster", "ClusterError", "KubectlError", "OperatorProcess", "bin_dir",
           "listening_sockets",
           "load_fleet", "make_fleet", "missing_binaries", "missing_node_binaries", "node", "proc_stat", "condition",
           "sentinel", "wait_until"]
