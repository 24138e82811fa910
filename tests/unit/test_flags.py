"""engine/flags.py: extra vLLM arguments read as each offered vLLM's parser reads them (its generated flag table:
vLLM 0.26.0 and 0.33.0)."""

from __future__ import annotations

import pytest

from kvoffload.api import crd
from kvoffload.api.errors import ConfigError
from kvoffload.api.settings import Settings
from kvoffload.controller import pipeline
from kvoffload.engine import flags, images
from kvtest.specs import spec

V = images.KNOWN_IMAGES[images.DEFAULT_IMAGE].vllm
OFFERED = sorted({k.vllm for k in images.serving_images().values()})
EVERY_VLLM = pytest.mark.parametrize("v", OFFERED)


@pytest.mark.parametrize("args, needle", [
    # allow_abbrev: prefixes of flags the operator sets, or that change GPUs / memory
    (["--kv-transfer", "{}"], "abbreviates --kv-transfer-config"),
    (["--kv-offloading-s", "10"], "abbreviates --kv-offloading-size"),
    (["-t", "2"], "abbreviates -tp (--tensor-parallel-size)"),
    (["--tensor-parallel", "2"], "abbreviates --tensor-parallel-size"),
    (["--max-model", "1"], "abbreviates --max-model-len"),
    (["--gpu-memory", "0.5"], "abbreviates --gpu-memory-utilization"),
    (["--served-model", "x"], "abbreviates --served-model-name"),
    (["--max_model", "1"], "abbreviates --max-model-len"),
    # managed, by any alias or spelling
    (["-tp", "2"], "sets --tensor-parallel-size"),
    (["--max_model_len=9"], "sets --max-model-len"),
    (["--kv-transfer-config.kv_connector=X"], "sets --kv-transfer-config"),
    # GPU count and memory budget
    (["-pp", "2"], "GPU count"), (["-dp", "2"], "GPU count"), (["-pcp", "2"], "GPU count"),
    (["-dpl", "2"], "GPU count"),
    (["--cpu-offload-gb", "4"], "memory budget"), (["--kv-cache-memory-bytes", "1G"], "memory budget"),
    (["--kv-offloading-backend", "native"], "memory budget"), (["--num-gpu-blocks-override", "10"], "memory budget"),
    (["--config", "f.yaml"], "file"),
    # what vLLM 0.26.0 and 0.33.0 refuse
    (["--swap-space", "4"], "not a flag of vLLM"),
    (["--enable-prefix-caching=False"], "takes no value"),
    (["--dbo-decode-token-threshold", "big"], "takes an integer"), (["--gpu-memory-utilization-x"], "not a flag"),
    (["--collect-detailed-traces", "bogus"], "allowed:"),
    (["--seed"], "needs a value"), (["stray"], "not a flag"), (["--enable-pr"], "ambiguous"),
    (["--enforce"], "abbreviates --enforce-eager"),
])
@EVERY_VLLM
def test_refused(args, needle, v):
    with pytest.raises(ConfigError) as err:
        flags.check_args(args, v)
    assert err.value.field == "spec.engine.extraArgs"
    assert needle in err.value.message and f"vLLM {v}" in err.value.message and repr(args[0]) in err.value.message


@pytest.mark.parametrize("args", [
    [], ["--enforce-eager"], ["--enable-prefix-caching"], ["--max-num-batched-tokens", "8192"],
    ["--max_num_batched_tokens=8192"], ["--seed", "-1"], ["-O3"], ["--compilation-config.mode=3"],
    ["--load-format", "dummy"],
    ["--disable-hybrid-kv-cache-manager"], ["--trust-remote-code", "--enforce-eager"],
])
@EVERY_VLLM
def test_accepted(args, v):
    flags.check_args(args, v)


@pytest.mark.parametrize("args, only_in", [
    (["--max-num-active-seqs", "4"], "0.33.0"),  # new in 0.33 (the scheduler's admission limit)
    (["--max-num-partial-prefills", "2"], "0.26.0"),  # gone in 0.33
    (["--disable-log-requests"], "0.33.0"),  # gone in 0.26.0, back in 0.33 (the negative of --enable-log-requests)
    (["--no-enable-prefix-caching"], "0.26.0"), (["--disable-prefix-caching"], "0.33.0"),  # renamed in 0.33
])
def test_each_vllm_is_checked_against_its_own_parser(args, only_in):
    for v in OFFERED:
        if v == only_in:
            flags.check_args(args, v)
        else:
            with pytest.raises(ConfigError, match=f"not a flag of vLLM {v}"):
                flags.check_args(args, v)


@pytest.mark.parametrize("v, hybrid_on", [("0.26.0", "--no-disable-hybrid-kv-cache-manager"),
                                          ("0.33.0", "--enable-hybrid-kv-cache-manager")])
def test_the_hybrid_kv_cache_manager_stays_off(v, hybrid_on):
    with pytest.raises(ConfigError, match="hybrid") as err:
        flags.check_args([hybrid_on], v)
    assert f"vLLM {v}" in err.value.message


def test_vllm_033s_shared_memory_arena_is_refused():
    with pytest.raises(ConfigError, match="memory budget"):
        flags.check_args(["--enable-shm-tensor-arena"], "0.33.0")


def test_a_vllm_without_a_table_takes_no_extra_args():
    flags.check_args([], "0.29.0")
    with pytest.raises(ConfigError, match="no flag table"):
        flags.check_args(["--enforce-eager"], "0.29.0")


def test_expandable_segments_refused():
    flags.check_env([{"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "max_split_size_mb:512"}], V)
    with pytest.raises(ConfigError, match="expandable_segments") as err:
        flags.check_env([{"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:True"}], V)
    assert err.value.field == "spec.engine.env"


def test_every_refused_dest_exists_in_the_table():
    """A refusal for a dest no offered vLLM has would be dead code (or a renamed flag slipping through); the
    prefixes and spellings are in every table."""
    everywhere: set[str] = set()
    for v in OFFERED:
        table = flags.table(v)
        dests = {o.dest for o in table.options.values()}
        everywhere |= dests
        for prefix in flags.REFUSED_DEST_PREFIXES:
            assert any(d.startswith(prefix) for d in dests), (v, prefix)
        # Each vLLM's way of turning the hybrid KV cache manager back on is refused, whatever it is spelt.
        hybrid = [s for s, o in table.options.items() if o.dest == "disable_hybrid_kv_cache_manager"]
        assert [s for s in hybrid if not flags.refusal(table.options[s], s)] == ["--disable-hybrid-kv-cache-manager"]
        everywhere |= set(table.options)
    assert set(flags.REFUSED_SPELLINGS) <= everywhere
    assert "--no-disable-hybrid-kv-cache-manager" in flags.table("0.26.0").options
    assert set(flags.REFUSED_DESTS) <= everywhere, set(flags.REFUSED_DESTS) - everywhere
    assert set(flags.REFUSED_DESTS) - {"enable_shm_tensor_arena"} <= {o.dest for o in flags.table(V).options.values()}


def test_cel_prefix_rule_refuses_no_allowed_flag():
    """The API server refuses an argument that is a prefix of a refused spelling: no allowed flag may be one."""
    for v in flags.supported_versions():
        table = flags.table(v)
        allowed = [s for s, o in table.options.items() if not flags.refusal(o, s)]
        assert not [(a, r) for a in allowed for r in crd.REFUSED_FLAGS if r.startswith(a)]
    assert "-tp" in crd.REFUSED_FLAGS and "--kv-transfer-config" in crd.REFUSED_FLAGS and "-pp" in crd.REFUSED_FLAGS


def test_the_operator_renders_only_refused_flags():
    """Every flag the operator renders is one users may not set, so it can appear only once."""
    d = pipeline.desired("x", "ns", "uid", spec(), Settings())
    sts = next(c for c in d.children if c["kind"] == "StatefulSet")
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    table = flags.table(V)
    rendered = [a for a in args if a.startswith("-")]
    assert rendered and all(flags.refusal(table.options[a], a) for a in rendered), rendered


def test_a_short_prefix_is_ambiguous_or_refused():
    """`--tool` prefixes several allowed flags: ambiguous. `--enable` prefixes many, one of them refused on both
    versions (--enable-ssl-refresh): the refusal wins, so no abbreviation reaches a refused flag."""
    with pytest.raises(ConfigError, match="ambiguous"):
        flags.check_args(["--tool"], "0.26.0")
    for v in ("0.26.0", "0.33.0"):
        with pytest.raises(ConfigError, match="abbreviates --enable-.*which extraArgs may not set"):
            flags.check_args(["--enable"], v)


@pytest.mark.parametrize("v, dtype, refused", [
    ("0.33.0", "float16", True), ("0.33.0", "bfloat16", False), ("0.33.0", "auto", False),
    # vLLM 0.26.0 accepts the mix (its create_engine_config, tests/engine/test_fidelity.py)
    ("0.26.0", "float16", False),
])
def test_a_bf16_kv_cache_must_match_the_models_dtype_from_vllm_033(v, dtype, refused):
    image = next(i for i, k in images.serving_images().items() if k.vllm == v)
    s = spec(engine__image=image, engine__dtype=dtype, model__kvDtype="bf16")
    if not refused:
        pipeline.desired("x", "ns", "uid", s, Settings())
        return
    with pytest.raises(ConfigError) as err:
        pipeline.desired("x", "ns", "uid", s, Settings())
    assert err.value.field == "spec.model.kvDtype" and f"vLLM {v} refuses" in err.value.message
    flags.check_dtypes("fp8", dtype, v)  # fp8 is not a 16-bit dtype: vLLM does not compare it
