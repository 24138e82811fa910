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
    rc, out, err = run(capsys, *LLAMA, "--context", "32768", "--cpu-tier", "40Gi", "--disk-tier", "500Gi")
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
    rc, out, _ = run(capsys, *LLAMA, "--context", "32768", "--cpu-tier", "40Gi", "--disk-tier", "500Gi", "-o", "json")
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
    rc, out, _ = run(capsys, *LLAMA, "--tp", "16", "--context", "32768", "-o", "json")
    doc = json.loads(out)
    assert rc == 0 and (doc["kvBytesPerTokenPerGpu"], doc["kvBytesPerToken"]) == (16384, 262144)
    assert any("--tp 16 > 8 KV heads" in w for w in doc["warnings"])


def test_architecture_overrides_for_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--model", "acme/tiny", "--layers", "16", "--kv-heads", "4", "--attention-heads", "16",
                     "--head-dim", "64", "--params", "1.2e9", "--context", "8192", "-o", "json")
    doc = json.loads(out)
    assert rc == 0 and doc["kvBytesPerToken"] == 2 * 16 * 4 * 64 * 2
    assert doc["inputs"]["model"]["parameters"] == 1_200_000_000


def test_overrides_for_memory_and_bandwidth(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, *LLAMA, "--context", "32768", "--cpu-tier", "8Gi", "--disk-tier", "100Gi",
                     "--engine-baseline", "6Gi", "--shm", "4Gi", "--staging-per-worker", "512Mi",
                     "--headroom-percent", "0", "--headroom-min", "0", "--disk-read-gbps", "7", "-o", "json")
    doc = json.loads(out)
    terms = {t["name"]: t["bytes"] for t in doc["memory"]["terms"]}
    assert rc == 0 and (terms["engine_baseline"], terms["shm"], terms["staging"]) == (6 * GiB, 4 * GiB, 512 * MiB)
    assert doc["memory"]["limit"] == (6 + 2 + 8 + 4) * GiB + 512 * MiB
    assert [r["slowerThanRecompute"] for r in doc["reload"]] == [False, False]


def test_24gib_gpu_case(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, *LLAMA, "--gpu-memory", "24Gi", "--gpu-memory-utilization", "0.5", "--context", "65536")
    assert rc == 2
    assert err.startswith("error: --gpu-memory:") and "14.96 GiB" in err and "--tp" in err and "spec." not in err
    rc, out, _ = run(capsys, *LLAMA, "--gpu-memory", "24Gi", "--context", "65536", "--dtype", "fp8", "-o", "json")
    assert rc == 0 and json.loads(out)["tiers"][0]["tokens"] == 198594


@pytest.mark.parametrize("argv, option", [
    (["--cpu-tier=-4Gi"], "--cpu-tier"),
    (["--cpu-tier", "lots"], "--cpu-tier"),
    (["--disk-tier", "12Qi", "--cpu-tier", "1Gi"], "--disk-tier"),
    (["--disk-tier", "100Gi"], "--cpu-tier"),  # disk tier without a CPU tier
    (["--gpu-memory", "0"], "--gpu-memory"),
    (["--kv-dtype", "int4"], "--kv-dtype"),
    (["--dtype", "fp32"], "--dtype"),
    (["--tp", "3"], "--tp"),
    (["--tp", "x"], "--tp"),
    (["--gpus", "2"], "--gpus"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--context", "0"], "--context"),
    (["--context", "1e6"], "--context"),
    (["--concurrency", "0"], "--concurrency"),
    (["--context", "262144", "--gpu-memory", "24Gi", "--dtype", "fp8"], "--context"),  # 16 GiB > 12.1 GiB
    (["--engine-baseline", "-1"], "--engine-baseline"),
    (["--disk-read-gbps", "0", "--cpu-tier", "1Gi", "--disk-tier", "1Gi"], "--disk-read-gbps"),
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
    rc, _, err = run(capsys, "--model", "deepseek-ai/DeepSeek-V3", "--config-json", str(path), "--tp", "8")
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
    rc, out, _ = run(capsys, *LLAMA, "--context", "8192", "-o", "json")
    w = json.loads(out)["weights"]
    assert rc == 0 and w["bytes"] == 8_030_261_248 * 2
    assert w["volume"] == 19 * GiB and w["ephemeralStorage"] == 31 * GiB
    assert {t["name"]: t["seconds"] for t in w["startupTerms"]} == {"download": 322, "load": 18, "engine": 600}
    assert w["startupSeconds"] == 940
    rc, out, _ = run(capsys, *LLAMA, "--context", "8192", "--weights-on-pvc", "--download-mbps", "500")
    assert rc == 0
    assert "local disk (ephemeral-storage request): 12Gi" in out
    assert "on the model cache PVC" in out and "at 500 MB/s (assumed)" in out
    assert "start-up probe budget: 660 s" in out  # 33 + 18 + 600, rounded up to the probe period
    rc, _, err = run(capsys, *LLAMA, "--download-mbps", "0")
    assert rc == 2 and "--download-mbps" in err
