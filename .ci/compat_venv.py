"""Create a compatibility venv for ``make compat`` / ``make compat-smoke`` (docs/compat.md).

    python .ci/compat_venv.py DIR --base VENV REQUIREMENT...
    python .ci/compat_venv.py DIR --newest PACKAGE...

With ``--base``, the new venv reuses VENV's installed packages (its torch wheel
above all) behind its own: a ``.pth`` line runs ``site.addsitedir(VENV's
site-packages)``, so only REQUIREMENTs that differ (an older transformers and
what it pins) are installed, into DIR. pip never removes a package that lives
outside DIR.

With ``--newest``, the versions are not written anywhere: pip resolves the newest
release of every PACKAGE installable here *now* (``pip install --dry-run
--report``), and DIR becomes a standalone venv with exactly those
(``name==version``) and ``-e .[hf,test,peft,lightning]``. DIR is kept when it
already holds the same versions (``DIR/resolved.txt``), so a new release is
picked up by the next run and nothing is reinstalled otherwise.

Afterwards each ``name==version`` is checked to be the version that imports.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = f"{ROOT}[hf,test,peft,lightning]"
CHECK = ("import importlib.metadata as m, sys; "
         "bad = [(n, v, m.version(n)) for n, v in (a.split('==') for a in sys.argv[1:]) "
         "if m.version(n).split('+')[0] != v]; "
         "sys.exit(f'compat venv: wrong versions {bad}' if bad else 0)")
PIP = ("-m", "pip", "install", "-q", "--disable-pip-version-check")


def site_packages(python: Path) -> str:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return subprocess.run([str(python), "-c", code], check=True, capture_output=True,
                          text=True).stdout.strip()


def newest(packages: list[str]) -> list[str]:
    """``name==version`` of the newest release of each package pip would install here now."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp, "report.json")
        subprocess.run([sys.executable, *PIP, "--dry-run", "--ignore-installed",
                        "--report", str(report), *packages], check=True)
        chosen = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                  for item in json.loads(report.read_text())["install"]}
    return [f"{name}=={chosen[name.lower()]}" for name in packages]


def create(directory: Path, base: Path | None, requirements: list[str]) -> Path:
    shutil.rmtree(directory, ignore_errors=True)
    venv.EnvBuilder(with_pip=True).create(directory)
    python = directory / "bin" / "python"
    if base is not None:
        base_site = site_packages(base.resolve() / "bin" / "python")
        Path(site_packages(python), "_torchtp_compat_base.pth").write_text(
            f"import site; site.addsitedir({base_site!r})\n")
        subprocess.run([str(python), *PIP, *requirements], check=True)
    else:
        subprocess.run([str(python), *PIP, *requirements, "-e", EXTRAS], check=True)
    return python


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--base", type=Path, help="venv whose packages are reused behind the new ones")
    source.add_argument("--newest", action="store_true", help="resolve the newest releases now")
    parser.add_argument("requirements", nargs="+")
    args = parser.parse_args(argv)
    pins = newest(args.requirements) if args.newest else args.requirements
    stamp = args.dir / "resolved.txt"
    wanted = "\n".join(pins) + "\n"
    if args.newest and stamp.exists() and stamp.read_text() == wanted:
        print(f"compat venv {args.dir}: already the newest: {', '.join(pins)}")
        return 0
    python = create(args.dir, args.base, pins)
    checked = [r for r in pins if "==" in r]
    subprocess.run([str(python), "-c", CHECK, *checked], check=True)
    stamp.write_text(wanted)
    print(f"compat venv {args.dir}: {', '.join(checked)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
