"""``kvoffload soak --s3`` from a non-editable install: the package carries everything it runs
(its local S3 launcher included) and never reaches into the source tree."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

from kvoffload.testing.helpers import REPO_ROOT

SOURCES = ("kvoffload", "workers", "setup.cfg", "pyproject.toml", "README.md")


def installed_venv(tmp_path: Path) -> Path:
    """A fresh venv holding a wheel built from a copy of the sources (no ``tests/``); the
    dependencies come from this interpreter's site-packages, added after its own. Installed
    with ``--ignore-installed``: pip must not uninstall this interpreter's own kvoffload."""
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    env_python = env_dir / "bin" / "python"
    env_site = subprocess.run(
        [env_python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(env_site, "shared-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [
            env_python,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--ignore-installed",
            "--no-warn-script-location",
            str(src),
        ],
        cwd=tmp_path,
        check=True,
    )
    return env_dir


def test_soak_with_local_s3_runs_from_a_non_editable_install(tmp_path):
    env_dir = installed_venv(tmp_path)
    outer = subprocess.run(
        [sys.executable, "-c", "import kvoffload; print(kvoffload.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert outer.returncode == 0, "installing the wheel must leave this interpreter's kvoffload"
    path = os.pathsep.join(
        [str(env_dir / "bin"), str(Path(sys.executable).parent), os.environ["PATH"]]
    )
    env = {**os.environ, "PATH": path}
    env.pop("PYTHONPATH", None)
    where = subprocess.run(
        [
            env_dir / "bin" / "python",
            "-c",
            "import kvoffload.testing.s3server as m; print(m.__file__)",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(env_dir), where
    out = tmp_path / "summary.json"
    run = subprocess.run(
        [
            env_dir / "bin" / "kvoffload",
            "soak",
            "--s3",
            "--duration",
            "5",
            "--clients",
            "2",
            "--json-out",
            out,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    summary = json.loads(out.read_text())
    assert summary["ok"] and "object" in summary["tiers"], summary["tiers"]
