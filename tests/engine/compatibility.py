"""docs/compatibility.md: the (vLLM, LMCache) pairs, each row generated from the checks behind it.

    python tests/engine/compatibility.py           rewrite docs/compatibility.md
    python tests/engine/compatibility.py --check   fail if it is not what the checks give now
    python tests/engine/compatibility.py --fetch   only fetch what the checks read from PyPI (`make engine-metadata`)

Tests never reach the network: what comes from PyPI (wheel metadata, LMCache wheels) is fetched by
`--fetch` (a `make test` install step) or by a rewrite, and read from the cache otherwise.

Checks per pair (run with the operator's venv; the engine's code runs in the engine venvs):
- torch pins: each wheel's own Requires-Dist (PEP 658 metadata via `pip install --dry-run --report`:
  no wheel download), cached under ~/.cache/kvoffload/wheel-metadata;
- LMCache's CUDA extension loads against vLLM's torch, on CPU: `import torch`, then the extension's
  shared object (found by its ELF DT_NEEDED) loaded by file with every symbol bound
  (images/serving/extension_check.py). Needs a venv holding that torch (an engine venv from
  tests/engine/build-venv.sh) and the LMCache build: for a PyPI wheel the venv's own or the wheel
  downloaded once; for LMCache built from source, the offered pair's venv, where it was compiled
  against that torch; otherwise "not checked";
- vLLM's parser and create_engine_config() accept the rendered command lines of all examples, and
  LMCache's loader reads their rendered configs without a warning: where an engine venv for the
  exact pair exists (every pair the operator offers has one), otherwise "not checked";
- ran on a GPU: only what a recorded run showed (shared/reference), never inferred.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import engine_venv  # noqa: E402

from kvoffload.engine import images  # noqa: E402

DOC = engine_venv.ROOT / "docs" / "compatibility.md"
META = engine_venv.CACHE / "wheel-metadata"
WHEELS = engine_venv.CACHE / "wheels"
PY = engine_venv.site_packages(engine_venv.venv_path()).parent.name.removeprefix("python") \
    if engine_venv.venv_path().is_dir() else "3.11"  # the engine venv's Python: LMCache wheels are per Python

# Pairs users run or ask about (with LMCache's PyPI wheel), besides the images the operator knows.
CANDIDATES = [("0.26.0", "0.5.4", "wheel"), ("0.29.0", "0.5.4", "wheel"), ("0.29.0", "0.5.6", "wheel"),
              ("0.33.0", "0.5.6", "wheel")]
Pair = tuple[str, str, str]  # (vLLM, LMCache, how LMCache was built: "wheel" | "source")
# Runs on real GPUs (evidence, not inference).
GPU_RUNS = {
    ("0.26.0", "0.5.3", "wheel"): "yes: NVIDIA H200, 2026-11-30, the rendered workstation example with the V1 model "
                         "runner: a 32,768-token prefix came back from the CPU tier in 0.074 s (1.096 s recomputed), "
                         "from the disk tier in 1.405 s (docs/benchmarks.md); 2026-12-01, every backend as real "
                         "containers (crun 1.8.1, UID 1000, read-only root, RuntimeDefault seccomp, the rendered "
                         "memory limits enforced): lmcache reload 0.095 s (CPU) / 1.134 s (disk only), lmcache-server "
                         "0.146 s through shared memory (its container at its 43 GiB limit), vllm-native 0.153 s "
                         "within its limit; same token after every reload, no OOM kill (docs/benchmarks.md); "
                         "2026-12-01 (second session), from the OCI specs the real node's containerd generated for "
                         "each rendered pod: lmcache reload 0.110 s (CPU tier; no connector 1.114 s), lmcache-server "
                         "0.149-0.153 s with its disk tier written with O_DIRECT (its container 40.6 of 43.0 GiB, no "
                         "reclaim at the limit), same token after every reload, no OOM kill (docs/benchmarks.md); "
                         "2026-12-01 (third session), the rest from those captures: vllm-native 0.174 s (its container "
                         "67.5 of 79.2 GiB), lmcache-server with its read-only-root sidecar 0.171 s, the disk tier "
                         "alone 1.261 s (= recompute: 2.15 GB read at 1.5-1.8 GB/s); same token after every reload, no "
                         "OOM kill (docs/benchmarks.md)",
    ("0.33.0", "0.5.6", "source"): "yes, every backend: NVIDIA H200, as real containers (crun 1.8.1, the real "
                                   "node's captures) on the carried torch 2.14.0 and LMCache 0.5.6 compiled for "
                                   "sm_90, 32,768-token prompts: 2026-12-01, lmcache (the rendered workstation "
                                   "example, V1 model runner) reloaded from the CPU tier in 0.110 s (1.170 s "
                                   "recomputed), vLLM's container 48.7 of 53.9 GiB; 2026-12-03, lmcache's disk tier "
                                   "alone 1.454 s (2.15 GB read per reload; the exporter agreed on 20 of 20 checks), "
                                   "vllm-native with its /dev/shm region sized 0.172 s (1.213 s cold, its container "
                                   "45.9 of 56.7 GB), lmcache-server with --shm-name 0.170 s through shared memory "
                                   "(1.235 s cold; its container 40.6 of 45.0 GiB; the exporter agreed on 17 of 17); "
                                   "same token after every reload, no OOM kill (docs/benchmarks.md)",
}


FETCH = False  # True for --fetch and a rewrite; tests read the cache only


def _fetching(what: str) -> None:
    if not FETCH:
        raise AssertionError(f"{what} is not in {engine_venv.CACHE}: run `make "
                             "engine-metadata` (tests never reach the network)")


def metadata(name: str, version: str) -> dict:
    """The wheel's core metadata, fetched once with pip's ordinary client (PEP 658: no wheel download)."""
    path = META / f"{name}-{version}.json"
    if not path.is_file():
        _fetching(f"{name} {version}'s wheel metadata")
        META.mkdir(parents=True, exist_ok=True)
        report = META / f".{name}-{version}.report"
        cp = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
                             "--quiet",
                             "--only-binary=:all:", "--python-version", PY, "--platform", "manylinux_2_28_x86_64",
                             "--target", str(META / ".unused"), "--report", str(report), f"{name}=={version}"],
                            capture_output=True, text=True, timeout=300)
        assert cp.returncode == 0, cp.stderr
        (item,) = json.loads(report.read_text())["install"]
        path.write_text(json.dumps(item["metadata"], indent=1, sort_keys=True))
        report.unlink()
    return json.loads(path.read_text())


def torch_requirement(name: str, version: str) -> str:
    reqs = [r for r in metadata(name, version).get("requires_dist", [])
            if r.split(";")[0].strip().split("=")[0].split("<")[0]
            .split(">")[0].strip() == "torch"]
    return reqs[0].split(";")[0].strip().removeprefix("torch") or "any" if reqs else "none"


def torch_pin(vllm: str) -> str | None:
    req = torch_requirement("vllm", vllm)
    return req.removeprefix("==") if req.startswith("==") else None


def engine_venvs() -> dict[Pair, Path]:
    """The engine venvs `make test` builds, one per offered pair (only those: the document must not depend
    on what else a machine has)."""
    return {(p.vllm, p.lmcache, p.lmcache_from): engine_venv.require(p.vllm, p.lmcache) for p in engine_venv.PAIRS}


def torch_of(venv: Path) -> str:
    (info,) = engine_venv.site_packages(venv).glob("torch-*.dist-info")
    return info.name.removeprefix("torch-").removesuffix(".dist-info")


def lmcache_tree(lmcache: str, venvs: dict[Pair, Path]) -> Path | None:
    """Where LMCache `lmcache`'s wheel files lie: an engine venv that installed that wheel, or the wheel
    extracted (if downloaded)."""
    for (_, held, built), venv in venvs.items():
        if held == lmcache and built == "wheel":
            return engine_venv.site_packages(venv)
    pattern = f"lmcache-{lmcache}-cp{PY.replace('.', '')}-*.whl"
    if not list(WHEELS.glob(pattern)):  # fetched once with pip's ordinary client (~16 MB), then cached
        _fetching(f"the LMCache {lmcache} wheel")
        cp = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                             "--python-version", PY, "--platform", "manylinux_2_28_x86_64", "-d", str(WHEELS),
                             f"lmcache=={lmcache}"], capture_output=True, text=True, timeout=600)
        assert cp.returncode == 0, cp.stderr
    wheels = sorted(WHEELS.glob(pattern))
    if not wheels:
        return None
    tree = WHEELS / f"lmcache-{lmcache}"
    if not tree.is_dir():
        with zipfile.ZipFile(wheels[0]) as z:
            z.extractall(tree)
    return tree


def extension_load(pair: Pair, venvs: dict[Pair, Path]) -> str:
    vllm, lmcache, built = pair
    torch = torch_pin(vllm)
    if built == "source":  # compiled in the pair's own venv against its torch
        host = venvs.get(pair)
        tree = engine_venv.site_packages(host) if host else None
    else:
        host = next((v for v in venvs.values() if torch and torch_of(v) == torch), None)
        tree = lmcache_tree(lmcache, venvs)
    if host is None or tree is None:
        return (f"not checked (no engine venv with torch {torch})" if host is None
                else f"not checked (no LMCache {lmcache} wheel)")
    exts = [so for so in sorted((tree / "lmcache").glob("*.so")) if engine_venv.is_cuda_extension(so)]
    if not exts:
        return f"no: LMCache {lmcache}'s {built} build has no CUDA extension"
    so = exts[0]
    name = "lmcache." + so.name.split(".")[0]
    code = ("import sys, torch, extension_check; "
            "extension_check.load(sys.argv[1], __import__('pathlib').Path(sys.argv[2]))")
    cp = subprocess.run([engine_venv.python(host), "-c", code, name, str(so)], capture_output=True, text=True,
                        timeout=300,
                        cwd=engine_venv.ROOT / "images" / "serving")  # -c: the cwd is on sys.path
    if cp.returncode == 0:
        return f"yes: {name} loads against torch {torch}"
    err = cp.stderr.strip().splitlines()[-1] if cp.stderr.strip() else f"exit {cp.returncode}"
    if "undefined symbol" in err:
        err = "undefined symbol " + err.split("undefined symbol:")[-1].strip()[:60]
    return f"no: {name} against torch {torch}: {err}"


def rendered_examples(image: str) -> tuple[list[dict], list[dict]]:
    """Every example as the operator renders it for the serving image `image` (its pair)."""
    import yaml

    from kvoffload.api.errors import ConfigError
    from kvoffload.api.settings import Settings
    from kvoffload.controller import pipeline
    from kvtest.fidelity import case, for_image  # the fidelity tests' case builder

    vllm_cases, lmcache_cases = [], []
    for path in sorted((engine_venv.ROOT / "examples").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        try:
            d = pipeline.desired(doc["metadata"]["name"], "ns", "uid", for_image(doc["spec"], image), Settings())
        except ConfigError:
            continue  # the deliberately infeasible example renders nothing
        v, lm = case(path.stem, d)
        vllm_cases.append(v)
        if lm is not None:  # only backend lmcache renders an LMCache config
            lmcache_cases.append(lm)
    return vllm_cases, lmcache_cases


def engine_checks(pair: Pair, venvs: dict[Pair, Path]) -> tuple[str, str]:
    venv = venvs.get(pair)
    if venv is None:
        return "not checked (no engine venv for this pair)", "not checked (no engine venv for this pair)"
    (image,) = [i for i, k in images.serving_images().items() if (k.vllm, k.lmcache, k.lmcache_from) == pair]
    vllm_cases, lmcache_cases = rendered_examples(image)
    out = engine_venv.run(venv, "check", {"vllm": vllm_cases, "lmcache": lmcache_cases})
    bad = [r["id"] for r in out["vllm"] if not r["ok"]]
    parser = f"yes: {len(out['vllm'])} example command lines" if not bad else f"no: {', '.join(bad)}"
    warned = [r["id"] for r in out["lmcache"] if not r["ok"] or r["warnings"]]
    loader = f"yes: {len(out['lmcache'])} example configs, no warning" if not warned else f"no: {', '.join(warned)}"
    return parser, loader


NOT_RUN = "not run on a GPU"
# lmcache-server on vLLM 0.33.0 + LMCache 0.5.6 with the --shm-name fix (backends/lmcache_server.py): to be replaced by
# what its H200 run shows (docs/benchmarks.md), as the other backends' figures above are.
def rows() -> list[dict[str, str]]:
    venvs = engine_venvs()
    offered = images.serving_images()
    known = sorted(images.KNOWN_IMAGES.items(), key=lambda kv: (kv[0] != images.DEFAULT_IMAGE, kv[0] not in offered,
                                                                kv[0]))
    pairs: list[tuple[str, tuple[str | None, str | None, str]]] = [(image, (k.vllm, k.lmcache, k.lmcache_from))
                                                                   for image, k in known]
    pairs += [("", c) for c in CANDIDATES]
    out = []
    for image, (vllm, lmcache, built) in pairs:
        row = {"image": f"`{image}`" + (" (default)" if image == images.DEFAULT_IMAGE else "") if image else "—",
               "vllm": vllm or "unpinned", "offered": image in offered,
               "lmcache": (lmcache or "unpinned") + (" (built from source)" if built == "source" else "")}
        if vllm is None or lmcache is None:
            row.update(torch="unknown: the image installs an unpinned vLLM", ext="not checked", parser="not checked",
                       loader="not checked", gpu=NOT_RUN)
        else:
            pin = torch_pin(vllm)
            lreq = (f"compiled against torch {torch_of(venvs[(vllm, lmcache, built)])}" if built == "source" and
                    (vllm, lmcache, built) in venvs else f"torch {torch_requirement('lmcache', lmcache)}")
            row["torch"] = f"vLLM: torch=={pin}; LMCache: {lreq}"
            row["ext"] = extension_load((vllm, lmcache, built), venvs)
            row["parser"], row["loader"] = engine_checks((vllm, lmcache, built), venvs)
            row["gpu"] = GPU_RUNS.get((vllm, lmcache, built), NOT_RUN)
        env = images.connector_env(images.EnginePair(vllm, lmcache)) if vllm and lmcache else {}
        row["env"] = ("; ".join(f"`{k}={v}`" for k, v in sorted(env.items())) + ": " +
                      "; ".join(images.CONNECTOR_ENV_WHY[k] for k in sorted(env))) if env else (
            "none known" if (vllm, lmcache, built) in GPU_RUNS else "none known (never ran on a GPU: unproven)")
        out.append(row)
    return out


HEADER = """# Compatibility: which vLLM and LMCache pairs work

<!-- Generated by tests/engine/compatibility.py from the checks it runs; `make test` fails when this file
     is not what they give. Do not edit by hand. -->

LMCache's CUDA extension is compiled against one torch, and every vLLM wheel pins one torch. A pair
works only when the extension loads against the torch that vLLM pins. LMCache's wheels do not say
which torch they were built against (their metadata asks for any `torch`), so the load itself is the
check: the shared object is loaded by file, since LMCache 0.5.3 answers `import lmcache.c_ops` with a
shim when the extension is missing. LMCache 0.5.x logs and falls back when its extension fails to load; vLLM does not.

**Default: the project's serving image `{default}`** (images/serving/Dockerfile: FROM
`vllm/vllm-openai:v{vllm}`, LMCache {lmcache}, the newest, compiled from its sdist against the base image's own
torch, and a build step that loads the extension's shared object). vLLM {vllm} pins torch 2.14.0 and no LMCache
wheel is built against it (0.5.6's extension lacks `c10_cuda_check_implementation` there: the row with LMCache's
PyPI wheel below), so the build compiles it (images/serving/build-lmcache.sh: nvcc from PyPI's cuda-toolkit of
torch's CUDA; no GPU needed; about an hour of CPU on 2 cores for the Dockerfile's seven GPU architectures). Its
pins are known by construction, its torch pins agree, vLLM's own parser accepts everything the operator renders
for it, and LMCache's own loader reads every rendered config without a warning. `make test` compiles LMCache once,
for sm_90 only, in that pair's engine venv, checks its row in full, and builds the image offline from that wheel
(kvtest.images: FROM a local stand-in for `vllm/vllm-openai:v{vllm}` made of that engine venv; the image's
`io.kvoffload.lmcache-build` label says so) and runs it as the rendered pod runs it. On an H200 the in-process
CPU and disk tiers, vllm-native and lmcache-server ran as rendered (the row's "Ran on a GPU" says what ran).
`lmcache/vllm-openai:v0.5.4` installs an unpinned vLLM, so the operator knows only its LMCache: a KVOffloadServe
using it must set `spec.engine.vllmVersion`, and extra vLLM arguments are checked only for a vLLM whose flag table
the operator carries ({tables}).

**Also offered: `{second}`** (the same Dockerfile with `--build-arg`s for LMCache's PyPI wheel, `LMCACHE_FROM=wheel`):
vLLM 0.26.0 is the newest vLLM pinned to torch 2.11.0, and LMCache 0.5.3 the newest LMCache whose wheel is built
against it. Every backend and tier ran on it on an H200 (the row below), and `make test` checks it in full and builds
its image (the full stand-in engine is that image).

**vLLM's V2 model runner.** vLLM 0.26.0's default V2 model runner calls LMCacheConnectorV1's
`start_load_kv` without attention metadata when one token is left to compute; LMCache 0.5.3 then
returns without loading, while vLLM counts the tokens as external hits and skips their prefill
(wrong answers, silently; LMCache's retrieve counters stay 0). With `VLLM_USE_V2_MODEL_RUNNER=0`
(the V1 runner) the loads happen (H200 run). vLLM 0.33.0 + LMCache 0.5.6 read from their source
(on a GPU they ran with the V1 runner only): V2 is the default runner for every model
(vllm/config/vllm.py:748-767), a full CUDA graph step calls the connector's pre_forward outside the forward context
(vllm/v1/worker/gpu/model_runner.py:2056) and the load then runs under
`set_forward_context(None)` (vllm/v1/worker/gpu/kv_connector.py:123-127), and LMCache 0.5.6 still
returns when `forward_context.attn_metadata` is None (lmcache/integration/vllm/vllm_v1_adapter.py:782-785):
the same skip. The operator renders the variable for both pairs and refuses it in `spec.engine.env`
(column "Connector environment"); the exporter's `kvoffload_external_hits_unloaded_tokens` and
`OffloadActive=False/ExternalHitsNotLoaded` catch the same failure on any pair at run time
(docs/metrics.md).

{columns}
|---|---|---|---|---|---|---|---|---|
"""
COLUMNS = ("Image", "vLLM", "LMCache", "torch pins (wheel metadata)", "LMCache extension loads on vLLM's torch (CPU)",
           "vLLM parser + create_engine_config() accept the rendered flags", "LMCache loader reads the rendered config",
           "Ran on a GPU", "Connector environment the operator renders")


def render() -> str:
    from kvoffload.engine import flags

    pair = images.KNOWN_IMAGES[images.DEFAULT_IMAGE]
    (second,) = [i for i in images.serving_images() if i != images.DEFAULT_IMAGE]
    text = HEADER.format(default=images.DEFAULT_IMAGE, second=second, vllm=pair.vllm, lmcache=pair.lmcache,
                         tables=", ".join(f"vLLM {v}" for v in flags.supported_versions()),
                         columns="| " + " | ".join(COLUMNS) + " |")
    table = rows()
    default = table[0]
    # The prose above claims these for the default pair: refuse to publish it when a check says otherwise.
    assert all(default[k].startswith("yes") for k in ("ext", "parser", "loader", "gpu")), default
    # Every pair the operator offers is checked in full (its venv is part of `make test`) and works on CPU.
    for r in table:
        if r["offered"]:
            assert all(r[k].startswith("yes") for k in ("ext", "parser", "loader")), r
    for r in table:
        text += "| " + " | ".join(r[k] for k in ("image", "vllm", "lmcache", "torch", "ext", "parser", "loader", "gpu",
                                                   "env")) + " |\n"
    text += ('\n"not checked": `make test` builds an engine venv for each pair the operator offers (its serving '
             'images;\n'
             "tests/engine/build-venv.sh, 8-10 GB each), and for no other pair, so checks that need another pair's\n"
             "venv are not run.\n")
    return text


def fetch() -> None:
    """Everything rows() reads from PyPI, into the cache."""
    venvs = engine_venvs()
    pairs = [(k.vllm, k.lmcache, k.lmcache_from) for k in images.KNOWN_IMAGES.values()] + CANDIDATES
    for vllm, lmcache, built in pairs:
        if vllm and lmcache:
            metadata("vllm", vllm), metadata("lmcache", lmcache)
            if built == "wheel":
                lmcache_tree(lmcache, venvs)


def main() -> None:
    global FETCH
    FETCH = sys.argv[1:] != ["--check"]
    if sys.argv[1:] == ["--fetch"]:
        return fetch()
    text = render()
    if sys.argv[1:] == ["--check"]:
        if DOC.read_text() != text:
            sys.exit(f"{DOC} is stale: run .venv/bin/python tests/engine/compatibility.py")
        return
    DOC.write_text(text)


if __name__ == "__main__":
    main()
