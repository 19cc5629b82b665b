"""deploy/kvoffload.service passes ``systemd-analyze verify`` without a warning (skipped, saying
why, where systemd is absent); a misspelled key does not."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.testing.helpers import REPO_ROOT

UNIT = REPO_ROOT / "deploy" / "kvoffload.service"
INSTALLED = "/opt/kvoffload/venv/bin/kvoffload"


def verify(text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``systemd-analyze verify`` of the unit ``text``, its ExecStart pointed at this
    virtualenv's kvoffload (verify checks that the program exists)."""
    here = Path(sys.executable).parent / "kvoffload"
    unit = tmp_path / "kvoffload.service"
    unit.write_text(text.replace(INSTALLED, str(here)))
    return subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def systemd() -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here: the unit cannot be verified")


@pytest.mark.usefixtures("systemd")
def test_the_systemd_unit_verifies(tmp_path: Path) -> None:
    text = UNIT.read_text()
    assert f"ExecStart={INSTALLED} serve --config /etc/kvoffload/kvoffload.toml" in text
    assert "RuntimeDirectory=kvoffload" in text
    assert "Environment=KVOFFLOAD_SERVICE__RUNTIME_DIR=/run/kvoffload" in text
    assert "LimitMEMLOCK=infinity" in text and "Restart=on-failure" in text
    checked = verify(text, tmp_path)
    assert checked.returncode == 0 and checked.stderr == "", checked.stderr


@pytest.mark.usefixtures("systemd")
def test_the_verification_sees_a_misspelled_key(tmp_path: Path) -> None:
    planted = UNIT.read_text().replace("LimitMEMLOCK=", "LimitMEMLOK=")
    assert "LimitMEMLOK" in verify(planted, tmp_path).stderr
