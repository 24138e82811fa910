"""The one client the tests talk to the API server with: JSON over HTTPS, plain dicts in and out.

Resources are named the way kubectl names them ("kvs", "configmap", "statefulsets",
"kvoffloadserves.kvoffload.io", "crd", "networkpolicy" ...) and resolved through the API server's own
discovery, so a test reads like the kubectl line it replaces without spawning kubectl. kubectl stays
only in tests about what kubectl itself shows a user (printer columns, describe, apply's error text,
`kubectl scale`, the README's commands).

    c = cluster.client
    c.apply(obj)                                  # server-side apply, field manager "kvtest"
    c.get("kvs", "svc", ns)                       # raises ApiError (status 404) when missing
    c.get_or_none("statefulset", "svc", ns)
    c.list("pods", ns, labels={"kvoffload.io/serve": "svc"})
    c.patch("kvs", "svc", {"spec": {...}}, ns)    # merge patch; type="json" / subresource="status"
    c.delete("kvs", "svc", ns, wait=True)
    for kind, obj in c.watch("kvs", ns, resource_version=rv): ...
    c.as_token(c.create_token("default", ns)).can_i("list", "secrets", ns)

Every failed call raises ApiError with the HTTP status and the API server's message. Writes ask for
strict field validation, as kubectl does: an unknown or duplicate field is refused (400), not dropped.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .procs import LOOPBACK, wait_until

Obj = dict[str, Any]
STRICT = "Strict"  # fieldValidation of every write: kubectl's default (the API server's own is Warn: drop and warn)


class ApiError(RuntimeError):
    def __init__(self, method: str, path: str, status: int, body: Any) -> None:
        self.status = status
        self.body = body
        self.reason = body.get("reason", "") if isinstance(body, dict) else ""
        self.message = body.get("message", "") if isinstance(body, dict) else str(body)
        super().__init__(f"{method} {path}: {status} {self.reason}: {self.message}")


class Resource:
    """One discovered resource type: where its objects live and how kubectl may name it."""

    def __init__(self, group_version: str, r: Obj) -> None:
        self.group_version = group_version
        self.group = group_version.rpartition("/")[0]
        self.plural: str = r["name"]
        self.kind: str = r["kind"]
        self.namespaced: bool = r["namespaced"]
        self.names = {self.plural, r.get("singularName") or self.kind.lower(), self.kind.lower(),
                      *r.get("shortNames", [])}

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/api/{self.group_version}" if not self.group else f"/apis/{self.group_version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
        if subresource:
            base += f"/{subresource}"
        return base


class Client:
    def __init__(self, port: int, ca: Path, cert: tuple[Path, Path] | None = None, token: str | None = None,
                 impersonate: str | None = None, timeout: float = 30, host: str = LOOPBACK) -> None:
        self.host = host  # 127.0.0.1, or the real node's bridge address (kvtest.node)
        self.port = port
        self.ca = ca
        self.cert = cert
        self.token = token
        self.impersonate = impersonate
        self.timeout = timeout
        self._resources: list[Resource] | None = None
        self._lock = threading.Lock()
        self._ssl = ssl.create_default_context(cafile=str(ca))  # built once: it reads the CA and key files
        if cert:
            self._ssl.load_cert_chain(str(cert[0]), str(cert[1]))

    # ------------------------------------------------------------------------------------ identities
    def as_token(self, token: str) -> Client:
        """The same API server as a bearer token's identity (a ServiceAccount), no client certificate."""
        return Client(self.port, self.ca, token=token, timeout=self.timeout, host=self.host)

    def as_user(self, user: str) -> Client:
        """Impersonate `user` (e.g. system:serviceaccount:ns:sa), as `kubectl --as` does."""
        return Client(self.port, self.ca, self.cert, self.token, impersonate=user, timeout=self.timeout,
                      host=self.host)

    # ------------------------------------------------------------------------------------ raw
    def _send(self, method: str, path: str, body: Any, content_type: str | None, params: dict | None,
              timeout: float | None) -> tuple[http.client.HTTPSConnection, http.client.HTTPResponse]:
        if params:
            path += "?" + urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if self.impersonate:
            headers["Impersonate-User"] = self.impersonate
        data = None
        if body is not None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            headers["Content-Type"] = content_type or "application/json"
        conn = http.client.HTTPSConnection(self.host, self.port, context=self._ssl,
                                           timeout=timeout or self.timeout)
        conn.request(method, path, body=data, headers=headers)
        return conn, conn.getresponse()

    def request(self, method: str, path: str, body: Any = None, content_type: str | None = None,
                params: dict | None = None, timeout: float | None = None) -> Any:
        """One call; the decoded JSON answer (text if it is not JSON). Raises ApiError unless 2xx."""
        conn, resp = self._send(method, path, body, content_type, params, timeout)
        try:
            raw = resp.read()
        finally:
            conn.close()
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = raw.decode(errors="replace")
        if not 200 <= resp.status < 300:
            raise ApiError(method, path, resp.status, answer)
        return answer

    # ------------------------------------------------------------------------------------ discovery
    def _discover(self) -> list[Resource]:
        found = [Resource("v1", r) for r in self.request("GET", "/api/v1")["resources"]]
        for group in self.request("GET", "/apis")["groups"]:
            gv = group["preferredVersion"]["groupVersion"]
            try:
                found += [Resource(gv, r) for r in self.request("GET", f"/apis/{gv}")["resources"]]
            except ApiError as exc:
                if exc.status != 404:  # a CRD deleted between the two GETs (another test's): its group is gone
                    raise
        return [r for r in found if "/" not in r.plural]  # subresources are addressed through their parent

    def _find(self, matches: Callable[[Resource], bool], what: str) -> Resource:
        """The first discovered resource that matches, core before groups like kubectl (e.g. "events" is
        core/v1 first). Discovery is cached; no match rediscovers once (a CRD installed since)."""
        for fresh in (False, True):
            with self._lock:
                if fresh or self._resources is None:
                    self._resources = self._discover()
                hits = [r for r in self._resources if matches(r)]
            if hits:
                return min(hits, key=lambda r: (r.group != "", r.group))
        raise KeyError(f"the API server serves no {what}")

    def resource(self, name: str) -> Resource:
        """A kubectl-style resource name ("kvs", "pods", "crd", "leases.coordination.k8s.io") -> Resource."""
        short, _, group = name.lower().partition(".")
        return self._find(lambda r: short in r.names and (not group or r.group == group), f"resource named {name!r}")

    def _for(self, obj: Obj) -> Resource:
        api_version, kind = obj["apiVersion"], obj["kind"]
        return self._find(lambda r: r.group_version == api_version and r.kind == kind, f"{kind} in {api_version}")

    # ------------------------------------------------------------------------------------ verbs
    def get(self, resource: str, name: str, namespace: str | None = None, subresource: str | None = None) -> Obj:
        return self.request("GET", self.resource(resource).path(namespace, name, subresource))

    def get_or_none(self, resource: str, name: str, namespace: str | None = None) -> Obj | None:
        try:
            return self.get(resource, name, namespace)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def exists(self, resource: str, name: str, namespace: str | None = None) -> bool:
        return self.get_or_none(resource, name, namespace) is not None

    def list(self, resource: str, namespace: str | None = None, labels: dict[str, str] | str | None = None,
             fields: str | None = None) -> list[Obj]:
        """Items (each with its kind and apiVersion filled in, as kubectl -o json shows them)."""
        r = self.resource(resource)
        if isinstance(labels, dict):
            labels = ",".join(f"{k}={v}" for k, v in labels.items())
        answer = self.request("GET", r.path(namespace), params={"labelSelector": labels, "fieldSelector": fields})
        for item in answer["items"]:
            item.setdefault("kind", r.kind)
            item.setdefault("apiVersion", r.group_version)
        return answer["items"]

    def list_raw(self, resource: str, namespace: str | None = None, labels: str | None = None,
                 fields: str | None = None) -> Obj:
        """The List object itself (its metadata.resourceVersion is where a watch starts)."""
        return self.request("GET", self.resource(resource).path(namespace),
                            params={"labelSelector": labels, "fieldSelector": fields})

    def create(self, obj: Obj, namespace: str | None = None, dry_run: bool = False,
               field_validation: str | None = STRICT) -> Obj:
        """POST. Unknown fields are refused (`fieldValidation=Strict`), as kubectl does by default; the API's
        own default only warns. `field_validation=None` asks for the API's default."""
        ns = namespace or obj.get("metadata", {}).get("namespace")
        return self.request("POST", self._for(obj).path(ns), obj, params={"dryRun": "All" if dry_run else None,
                                                                          "fieldValidation": field_validation})

    def apply(self, obj: Obj, namespace: str | None = None, manager: str = "kvtest", force: bool = True,
              dry_run: bool = False, field_validation: str | None = STRICT) -> Obj:
        """Server-side apply of one object (what `kubectl apply --server-side` sends); `field_validation`
        as in create."""
        ns = namespace or obj.get("metadata", {}).get("namespace")
        r = self._for(obj)
        if ns and r.namespaced:
            obj = {**obj, "metadata": {**obj["metadata"], "namespace": ns}}
        return self.request("PATCH", r.path(ns, obj["metadata"]["name"]), obj,
                            content_type="application/apply-patch+yaml",
                            params={"fieldManager": manager, "force": "true" if force else None,
                                    "dryRun": "All" if dry_run else None, "fieldValidation": field_validation})

    def patch(self, resource: str, name: str, patch: Any, namespace: str | None = None, type: str = "merge",
              subresource: str | None = None) -> Obj:
        content = {"merge": "application/merge-patch+json", "json": "application/json-patch+json",
                   "strategic": "application/strategic-merge-patch+json"}[type]
        return self.request("PATCH", self.resource(resource).path(namespace, name, subresource), patch,
                            content_type=content, params={"fieldValidation": STRICT})

    def delete(self, resource: str, name: str, namespace: str | None = None, wait: bool = False,
               timeout: float = 60, missing_ok: bool = False, propagation: str | None = None) -> None:
        """Delete; with `wait`, until the object is gone (its finalizers done), like `kubectl delete --wait`."""
        body = {"propagationPolicy": propagation} if propagation else None
        try:
            self.request("DELETE", self.resource(resource).path(namespace, name), body)
        except ApiError as exc:
            if not (missing_ok and exc.status == 404):
                raise
        if wait:
            wait_until(lambda: not self.exists(resource, name, namespace), timeout=timeout, interval=0.1,
                       message=f"{resource}/{name} deleted")

    def watch(self, resource: str, namespace: str | None = None, resource_version: str | None = None,
              labels: str | None = None, timeout: float = 60) -> Iterator[tuple[str, Obj]]:
        """(type, object) per watch event from `resource_version`, until the server ends the watch after
        `timeout` seconds or the caller stops iterating."""
        params = {"watch": "1", "resourceVersion": resource_version, "labelSelector": labels,
                  "timeoutSeconds": int(timeout), "allowWatchBookmarks": "false"}
        path = self.resource(resource).path(namespace)
        conn, resp = self._send("GET", path, None, None, params, timeout + 10)
        try:
            if resp.status != 200:
                raise ApiError("GET", path, resp.status, resp.read().decode(errors="replace"))
            while line := resp.readline():
                event = json.loads(line)
                if event["type"] == "ERROR":
                    raise ApiError("WATCH", path, event["object"].get("code", 0), event["object"])
                yield event["type"], event["object"]
        finally:
            conn.close()

    # ------------------------------------------------------------------------------------ helpers
    def namespace(self, name: str, labels: dict[str, str] | None = None, timeout: float = 30) -> str:
        """Create a namespace and wait for its `default` ServiceAccount (pods are admitted only then)."""
        self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}})
        wait_until(lambda: self.exists("serviceaccount", "default", name), timeout=timeout, interval=0.1,
                   message=f"ServiceAccount default in {name}")
        return name

    def label(self, resource: str, name: str, labels: dict[str, str | None], namespace: str | None = None) -> Obj:
        """Set (or with None, remove) labels, like `kubectl label --overwrite`."""
        return self.patch(resource, name, {"metadata": {"labels": labels}}, namespace)

    def established(self, crd: str, timeout: float = 60) -> None:
        """Until the CRD's Established condition is True (`kubectl wait --for=condition=Established`)."""
        def ok() -> bool:
            obj = self.get_or_none("customresourcedefinitions", crd)
            return any(c["type"] == "Established" and c["status"] == "True"
                       for c in ((obj or {}).get("status") or {}).get("conditions", []))

        wait_until(ok, timeout=timeout, interval=0.1, message=f"CRD {crd} Established")
        with self._lock:
            self._resources = None  # its kinds are served now

    def can_i(self, verb: str, resource: str, namespace: str | None = None, group: str | None = None,
              name: str | None = None, subresource: str | None = None) -> bool:
        """A SelfSubjectAccessReview for this client's identity (what `kubectl auth can-i` sends)."""
        if group is None:
            r = self.resource(resource)
            resource, group = r.plural, r.group
        attrs = {"verb": verb, "resource": resource, "group": group, "namespace": namespace or "",
                 "name": name or "", "subresource": subresource or ""}
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                  "spec": {"resourceAttributes": attrs}}
        return bool(self.create(review)["status"].get("allowed"))

    def create_token(self, service_account: str, namespace: str, seconds: int = 3600) -> str:
        """A bound token for a ServiceAccount: a TokenRequest POSTed to its `token` subresource, which is
        what `kubectl create token` sends."""
        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                   "spec": {"expirationSeconds": seconds}}
        path = self.resource("serviceaccounts").path(namespace, service_account, "token")
        return self.request("POST", path, request)["status"]["token"]


def condition(obj: Obj | None, type_: str) -> Obj:
    """The status condition of `type_` on an object as the API server returns it; {} when there is none
    (no object, no status, no conditions yet)."""
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == type_), {})
