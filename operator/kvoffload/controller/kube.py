"""A thin, synchronous REST layer over the kubernetes client's connection and auth.

The generated typed APIs cannot express server-side apply for every kind uniformly; the
operator needs six verbs on a handful of paths, so it speaks REST directly.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlencode

from kubernetes import client, config

FIELD_MANAGER = "kvoffload"


class ApiError(Exception):
    def __init__(self, status: int, reason: str, body: str) -> None:
        self.status, self.reason, self.body = status, reason, body
        try:
            doc = json.loads(body)
        except ValueError:
            doc = {}
        doc = doc if isinstance(doc, dict) else {}
        self.message = doc.get("message", body)
        # The fields a refused object broke (details.causes); none when, e.g., a JSON patch's test failed.
        self.causes: list[dict[str, Any]] = (doc.get("details") or {}).get("causes") or []
        super().__init__(f"{status} {reason}: {self.message}")


def load_api_client(kubeconfig: str | None = None) -> client.ApiClient:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(config_file=kubeconfig)
    return client.ApiClient()


_PATHS = {
    ("v1", "ConfigMap"): "configmaps", ("v1", "Service"): "services", ("v1", "Pod"): "pods",
    ("apps/v1", "StatefulSet"): "statefulsets", ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
}


def collection(api_version: str, kind: str, namespace: str) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    plural = _PATHS.get((api_version, kind)) or kind.lower() + "s"
    return f"{base}/namespaces/{namespace}/{plural}"


class Kube:
    def __init__(self, api_client: client.ApiClient, timeout: float = 30) -> None:
        self.api = api_client
        self.timeout = timeout

    def headers(self, content_type: str = "application/json") -> dict[str, str]:
        headers = {"Accept": "application/json", "Content-Type": content_type, "User-Agent": "kvoffload"}
        # Bearer tokens (re-read each time: in-cluster tokens rotate); client certs live in the TLS layer.
        for auth in self.api.configuration.auth_settings().values():
            if auth.get("in") == "header" and auth.get("value"):
                headers[auth["key"]] = auth["value"]
        return headers

    def request(self, method: str, path: str, body: Any = None, *, query: dict[str, str] | None = None,
                content_type: str = "application/json") -> Any:
        cfg = self.api.configuration
        headers = self.headers(content_type)
        url = cfg.host + path + ("?" + urlencode(query) if query else "")
        resp = self.api.rest_client.request(method, url, headers=headers, body=body, _request_timeout=self.timeout)
        data = resp.read() if hasattr(resp, "read") else resp.data
        text = data.decode() if isinstance(data, bytes) else (data or "")
        if resp.status >= 400:
            raise ApiError(resp.status, resp.reason or "", text)
        return json.loads(text) if text else None

    def get(self, path: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list(self, path: str, label_selector: str) -> list[dict[str, Any]]:
        return self.request("GET", path, query={"labelSelector": label_selector})["items"]

    def apply(self, obj: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        """Server-side apply with the one field manager; force takes back fields others changed (drift)."""
        meta = obj["metadata"]
        path = f"{collection(obj['apiVersion'], obj['kind'], meta['namespace'])}/{meta['name']}"
        query = {"fieldManager": FIELD_MANAGER, "force": "true", **({"dryRun": "All"} if dry_run else {})}
        return self.request("PATCH", path, obj, query=query, content_type="application/apply-patch+yaml")

    def delete(self, path: str) -> None:
        try:
            self.request("DELETE", path, {"propagationPolicy": "Background"})
        except ApiError as e:
            if e.status != 404:
                raise

    def status_written_within(self, path: str, seconds: float) -> bool:
        """Whether this client wrote the status at `path` in the last `seconds` (only CachedKube keeps track)."""
        return False

    def replace_status(self, path: str, status: dict[str, Any], resource_version: str) -> dict[str, Any]:
        # JSON patch: `add` on /status replaces it whole (merge patch cannot drop stale keys); the
        # resourceVersion test refuses to overwrite a newer object.
        ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": resource_version},
               {"op": "add", "path": "/status", "value": status}]
        return self.request("PATCH", path + "/status", ops, content_type="application/json-patch+json")
