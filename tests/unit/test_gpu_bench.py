"""The GPU benchmark's parts that need no GPU (benchmarks/gpu/): argument extraction from rendered
manifests, the exporter-vs-engine comparison (on the real vLLM 0.26.0 + LMCache 0.5.3 pages of
the H200 run), the report, and the driver's flow against a stand-in vLLM process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from kvtest import ROOT
from kvtest.specs import SERVER_REQUEST

sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import gpu_counters  # noqa: E402
import gpu_manifests as gm  # noqa: E402
import gpu_report  # noqa: E402

from kvoffload.planning.catalog import resolve_model  # noqa: E402

FIXTURE_REF = ROOT / "tests" / "fixtures" / "h200-vllm-0.26.0-lmcache-0.5.3"
WORKSTATION = ROOT / "examples" / "workstation-llama31-8b.yaml"
TP2 = ROOT / "benchmarks" / "gpu" / "workstation-tp2.yaml"


def render(path: Path) -> str:
    return subprocess.run([sys.executable, "-m", "kvoffload.cli", "render", "-f", str(path)], check=True,
                          capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def tp1() -> gm.Rendered:
    return gm.parse_rendered(render(WORKSTATION))


@pytest.fixture(scope="module")
def tp2() -> gm.Rendered:
    return gm.parse_rendered(render(TP2))


LAYOUT = gm.Layout(root="/w/run", model_dir="/w/model", disk_dir="/d/kv", port=18000, exporter_port=19400, python="py")


def llama_cfg() -> dict:
    m = resolve_model("meta-llama/Llama-3.1-8B-Instruct")
    return gm.model_config(m.hf_id, m.layers, m.attention_heads, m.kv_heads, m.head_dim, m.max_context, m.params)


# ------------------------------------------------------------------ manifests

def test_parse_reads_the_vllm_container_exactly(tp1):
    sts = next(d for d in yaml.safe_load_all(render(WORKSTATION)) if d and d["kind"] == "StatefulSet")
    c = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")
    assert tp1.vllm.command == tuple(c["command"]) and tp1.vllm.args == tuple(c["args"])
    assert tp1.vllm.memory_limit == gm.quantity(c["resources"]["limits"]["memory"])
    assert tp1.tp == 1 and tp1.exporter is not None
    assert tp1.vllm.env["PYTHONHASHSEED"] == "0" and tp1.vllm.env_fields["POD_NAME"] == "metadata.name"
    assert tp1.lmcache_config()["max_local_cpu_size"] == 40.0


def test_localize_changes_only_what_a_host_needs(tp1):
    run = gm.localize(tp1, LAYOUT, model_config=llama_cfg())
    argv = run.engine_argv
    assert argv[:5] == ["py", "-m", "vllm.entrypoints.cli.main", "serve", "/w/model"]
    assert gm.flag(argv, "--host") == "127.0.0.1" and gm.flag(argv, "--port") == "18000"
    assert argv[-3:] == ["--load-format", "dummy", "--skip-tokenizer-init"]
    # Every other rendered argument is passed through unchanged and in order.
    rendered = gm.exec_argv(tp1.vllm)[0][3:]
    kept = [a for a in argv[5:-3]]
    for opt in ("--host", "--port"):
        i = rendered.index(opt)
        del rendered[i:i + 2]
        j = kept.index(opt)
        del kept[j:j + 2]
    assert kept == rendered
    assert run.engine_env["LMCACHE_CONFIG_FILE"] == "/w/run/volumes/lmcache-config/lmcache.yaml"
    assert run.engine_env["PROMETHEUS_MULTIPROC_DIR"] == "/w/run/volumes/prometheus-multiproc"
    assert run.engine_env["POD_NAME"] == "workstation-llama31-8b-0" and run.engine_env["PYTHONHASHSEED"] == "0"
    assert run.lmcache["local_disk"] == "file:///d/kv/" and run.lmcache["max_local_cpu_size"] == 40.0
    written = yaml.safe_load(run.files["/w/run/volumes/lmcache-config/lmcache.yaml"])
    assert written == run.lmcache
    assert json.loads(run.files["/w/model/config.json"])["num_key_value_heads"] == 8
    assert "/d/kv" in run.fresh_dirs and "/dev/shm" not in run.fresh_dirs
    assert any("--host 0.0.0.0 -> 127.0.0.1" in c for c in run.changes)


def test_a_shell_prelude_before_vllm_serve_is_recognised():
    """`/bin/sh -c 'PRELUDE; exec "$0" "$@"' vllm serve` + args: the vLLM argv is $0 $@."""
    docs = [d for d in yaml.safe_load_all(render(WORKSTATION)) if d]
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    c = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")
    plain = gm.localize(gm.parse_rendered(yaml.safe_dump_all(docs)), LAYOUT).engine_argv
    c["command"] = ["/bin/sh", "-c", 'find "$PROMETHEUS_MULTIPROC_DIR" -mindepth 1 -delete; exec "$0" "$@"', "vllm",
                    "serve"]
    r = gm.parse_rendered(yaml.safe_dump_all(docs))
    argv, prelude = gm.exec_argv(r.vllm)
    assert argv[:2] == ["vllm", "serve"] and argv[2] == "meta-llama/Llama-3.1-8B-Instruct" and "find" in prelude
    run = gm.localize(r, LAYOUT)
    assert run.engine_argv == plain and any("shell prelude" in ch for ch in run.changes)
    c["command"] = ["/bin/sh", "-c", "echo hi"]
    with pytest.raises(gm.ManifestError, match="expected \\['vllm', 'serve'\\]"):
        gm.localize(gm.parse_rendered(yaml.safe_dump_all(docs)), LAYOUT)


def test_baseline_drops_the_connector_and_nothing_else(tp1):
    with_c = gm.localize(tp1, LAYOUT).engine_argv
    without = gm.localize(tp1, LAYOUT, connector=False).engine_argv
    i = with_c.index(gm.CONNECTOR_FLAG)
    assert with_c[:i] + with_c[i + 2:] == without
    assert gm.CONNECTOR_FLAG not in without


def test_exporter_gets_the_rendered_sidecar_args_on_local_paths(tp1):
    run = gm.localize(tp1, LAYOUT)
    a = run.exporter_argv
    assert a[:4] == ["py", "-m", "kvoffload.cli", "exporter"]
    assert gm.flag(a, "--listen") == "127.0.0.1:19400"
    assert gm.flag(a, "--vllm-metrics-url") == "http://127.0.0.1:18000/metrics"
    assert gm.flag(a, "--multiproc-dir") == run.multiproc_dir
    assert gm.flag(a, "--lmcache-config") == run.lmcache_path
    assert gm.flag(a, "--disk-dir") == "/d/kv"
    assert gm.flag(a, "--kv-bytes-per-token") == str(gm.kv_bytes_per_token(llama_cfg(), "fp8"))


def test_overrides_for_the_disk_run_merge_into_the_rendered_config(tp1):
    run = gm.localize(tp1, LAYOUT, lmcache_overrides={"max_local_cpu_size": 5.0, "extra_config": {"use_odirect": True}},
                      extra_env={"LMCACHE_LOG_LEVEL": "DEBUG"})
    assert run.lmcache["max_local_cpu_size"] == 5.0 and run.lmcache["extra_config"] == {"use_odirect": True}
    assert run.lmcache["max_local_disk_size"] == 200.0 and run.engine_env["LMCACHE_LOG_LEVEL"] == "DEBUG"


def test_tp2_splits_the_tiers_per_rank(tp2):
    assert tp2.tp == 2
    cfg = tp2.lmcache_config()
    assert cfg["max_local_cpu_size"] == 20.0 and cfg["max_local_disk_size"] == 100.0
    assert gm.flag(gm.localize(tp2, LAYOUT).exporter_argv, "--tensor-parallel-size") == "2"


def test_bad_inputs_are_refused():
    with pytest.raises(gm.ManifestError, match="render it first"):
        gm.parse_rendered(WORKSTATION.read_text())
    with pytest.raises(gm.ManifestError, match="one StatefulSet"):
        gm.parse_rendered("kind: ConfigMap\nmetadata: {name: x}\n")
    with pytest.raises(gm.ManifestError, match="memory quantity"):
        gm.quantity("lots")
    assert gm.quantity("55194Mi") == 55194 * 2**20 and gm.quantity("2Gi") == 2 * 2**30 and gm.quantity("1000") == 1000


def test_model_config_agrees_with_the_catalog():
    for name in gm.HF_EXTRA:
        m = resolve_model(name)
        cfg = gm.model_config(m.hf_id, m.layers, m.attention_heads, m.kv_heads, m.head_dim, m.max_context, m.params)
        assert gm.params_of(cfg) == m.params
    assert gm.kv_bytes_per_token(llama_cfg(), "fp8") == 2 * 32 * 8 * 128
    with pytest.raises(gm.ManifestError, match="parameters"):
        gm.model_config("meta-llama/Llama-3.1-8B-Instruct", 32, 32, 8, 128, 131072, 8_000_000_000)
    with pytest.raises(gm.ManifestError, match="config-json"):
        gm.model_config("acme/unknown", 1, 1, 1, 1, None, 1)


# ------------------------------------------------------------------ exporter vs engine

def ref_page(name: str) -> str:
    return (FIXTURE_REF / name).read_text()


def lmcache_part(text: str) -> str:
    return "\n".join(ln for ln in text.splitlines() if "lmcache:" in ln) + "\n"


def exporter_page(vllm_text: str, *, external_hits: float | None = None) -> str:
    """What a correct exporter publishes for this engine page (written from the engine's figures)."""
    v, lm = gpu_counters.Page(vllm_text), gpu_counters.Page(lmcache_part(vllm_text))
    tokens = 119475 * 16
    hits = v.sum("vllm:external_prefix_cache_hits_total") if external_hits is None else external_hits
    lines = [f'kvoffload_tier_capacity_bytes{{tier="gpu"}} {tokens * 65536}',
             f'kvoffload_tier_capacity_bytes{{tier="cpu"}} {2 * 2**30}',
             'kvoffload_tier_used_bytes{tier="gpu"} 0.0',
             f'kvoffload_tier_used_bytes{{tier="cpu"}} {lm.sum("lmcache:local_cache_usage")}',
             f'kvoffload_tier_used_bytes{{tier="disk"}} {lm.sum("lmcache:local_storage_usage")}',
             f'kvoffload_tier_hit_tokens_total{{tier="gpu"}} {v.sum("vllm:prefix_cache_hits_total")}',
             f'kvoffload_tier_requested_tokens_total{{tier="gpu"}} {v.sum("vllm:prefix_cache_queries_total")}',
             f'kvoffload_tier_hit_tokens_total{{tier="external"}} {hits}',
             f'kvoffload_tier_requested_tokens_total{{tier="external"}} '
             f'{v.sum("vllm:external_prefix_cache_queries_total")}',
             f'kvoffload_tier_evictions_total{{tier="cpu"}} {lm.sum("lmcache:local_cpu_evict_keys_count_total")}',
             'kvoffload_offload_active 1.0', 'kvoffload_source_up{source="vllm"} 1.0',
             'kvoffload_source_up{source="lmcache"} 1.0']
    return "\n".join(lines) + "\n"


def compare(exporter: str, vllm_text: str, **kw):
    read = gpu_counters.EngineRead(vllm_text, lmcache_part(vllm_text))
    args = dict(kv_bytes_per_token=65536, lmcache_config={"max_local_cpu_size": 2.0, "local_cpu": True}, tp=1,
                connector=True, served=True)
    args.update(kw)
    return gpu_counters.compare(exporter, read, read, **args)


def test_reference_page_parses_to_the_engine_figures():
    page = gpu_counters.Page(ref_page("vllm-metrics-with-lmcache.txt"))
    assert page.sum("vllm:external_prefix_cache_hits_total") == 64028.0
    # LMCache never loaded under vLLM 0.26.0's V2 runner: its retrieve counters stayed 0.
    assert page.sum("lmcache:num_hit_tokens_total") == page.sum("lmcache:num_retrieve_requests_total") == 0.0
    assert page.sum("lmcache:local_cache_usage") == 2147483648.0


def test_a_correct_exporter_agrees_with_the_real_engine_page():
    text = ref_page("vllm-metrics-with-lmcache.txt")
    checks = compare(exporter_page(text), text)
    assert gpu_counters.disagreements(checks) == []
    assert sum(c.ok is True for c in checks) >= 12


def test_the_known_hit_counter_bug_is_reported_precisely():
    """An exporter that takes hits from lmcache:num_hit_tokens (0 under vLLM) publishes 0 external hits."""
    text = ref_page("vllm-metrics-with-lmcache.txt")
    bad = gpu_counters.disagreements(compare(exporter_page(text, external_hits=0.0), text))
    assert [(c.metric, c.labels, c.exporter, c.engine_lo) for c in bad] == [
        ("kvoffload_tier_hit_tokens_total", "tier=external", 0.0, 64028.0)]
    assert "**NO**" in gpu_counters.table(bad)


def test_counters_that_move_between_reads_agree_within_the_two_reads():
    text = ref_page("vllm-metrics-with-lmcache.txt")
    later = text.replace("vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} "
                         "63968.0",
                         "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} "
                         "96000.0")
    assert later != text
    exp = exporter_page(text).replace("kvoffload_tier_hit_tokens_total{tier=\"gpu\"} 63968.0",
                                      "kvoffload_tier_hit_tokens_total{tier=\"gpu\"} 80000.0")
    args = dict(kv_bytes_per_token=65536, lmcache_config={"max_local_cpu_size": 2.0}, tp=1, connector=True, served=True)
    a, b = gpu_counters.EngineRead(text, lmcache_part(text)), gpu_counters.EngineRead(later, lmcache_part(later))
    def gpu_hits(page: str) -> gpu_counters.Check:
        return next(c for c in gpu_counters.compare(page, a, b, **args)
                    if c.metric == "kvoffload_tier_hit_tokens_total" and c.labels == "tier=gpu")
    gpu = gpu_hits(exp)
    assert gpu.ok and (gpu.engine_lo, gpu.engine_hi) == (63968.0, 96000.0)
    outside = exp.replace("kvoffload_tier_hit_tokens_total{tier=\"gpu\"} 80000.0",
                          "kvoffload_tier_hit_tokens_total{tier=\"gpu\"} 99999.0")
    gpu = gpu_hits(outside)
    assert gpu.ok is False


def test_baseline_page_expects_no_offload_and_no_lmcache():
    text = ref_page("vllm-metrics-without-connector.txt")
    page = ("kvoffload_offload_active 0.0\nkvoffload_source_up{source=\"lmcache\"} 0.0\n"
            "kvoffload_tier_hit_tokens_total{tier=\"gpu\"} %s\n"
            % gpu_counters.Page(text).sum("vllm:prefix_cache_hits_total"))
    checks = {(c.metric, c.labels): c for c in compare(page, text, connector=False, lmcache_config=None)}
    assert checks[("kvoffload_offload_active", "")].ok
    assert checks[("kvoffload_source_up", "source=lmcache")].ok
    assert checks[("kvoffload_tier_hit_tokens_total", "tier=gpu")].ok
    assert ("kvoffload_tier_hit_tokens_total", "tier=external") not in checks
    # A figure the exporter left out while the engine has it is a disagreement, not a pass.
    assert checks[("kvoffload_tier_requested_tokens_total", "tier=gpu")].ok is False


def test_disk_figures_compare_with_the_directory_scan():
    text = ref_page("vllm-metrics-with-lmcache.txt")
    stored = gpu_counters.Page(text).sum("lmcache:local_storage_usage")
    read = gpu_counters.EngineRead(text, lmcache_part(text), disk_bytes=int(stored) + 4096, disk_files=252,
                                   disk_free=10**11)
    exp = exporter_page(text) + (f"kvoffload_disk_bytes {stored + 4096}\nkvoffload_disk_files 252\n"
                                 f"kvoffload_disk_free_bytes {10**11 - 2**20}\nkvoffload_disk_orphaned_bytes 0\n")
    checks = {(c.metric, c.labels): c for c in gpu_counters.compare(
        exp, read, read, kv_bytes_per_token=65536, lmcache_config={"max_local_cpu_size": 2.0}, tp=1, connector=True,
        served=True)}
    assert checks[("kvoffload_disk_bytes", "")].ok and checks[("kvoffload_disk_files", "")].ok
    assert checks[("kvoffload_disk_free_bytes", "")].ok  # within the free-space tolerance
    orphan = checks[("kvoffload_disk_orphaned_bytes", "")]
    assert orphan.ok is False and orphan.engine_lo == 4096.0


# ------------------------------------------------------------------ report

RESULTS = {
    "args": {"prompt_tokens": 32768},
    "host": {"gpus": 1, "name": "NVIDIA H200", "cpus": 16, "h2d_pinned_Bps": 5.0e10, "disk_read_odirect_Bps": 1.0e9},
    "runs": {
        "connector-tp1": {"kind": "connector", "tp": 1, "memory_limit": 10 * 2**30,
                          "memory": {"max_cg_anon_shmem_kernel": 8 * 2**30},
                          "phases": {"cold": [{"ttft_s": t, "local_compute": 32768} for t in (1.3, 1.2, 1.25)],
                                     "after_reset": [{"ttft_s": 0.05, "external_kv_transfer": 32767,
                                                      "local_compute": 1}] * 3}},
        "baseline-tp1": {"kind": "baseline", "tp": 1, "memory_limit": 10 * 2**30,
                         "memory": {"peak_used_rise": 12 * 2**30},
                         "phases": {"cold": [{"ttft_s": 1.1, "local_compute": 32768}] * 3,
                                    "after_reset": [{"ttft_s": 1.0, "local_compute": 32768}] * 3}},
        "disk-tp1": {"tp": 1, "phases": {"disk": [{"ttft_s": 2.5, "external_kv_transfer": 32767}]},
                     "disk_proof": [{"prompt_kv_bytes": 2**31, "proc_read_bytes": 2**31,
                                     "block_read_bytes": {"vda": 2**31},
                                     "lmcache_log": {"disk_read_lines": 128, "disk_read_bytes": 2**31,
                                                     "retrieved": []}}]},
    },
}


def test_report_medians_ratios_and_verdicts():
    md = gpu_report.report([RESULTS], {})
    assert "| cold (first time) | 1.250 s (n=3) |" in md
    assert ("| after POST /reset_prefix_cache | 0.050 s (n=3) | local compute 1, external kv transfer 32,767 | "
            "1.000 s (n=3) | local compute 32,768 | 20.0x |") in md
    assert "1 of 1 disk-phase requests proven to read from disk" in md
    assert "80% of the computed limit 10.0 GiB: fits" in gpu_report.memory_verdict(RESULTS["runs"]["connector-tp1"])
    assert "no verdict" in gpu_report.memory_verdict(RESULTS["runs"]["baseline-tp1"])
    over = {**RESULTS["runs"]["connector-tp1"], "memory": {"max_cg_anon_shmem_kernel": 11 * 2**30}}
    assert "too small" in gpu_report.memory_verdict(over)
    assert "far too large" in gpu_report.memory_verdict({**over, "memory": {"max_cg_anon_shmem_kernel": 2**30}})
    unproven = {**RESULTS["runs"]["disk-tp1"]["disk_proof"][0], "proc_read_bytes": 0}
    assert not gpu_report.proven(unproven)


def test_plan_argv_and_plan_rows_use_the_same_prompt_and_host():
    run = {"argv": ["py", "-m", "x", "serve", "/m", "--served-model-name", "meta-llama/Llama-3.1-8B-Instruct",
                    "--tensor-parallel-size", "2", "--kv-cache-dtype", "fp8", "--gpu-memory-utilization", "0.95"],
           "lmcache": {"max_local_cpu_size": 20.0, "max_local_disk_size": 100.0}}
    argv = gpu_report.plan_argv(run, 32768, RESULTS["host"])
    assert argv[argv.index("--cpu-size") + 1] == "40.0Gi" and argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--cpu-read-gbps") + 1] == "50.000" and argv[argv.index("--max-model-len") + 1] == "32768"
    out = subprocess.run([sys.executable, "-m", "kvoffload.cli", "plan", *argv], capture_output=True, text=True,
                         check=True)
    plan = json.loads(out.stdout)
    rows = "\n".join(gpu_report.plan_rows({"host": plan}, RESULTS["runs"], "tp1"))
    cpu = next(r for r in plan["reload"] if r["tier"] == "cpu")
    assert f"| reload from cpu | {cpu['reloadSeconds']:.3f} s | - | 0.050 s |" in rows


# ------------------------------------------------------------------ driver flow (stand-in vLLM)

def test_driver_runs_every_phase_against_a_stand_in_engine(tmp_path):
    """The whole driver (processes, phases, exporter checks, memory sampling, packing) against the
    stand-in vLLM in tests/fixtures/fake_vllm: tiny prompts, one rep, no GPU."""
    rendered = tmp_path / "tp1.yaml"
    rendered.write_text(render(WORKSTATION))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "fixtures" / "fake_vllm"),
                                                        str(ROOT / "operator")])}
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "gpu_bench.py"), "--rendered", str(rendered),
                    "--out", str(out), "--work", str(tmp_path / "work"), "--disk-root", str(tmp_path / "disk"),
                    "--no-smoke", "--no-probe", "--reps", "1", "--prompt-tokens", "64", "--rescan-wait", "2",
                    "--start-timeout", "30", "--disk-cpu-gib", "0.00001",
                    "--quiet-s", "0.3", "--stats-wait-s", "0.05"], env=env, check=True, timeout=240,
                   capture_output=True)
    res = json.loads((out / "results.json").read_text())
    runs = res["runs"]
    assert set(runs) == {"connector-tp1", "baseline-tp1", "disk-tp1"}
    assert all("error" not in r for r in runs.values()), [r.get("error") for r in runs.values()]
    con, base, disk = runs["connector-tp1"]["phases"], runs["baseline-tp1"]["phases"], runs["disk-tp1"]["phases"]
    assert con["cold"][0]["local_compute"] == 64 and con["gpu"][0]["local_cache_hit"] == 63
    assert con["after_reset"][0]["external_kv_transfer"] == 63 and base["after_reset"][0]["local_compute"] == 64
    assert disk["disk"][0]["external_kv_transfer"] == 63
    proof = runs["disk-tp1"]["disk_proof"][0]
    assert proof["lmcache_log"]["disk_read_lines"] == 1 and proof["lmcache_log"]["hits"] == [{"hit": 64, "load": 63}]
    assert runs["disk-tp1"]["flush_prompts"] >= 2
    assert "--kv-transfer-config" not in runs["baseline-tp1"]["argv"]
    checks = {(c["metric"], c["labels"]): c for c in runs["connector-tp1"]["checks"]}
    assert checks[("kvoffload_tier_hit_tokens_total", "tier=gpu")]["ok"]
    assert checks[("kvoffload_offload_active", "")]["exporter"] == 1.0
    assert runs["connector-tp1"]["memory"]["samples"] > 0
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert "logs/connector-tp1-engine.log" in names and "pages/connector-tp1-exporter.txt" in names
    assert not (out / "logs").exists()


# ------------------------------------------------------------------ the other backends (H200 run of 2026-11-30)

SERVER = ROOT / "examples" / "server-llama31-8b.yaml"
NATIVE = ROOT / "benchmarks" / "gpu" / "native-llama31-8b.yaml"
BACKENDS = ROOT / "tests" / "fixtures" / "h200-backends-vllm-0.26.0-lmcache-0.5.3"
import gpu_bench  # noqa: E402


def test_the_server_sidecar_runs_before_vllm_as_rendered():
    r = gm.parse_rendered(render(SERVER))
    assert r.backend == "lmcache-server" and [c.name for c in r.sidecars] == ["lmcache-server"]
    assert "lmcache-server" not in [c.name for c in r.init]  # not a run-to-completion init container
    run = gm.localize(r, LAYOUT)
    (sc,) = run.sidecars
    rendered = r.sidecars[0]
    assert sc.argv[:4] == ["py", "-m", "lmcache.cli.main", "server"]
    assert sc.argv[4:] == [a.replace("$(POD_NAME)", "server-llama31-8b-0") if not a.startswith("{") else sc.argv[4 + i]
                           for i, a in enumerate(rendered.args)]  # every flag as rendered, --no-l1-use-lazy too
    assert "--no-l1-use-lazy" in sc.argv
    assert json.loads(gm.flag(sc.argv, "--l2-adapter"))["base_path"] == LAYOUT.disk_dir  # /kvcache -> the disk dir
    assert sc.probe[0] == "py" and "http://127.0.0.1:8081/healthcheck" in sc.probe[-1]
    # The server's own request + the 40 GiB L1, which LMCache faults in from the server when it sees a GPU.
    assert sc.memory_limit == SERVER_REQUEST + 40 * 2**30
    base = gm.localize(r, LAYOUT, connector=False)
    assert base.sidecars == [] and "--kv-transfer-config" not in base.engine_argv


def test_native_baseline_drops_the_offloading_flags_only():
    r = gm.parse_rendered(render(NATIVE))
    assert r.backend == "vllm-native" and r.sidecars == ()
    con, base = gm.localize(r, LAYOUT), gm.localize(r, LAYOUT, connector=False)
    assert gm.flag(con.engine_argv, "--kv-offloading-size") == "40.0"
    assert [a for a in con.engine_argv if a not in base.engine_argv] == ["--kv-offloading-backend", "native",
                                                                         "--kv-offloading-size", "40.0"]


def test_model_dir_and_tmpdir_stay_short_host_paths():
    """The rendered pod mounts an emptyDir at /tmp: a model dir under the host's /tmp must not be
    mapped into it (vLLM then looked the path up on the Hub), and TMPDIR must stay short (LMCache's
    ZMQ ipc socket paths are capped at 107 characters)."""
    r = gm.parse_rendered(render(WORKSTATION))
    layout = gm.Layout(root="/root/kvbench/connector-tp2-v1runner", model_dir="/tmp/kvbench/model",
                       disk_dir="/d/kv", port=45321, exporter_port=19400, python="py")
    run = gm.localize(r, layout)
    assert run.engine_argv[4] == "/tmp/kvbench/model"
    assert run.engine_env["TMPDIR"] == "/tmp/kvb-45321"
    sock = f"{run.engine_env['TMPDIR']}/engine_a988a81b-e3c5-47d6-bf58-cc24af45ae16_service_lookup_lmcache_rpc_port_0"
    assert len(sock) <= 107


def test_reset_and_token_answers_of_vllm_0_26():
    assert not gpu_bench.reset_succeeded('{"success":false}')  # blocks held by in-flight stores
    assert gpu_bench.reset_succeeded('{"success":true}') and gpu_bench.reset_succeeded("")
    assert gpu_bench.output_tokens('{"choices":[{"text":"","token_ids":[125740]}]}') == [125740]
    assert gpu_bench.output_tokens('{"choices":[{"text":""}]}') is None


def test_exporter_agrees_with_the_real_server_and_native_engines():
    status = json.loads((BACKENDS / "server-status-lazy-l1.json").read_text())
    read = gpu_counters.EngineRead((BACKENDS / "server-vllm.txt").read_text(), "", server=status)
    checks = gpu_counters.compare((BACKENDS / "server-exporter.txt").read_text(), read, read, kv_bytes_per_token=131072,
                                  lmcache_config=None, tp=1, connector=True, served=True, backend="lmcache-server")
    by = {(c.metric, c.labels): c for c in checks}
    assert (by[("kvoffload_lmcache_server_engines", "")].ok
            and by[("kvoffload_tier_used_bytes", "tier=cpu")].exporter == 4362076160)
    assert by[("kvoffload_tier_capacity_bytes", "tier=cpu")].ok and not gpu_counters.disagreements(checks)
    read = gpu_counters.EngineRead((BACKENDS / "native-vllm.txt").read_text(), "")
    checks = gpu_counters.compare((BACKENDS / "native-exporter.txt").read_text(), read, read, kv_bytes_per_token=131072,
                                  lmcache_config=None, tp=1, connector=True, served=True, backend="vllm-native")
    by = {(c.metric, c.labels): c for c in checks}
    assert by[("kvoffload_offload_transfer_bytes_total", "direction=load")].engine_lo == 12891193344
    assert (by[("kvoffload_offload_transfer_bytes_total", "direction=store")].ok
            and not gpu_counters.disagreements(checks))
    # A wrong figure is caught: the exporter's load bytes off by one block.
    bad = (BACKENDS / "native-exporter.txt").read_text().replace("1.2891193344e+010", "1.2889096192e+010")
    checks = gpu_counters.compare(bad, read, read, kv_bytes_per_token=131072, lmcache_config=None, tp=1,
                                  connector=True, served=True, backend="vllm-native")
    assert [(c.metric, c.labels) for c in gpu_counters.disagreements(checks)] == [
        ("kvoffload_offload_transfer_bytes_total", "direction=load")]


def moved(disagreements: list[dict]) -> list[dict]:
    """The disagreements but free bytes: here the disk tier is this machine's shared disk, where background
    builds write gigabytes between the engine's reads and the exporter's (an H200 run keeps the check)."""
    return [d for d in disagreements if d["metric"] != "kvoffload_disk_free_bytes"]


def test_driver_runs_the_server_and_native_backends_against_stand_ins(tmp_path):
    """The driver with a stand-in `lmcache server` (tests/fixtures/fake_vllm/lmcache) and vLLM: the
    sidecar starts first and passes its rendered startup probe, its memory is sampled, /status is read
    around each request; the native run counts vLLM's offload bytes; reset answers are honoured."""
    out = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "fixtures" / "fake_vllm"),
                                                        str(ROOT / "operator")])}
    for name, spec in (("server", SERVER), ("native", NATIVE)):
        rendered = tmp_path / f"{name}.yaml"
        rendered.write_text(render(spec))
        o = tmp_path / f"out-{name}"
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "gpu_bench.py"), "--rendered", str(rendered),
                        "--out", str(o), "--work", str(tmp_path / "work"), "--disk-root", str(tmp_path / "disk"),
                        "--runs", "connector", f"--tag-suffix=-{name}", "--no-smoke", "--no-probe", "--reps", "1",
                        "--prompt-tokens", "64", "--rescan-wait", "2", "--start-timeout", "30", "--quiet-s", "0.3",
                        "--stats-wait-s", "0.05"], env=env, check=True, timeout=240, capture_output=True)
        out[name] = json.loads((o / "results.json").read_text())["runs"][f"connector-tp1-{name}"]
    srv, nat = out["server"], out["native"]
    assert "error" not in srv and "error" not in nat, (srv.get("error"), nat.get("error"))
    assert srv["backend"] == "lmcache-server" and srv["sidecar_ready_s"]["lmcache-server"] < 30
    assert srv["sidecar_memory"]["lmcache-server"]["limit"] == (3 + 40) * 2**30  # its process + the L1
    assert srv["sidecar_memory"]["lmcache-server"]["samples"] > 0
    assert srv["server_status_end"]["storage_manager"]["l1_manager"]["memory_total_bytes"] == 40 * 2**30
    row = srv["phases"]["after_reset"][0]
    assert row["external_kv_transfer"] == 63 and row["reset_attempts"] == 1 and row["output_token_ids"] == [1]
    assert "l1_used_bytes_delta" in row
    checks = {(c["metric"], c["labels"]): c for c in srv["checks"]}
    assert checks[("kvoffload_lmcache_server_engines", "")]["ok"] and not moved(srv["disagreements"])
    assert nat["phases"]["cold"][0]["offload_store_bytes"] == 64 * 64
    assert nat["phases"]["after_reset"][0]["offload_load_bytes"] == 63 * 64
    checks = {(c["metric"], c["labels"]): c for c in nat["checks"]}
    assert (checks[("kvoffload_offload_transfer_bytes_total", "direction=load")]["ok"]
            and not moved(nat["disagreements"]))


def test_driver_adds_engine_arguments_and_a_load_with_vllms_pages_sampled(tmp_path):
    """--kv-extra (LMCache's lazy store) and --engine-arg reach the rendered vLLM and are listed as changes; --load
    runs the cold prompts at its concurrency, then (repeat) the same prompts at once, then (again) after a reset from
    the store; the sampled pages hold the series the autoscaling queries read."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "fixtures" / "fake_vllm"),
                                                        str(ROOT / "operator")])}
    rendered = tmp_path / "server.yaml"
    rendered.write_text(render(SERVER))
    o = tmp_path / "out"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "gpu_bench.py"), "--rendered", str(rendered),
                    "--out", str(o), "--work", str(tmp_path / "work"), "--disk-root", str(tmp_path / "disk"),
                    "--runs", "connector", "--tag-suffix=-lazy", "--no-smoke", "--no-probe", "--reps", "1",
                    "--prompt-tokens", "64", "--rescan-wait", "2", "--start-timeout", "30", "--quiet-s", "0.3",
                    "--stats-wait-s", "0.05", "--kv-extra", '{"lmcache.mp.lazy_offload": true}',
                    "--engine-arg", "--num-gpu-blocks-override 512", "--load", "4:8:repeat:again,2:4",
                    "--load-tokens", "32"],
                   env=env, check=True, timeout=240, capture_output=True)
    run = json.loads((o / "results.json").read_text())["runs"]["connector-tp1-lazy"]
    assert "error" not in run, run.get("error")
    argv = run["argv"]
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_extra_config"]["lmcache.mp.lazy_offload"] is True
    assert kv["kv_connector_extra_config"]["lmcache.mp.port"]  # the rendered keys are kept
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "512"
    assert any("lazy_offload" in c for c in run["changes"]) and any("num-gpu-blocks-override" in c
                                                                    for c in run["changes"])
    first, second = run["load"]["steps"]
    assert (first["cold"]["concurrency"], first["cold"]["requests"], len(first["cold"]["ttft_s"])) == (4, 8, 8)
    assert first["cold"]["local_compute"] == 8 * 32 and first["again"]["external_kv_transfer"] == 8 * 31
    repeat = first["repeat"]
    assert repeat["requests"] == 8 and sum(repeat[k] for k in ("local_compute", "local_cache_hit",
                                                             "external_kv_transfer")) == 8 * 32
    assert "again" not in second and "repeat" not in second and second["cold"]["requests"] == 4
    pages = [json.loads(line) for line in (o / "series" / "connector-tp1-lazy.jsonl").read_text().splitlines()]
    assert len(pages) == run["load"]["pages"] > 0
    assert all("vllm:prompt_tokens_by_source_total" in p["page"] and "cache_config_info" not in p["page"]
               for p in pages)


@pytest.mark.parametrize("spec, steps", [
    ("16:32", [(16, 32, ())]),
    ("16:32:again,8:16", [(16, 32, ("again",)), (8, 16, ())]),
    ("16:32:again:repeat", [(16, 32, ("repeat", "again"))]),  # run in that order whatever the spelling
])
def test_load_steps(spec, steps):
    assert gpu_bench.load_steps(spec) == steps


@pytest.mark.parametrize("spec", ["16:32:agian", "16:32:again:again"])
def test_load_steps_refuses_unknown_or_repeated_modes(spec):
    with pytest.raises(ValueError, match="modes are repeat, again, each at most once"):
        gpu_bench.load_steps(spec)
