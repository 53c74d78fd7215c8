"""Create a compatibility venv for ``make compat`` / ``make compat-smoke`` (docs/compat.md).

    python .ci/compat_venv.py DIR [--base VENV] REQUIREMENT...

With ``--base``, the new venv reuses VENV's installed packages (its torch wheel
above all) behind its own: a ``.pth`` line runs ``site.addsitedir(VENV's
site-packages)``, so only REQUIREMENTs that differ (an older transformers and
what it pins) are installed, into DIR. pip never removes a package that lives
outside DIR. Without ``--base`` the venv is standalone and also gets
``-e .[hf,test,peft,lightning]``. Afterwards each ``name==version`` REQUIREMENT is checked to
be the version that imports.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECK = ("import importlib.metadata as m, sys; "
         "bad = [(n, v, m.version(n)) for n, v in (a.split('==') for a in sys.argv[1:]) "
         "if m.version(n).split('+')[0] != v]; "
         "sys.exit(f'compat venv: wrong versions {bad}' if bad else 0)")


def site_packages(python: Path) -> str:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return subprocess.run([str(python), "-c", code], check=True, capture_output=True,
                          text=True).stdout.strip()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--base", type=Path, help="venv whose packages are reused behind the new ones")
    parser.add_argument("requirements", nargs="+")
    args = parser.parse_args(argv)
    shutil.rmtree(args.dir, ignore_errors=True)
    venv.EnvBuilder(with_pip=True).create(args.dir)
    python = args.dir / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if args.base is not None:
        base = site_packages(args.base.resolve() / "bin" / "python")
        Path(site_packages(python), "_torchtp_compat_base.pth").write_text(
            f"import site; site.addsitedir({base!r})\n")
        subprocess.run([*pip, *args.requirements], check=True)
    else:
        subprocess.run([*pip, *args.requirements, "-e", f"{ROOT}[hf,test,peft,lightning]"], check=True)
    pins = [r for r in args.requirements if "==" in r]
    subprocess.run([str(python), "-c", CHECK, *pins], check=True)
    print(f"compat venv {args.dir}: {', '.join(pins)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
