"""`kvoffload plan` end to end through kvoffload.cli.main: outputs, and errors that name the option."""

from __future__ import annotations

import json

import pytest
import yaml

from kvoffload.api.quantity import GiB, MiB
from kvoffload.cli import main as cli

LLAMA = ["--model", "meta-llama/Llama-3.1-8B-Instruct"]


@pytest.fixture(autouse=True)
def only_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    # cli.main imports every sub-command; these tests exercise `plan` alone.
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"plan": "kvoffload.cli.plan"})


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        rc = cli.main(["plan", *argv])
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_table(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, *LLAMA, "--max-model-len", "32768", "--cpu-size", "40Gi", "--disk-size", "500Gi")
    assert (rc, err) == (0, "")
    assert "131072 B/token per replica" in out and "one 32768-token request: 4 GiB" in out
    rows: dict[str, list[str]] = {}
    for line in out.splitlines():  # the first gpu/cpu/disk rows are the tier table
        if line.split()[:1] in (["gpu"], ["cpu"], ["disk"]):
            rows.setdefault(line.split()[0], line.split())
    assert rows["gpu"][-2:] == ["450,907", "13"]
    assert rows["cpu"][-2:] == ["327,680", "10"]
    assert rows["disk"][-2:] == ["4,096,000", "125"]
    assert "memory request = limit: 55194Mi" in out
    for term in ("engine_baseline", "worker_overhead", "cpu_tier", "staging", "shm", "headroom"):
        assert f"  {term} " in out
    disk_line = next(line for line in out.splitlines() if line.strip().startswith("disk") and "reload" in line)
    assert "SLOWER" in disk_line
    assert "warnings:" in out and "spec." not in out


def test_json_has_inputs_and_budget(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, *LLAMA, "--max-model-len", "32768", "--cpu-size", "40Gi", "--disk-size", "500Gi", "-o",
                     "json")
    doc = json.loads(out)
    assert rc == 0
    assert doc["inputs"]["maxModelLen"] == 32768 and doc["inputs"]["cpuTier"] == 40 * GiB
    assert doc["inputs"]["model"]["kvHeads"] == 8
    assert doc["kvBytesPerToken"] == 131072
    assert [t["name"] for t in doc["tiers"]] == ["gpu", "cpu", "disk"]
    assert doc["memory"]["limit"] == 55194 * MiB
    assert [r["slowerThanRecompute"] for r in doc["reload"]] == [False, True]


def test_yaml_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, *LLAMA, "--output", "yaml")
    doc = yaml.safe_load(out)
    assert rc == 0
    assert doc["inputs"]["maxModelLen"] == 131072  # the model's max_position_embeddings
    assert doc["inputs"]["gpuMemory"] == 80 * GiB and doc["inputs"]["tensorParallelSize"] == 1
    assert doc["reload"] == [] and doc["tiers"][1]["bytes"] == 0


def test_tp16_replication(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, *LLAMA, "--tensor-parallel-size", "16", "--max-model-len", "32768", "-o", "json")
    doc = json.loads(out)
    assert rc == 0 and (doc["kvBytesPerTokenPerGpu"], doc["kvBytesPerToken"]) == (16384, 262144)
    assert any("--tensor-parallel-size 16 > 8 KV heads" in w for w in doc["warnings"])


def test_architecture_overrides_for_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--model", "acme/tiny", "--layers", "16", "--kv-heads", "4", "--attention-heads", "16",
                     "--head-dim", "64", "--parameters", "1.2e9", "--max-model-len", "8192", "-o", "json")
    doc = json.loads(out)
    assert rc == 0 and doc["kvBytesPerToken"] == 2 * 16 * 4 * 64 * 2
    assert doc["inputs"]["model"]["parameters"] == 1_200_000_000


def test_overrides_for_memory_and_bandwidth(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, *LLAMA, "--max-model-len", "32768", "--cpu-size", "8Gi", "--disk-size", "100Gi",
                     "--engine-baseline", "6Gi", "--shm", "4Gi", "--staging-per-worker", "512Mi",
                     "--headroom-percent", "0", "--headroom-min", "0", "--disk-read-gbps", "7", "-o", "json")
    doc = json.loads(out)
    terms = {t["name"]: t["bytes"] for t in doc["memory"]["terms"]}
    assert rc == 0 and (terms["engine_baseline"], terms["shm"], terms["staging"]) == (6 * GiB, 4 * GiB, 512 * MiB)
    assert doc["memory"]["limit"] == (6 + 2 + 8 + 4) * GiB + 512 * MiB
    assert [r["slowerThanRecompute"] for r in doc["reload"]] == [False, False]


def test_24gib_gpu_case(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, *LLAMA, "--gpu-memory", "24Gi", "--gpu-memory-utilization", "0.5", "--max-model-len",
                     "65536")
    assert rc == 2
    assert (err.startswith("error: --gpu-memory:") and "14.96 GiB" in err and "--tensor-parallel-size" in err
            and "spec." not in err)
    rc, out, _ = run(capsys, *LLAMA, "--gpu-memory", "24Gi", "--max-model-len", "65536", "--dtype", "fp8", "-o", "json")
    assert rc == 0 and json.loads(out)["tiers"][0]["tokens"] == 198594


@pytest.mark.parametrize("argv, option", [
    (["--cpu-size=-4Gi"], "--cpu-size"),
    (["--cpu-size", "lots"], "--cpu-size"),
    (["--disk-size", "12Qi", "--cpu-size", "1Gi"], "--disk-size"),
    (["--disk-size", "100Gi"], "--cpu-size"),  # disk tier without a CPU tier
    (["--gpu-memory", "0"], "--gpu-memory"),
    (["--kv-cache-dtype", "int4"], "--kv-cache-dtype"),
    (["--dtype", "fp32"], "--dtype"),
    (["--tensor-parallel-size", "3"], "--tensor-parallel-size"),
    (["--tensor-parallel-size", "x"], "--tensor-parallel-size"),
    (["--gpus", "2"], "--gpus"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--max-model-len", "0"], "--max-model-len"),
    (["--max-model-len", "1e6"], "--max-model-len"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--max-model-len", "262144", "--gpu-memory", "24Gi", "--dtype", "fp8"], "--max-model-len"),  # 16 GiB > 12.1 GiB
    (["--engine-baseline", "-1"], "--engine-baseline"),
    (["--disk-read-gbps", "0", "--cpu-size", "1Gi", "--disk-size", "1Gi"], "--disk-read-gbps"),
])
def test_bad_input_exits_2_naming_the_option(capsys: pytest.CaptureFixture[str], argv: list[str], option: str) -> None:
    rc, out, err = run(capsys, *LLAMA, *argv)
    assert rc == 2 and out == ""
    assert option in err and "spec." not in err


def test_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "--model", "acme/unknown")
    assert rc == 2 and err.startswith("error: --model:")
    assert "not in the built-in catalog" in err and "--layers" in err and "Qwen/Qwen3-8B" in err


def test_partial_architecture_names_missing_option(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "--model", "acme/unknown", "--layers", "8")
    assert rc == 2 and err.startswith("error: --kv-heads:")


def test_config_json_option(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512}))
    rc, _, err = run(capsys, "--model", "deepseek-ai/DeepSeek-V3", "--config-json", str(path), "--tensor-parallel-size",
                     "8")
    assert rc == 2 and err.startswith("error: --model:") and "MLA" in err


def test_every_planning_input_has_an_option() -> None:
    """Planning errors name inputs by key; the CLI names each by an option it really has."""
    import argparse

    from kvoffload.api.spec import PLAN_FIELDS
    from kvoffload.cli import plan as plan_cli

    parser = argparse.ArgumentParser()
    plan_cli.register(parser.add_subparsers())
    options = {o for a in parser._subparsers._group_actions[0].choices["plan"]._actions for o in a.option_strings}
    assert set(PLAN_FIELDS) <= set(plan_cli.OPTION_FOR_INPUT)
    for key, names in plan_cli.OPTION_FOR_INPUT.items():
        assert set(names.split("/")) <= options, key


def test_weights_storage_and_startup_budget(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, *LLAMA, "--max-model-len", "8192", "-o", "json")
    w = json.loads(out)["weights"]
    assert rc == 0 and w["bytes"] == 8_030_261_248 * 2
    assert w["volume"] == 19 * GiB and w["ephemeralStorage"] == 31 * GiB
    assert {t["name"]: t["seconds"] for t in w["startupTerms"]} == {"download": 322, "load": 18, "engine": 311}
    assert w["startupSeconds"] == 660
    rc, out, _ = run(capsys, *LLAMA, "--max-model-len", "8192", "--weights-on-pvc", "--download-mbps", "500")
    assert rc == 0
    assert "local disk (ephemeral-storage request): 12Gi" in out
    assert "on the model cache PVC" in out and "at 500 MB/s (assumed)" in out
    assert "start-up probe budget: 370 s" in out  # 33 + 18 + 311 (vLLM 0.33.0's), rounded up to the probe period
    rc, _, err = run(capsys, *LLAMA, "--download-mbps", "0")
    assert rc == 2 and "--download-mbps" in err


def test_help_shows_each_default_once_and_never_none(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--help")
    assert rc == 0 and "(default: None)" not in out and "default: 4Gi" not in out
    text = " ".join(out.split())
    assert text.count("(default: operator setting engineBaseline, 4Gi)") == 1
    assert "--max-num-seqs MAX_NUM_SEQS spec.engine.maxNumSeqs, vLLM --max-num-seqs (default: 256)" in text
    for entry in text.split(" --")[1:]:  # one option's help each
        assert entry.count("(default") <= 1, entry


def test_file_is_planned_as_the_operator_plans_it(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """`plan -f` goes through the operator's own parse -> plan (pipeline.desired).

    The same budget, field names in errors."""
    from kvoffload.api.settings import Settings
    from kvoffload.controller import pipeline
    from kvtest import ROOT
    from kvtest.specs import example

    path = ROOT / "examples" / "tp8-llama33-70b.yaml"
    rc, out, err = run(capsys, "-f", str(path), "-o", "json")
    assert (rc, err) == (0, "")
    (doc,) = json.loads(out)
    obj = example("tp8-llama33-70b.yaml")
    ns = obj["metadata"].get("namespace", "default")
    want = pipeline.desired(obj["metadata"]["name"], ns, "", obj["spec"], Settings()).budget.to_dict()
    assert {k: v for k, v in doc.items() if k not in ("resource", "inputs")} == want
    assert doc["resource"] == f"{ns}/{obj['metadata']['name']}" and doc["inputs"]["tensorParallelSize"] == 8
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**obj, "spec": {**obj["spec"], "metrics": {"port": 8000}}}))
    rc, _, err = run(capsys, "-f", str(bad))
    assert rc == 2 and "spec.metrics.port: 8000 is the vllm container's port" in err
    rc, _, err = run(capsys, "-f", str(path), "--max-model-len", "1024")
    assert rc == 2 and "--max-model-len" in err and "in the file" in err


def test_the_bandwidth_behind_a_verdict_is_named(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """No hidden constant decides "slower than recompute": the option, the operator's setting or the spec field says."""
    base = [*LLAMA, "--max-model-len", "32768", "--cpu-size", "8Gi", "--disk-size", "100Gi", "-o", "json"]
    rc, out, _ = run(capsys, *base)
    disk = json.loads(out)["reloadFigures"][1]
    assert (rc == 0 and disk["readFrom"] == "operator setting diskReadGbps"
            and disk["readBytesPerSecond"] == round(0.9384999892678052e9, 4))
    cfg = tmp_path / "operator.yaml"
    cfg.write_text("diskReadGbps: 7\nprefillTokensPerSecond: 1000\n")
    rc, out, _ = run(capsys, *base, "--operator-config", str(cfg))
    doc = json.loads(out)
    assert [r["slowerThanRecompute"] for r in doc["reload"]] == [False, False]  # the admin's disk and prefill figures
    assert (doc["reloadFigures"][1]["readBytesPerSecond"] == 7e9
            and doc["reloadFigures"][1]["prefillFrom"].startswith("operator"))
    rc, out, _ = run(capsys, *base, "--operator-config", str(cfg), "--disk-read-gbps", "0.1")
    doc = json.loads(out)
    assert doc["reloadFigures"][1]["readFrom"] == "--disk-read-gbps" and doc["reload"][1]["slowerThanRecompute"]
    rc, out, _ = run(capsys, *LLAMA, "--max-model-len", "32768", "--cpu-size", "8Gi", "--disk-size", "100Gi")
    assert "disk read at 0.938 GB/s (operator setting diskReadGbps)" in out


def test_spec_bandwidths_decide_and_status_says_so() -> None:
    from kvoffload.api.settings import Settings
    from kvoffload.controller import pipeline
    from kvtest.specs import spec

    slow = pipeline.desired("svc", "ns", "", spec(), Settings()).budget
    assert slow.reload[1].slower_than_recompute and "(operator setting diskReadGbps)" in " ".join(slow.warnings)
    fast = pipeline.desired("svc", "ns", "", spec(offload__disk__readGbps=12), Settings()).budget
    assert not fast.reload[1].slower_than_recompute
    assert fast.to_dict()["reloadFigures"][1] | {"prefillFrom": ""} == {
        "tier": "disk", "readBytesPerSecond": 12e9, "readFrom": "spec.offload.disk.readGbps",
        "prefillTokensPerSecond": round(fast.reload[1].prefill_tokens_per_s, 4), "prefillFrom": ""}
    admin = pipeline.desired("svc", "ns", "", spec(), Settings(disk_read_gbps=12)).budget
    assert not admin.reload[1].slower_than_recompute and admin.reload[1].read_from == "operator setting diskReadGbps"
