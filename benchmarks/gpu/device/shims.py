"""Console scripts of the installed distributions, as pip would write them, for the host's Python.
  shims.py IMG PYTHON [ROOT...]   each ROOT (default: serving operator) is IMG/ROOT/{site,bin}"""
import configparser
import pathlib
import sys

img, python = pathlib.Path(sys.argv[1]), sys.argv[2]
for which in sys.argv[3:] or ("serving", "operator"):
    site, bin_ = img / which / "site", img / which / "bin"
    found = {}
    for ep in site.glob("*.dist-info/entry_points.txt"):
        cp = configparser.ConfigParser(interpolation=None)
        cp.read(ep)
        if cp.has_section("console_scripts"):
            found.update(dict(cp.items("console_scripts")))
    if which == "operator":
        found = {"kvoffload": "kvoffload.cli.main:main"}
    for name, target in found.items():
        mod, _, func = target.partition(":")
        p = bin_ / name
        p.write_text(f"#!{python}\nimport sys\nfrom {mod} import {func.split('.')[0]}\n"
                     f"if __name__ == '__main__':\n    sys.exit({func}())\n")
        p.chmod(0o755)
    print(which, sorted(found))
