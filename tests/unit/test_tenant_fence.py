"""What a tenant's spec may not choose (issue 32): images are the admin's, and so are the NVIDIA_* env family and
duplicate env names. The API server's side of each is in tests/integration/test_bad_input.py."""

from __future__ import annotations

import pytest

from kvoffload.api.errors import ConfigError
from kvoffload.api.settings import Settings, from_dict
from kvoffload.api.spec import parse
from kvoffload.engine import flags, images
from kvtest.specs import spec


@pytest.mark.parametrize("image, allowlist, ok", [
    (images.DEFAULT_IMAGE, (), True),
    ("ghcr.io/kvoffload/vllm-lmcache:0.33.0-0.5.6", (), True),
    ("vllm/vllm-openai:v0.26.0", (), True),  # vLLM's own image of an offered version (vllm-native)
    ("vllm/vllm-openai:latest", (), False),
    ("ghcr.io/kvoffload/vllm-lmcache:0.26.0-0.5.3-evil", (), False),
    ("registry.acme/vllm:1", ("registry.acme/vllm:1",), True),
    ("registry.acme/vllm:2", ("registry.acme/vllm:1",), False),
    ("registry.acme/vllm/a:1", ("registry.acme/vllm/*",), True),
    ("registry.acme/vllm/team/a@sha256:" + "0" * 64, ("registry.acme/vllm/*",), True),
    ("registry.acme/vllmx/a:1", ("registry.acme/vllm/*",), False),  # a prefix ends at a path boundary
    ("registry.acme/vllm/", ("registry.acme/vllm/*",), False),
    ("registry.acme.evil/vllm/a:1", ("registry.acme/*",), False),
])
def test_only_images_the_admin_allows_run(image, allowlist, ok):
    assert images.allowed(image, allowlist, images.KNOWN_IMAGES) is ok


def test_a_refused_image_names_the_field_and_what_is_allowed():
    with pytest.raises(ConfigError) as err:
        parse(spec(engine__image="evil.example/vllm:1", engine__vllmVersion="0.26.0", engine__lmcacheVersion="0.5.3"),
              Settings(allowed_images=("registry.acme/vllm/*",)))
    assert err.value.field == "spec.engine.image"
    assert err.value.message.startswith("'evil.example/vllm:1' is not an image the cluster admin allows: the "
                                        "operator's known images (ghcr.io/kvoffload/vllm-lmcache:0.26.0-0.5.3, ")
    assert "and the allowlist (registry.acme/vllm/*); the admin adds images with the operator config allowedImages" \
        in err.value.message


@pytest.mark.parametrize("entry", ["", "*", "registry.acme/*/x", "registry.acme/vllm*", "a b"])
def test_a_bad_allowlist_entry_stops_the_operator(entry):
    with pytest.raises(ConfigError) as err:
        from_dict({"allowedImages": [entry]})
    assert err.value.field == "operator config allowedImages[0]"


def test_nvidia_env_is_the_admins_unless_allowed():
    s = spec(engine__env=[{"name": "NVIDIA_GDS", "value": "enabled"}])
    with pytest.raises(ConfigError) as err:
        parse(s, Settings())
    assert err.value.field == "spec.engine.env" and err.value.message.startswith(
        "NVIDIA_GDS is managed by the operator: the NVIDIA container runtime reads NVIDIA_* to add host devices")
    assert (parse(s, Settings(allowed_nvidia_env=("NVIDIA_GDS",))).engine.env
            == ({"name": "NVIDIA_GDS", "value": "enabled"},))
    with pytest.raises(ConfigError):
        from_dict({"allowedNvidiaEnv": ["CUDA_VISIBLE_DEVICES"]})


def test_an_env_name_set_twice_is_refused():
    with pytest.raises(ConfigError) as err:
        parse(spec(engine__env=[{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]), Settings())
    assert (err.value.field, err.value.message) == ("spec.engine.env", "A is set twice: each variable at most once")


@pytest.mark.parametrize("args, words", [
    (["--hf-token", "hf_x"], "use spec.model.hfTokenSecret"),
    (["--allowed-local-media-path=/"], "file:// media URLs"),
    (["--kv-events-config", "{}"], "the KV event publisher the router reads"),
    (["--uds", "/tmp/s"], "Unix socket"),
    (["--grpc"], "a gRPC server"),
    (["--ssl-certfile", "/tmp/c"], "TLS on vLLM's port"),
    (["--enable-ssl-refresh"], "TLS on vLLM's port"),
    (["--api-server-count", "2"], "each API server is a process"),
    (["--nnodes", "2"], "multi-node serving"),
    (["--speculative-config", "{}"], "a draft model's weights"),
    (["--hf-overrides", "{}"], "KV bytes per token"),
])
@pytest.mark.parametrize("vllm", ["0.26.0", "0.33.0"])
def test_flags_that_leave_the_pods_contract_are_refused_on_both_versions(args, words, vllm):
    with pytest.raises(ConfigError) as err:
        flags.check_args(args, vllm)
    assert err.value.field == "spec.engine.extraArgs" and words in err.value.message, err.value
