"""Features behind an extra and their tests: without the extra's modules, the tests that need
them are skipped, each with a reason that names the extra to install."""

from __future__ import annotations

import subprocess
import sys

from kvoffload.extras import EXTRAS, install_line
from kvoffload.testing.helpers import REPO_ROOT

NEEDING = {
    "bench": "tests/bench/test_cli.py::test_quick_tiering_and_cpu_write_json_with_ratios_and_a_chart",
    "engine": "tests/engine/test_model.py",
    "object": "tests/workers/object/test_s3store.py",
}


def test_tests_needing_an_extra_skip_naming_it_when_it_is_absent() -> None:
    blocked = sorted({name for extra in NEEDING for name in EXTRAS[extra]})
    code = (
        "import sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None\n"
        "import pytest\n"
        f"sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', *{list(NEEDING.values())!r}]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    skipped = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    for extra, target in NEEDING.items():
        path = target.split("::")[0]
        assert any(
            path in line and f"install the {extra} extra: {install_line(extra)}" in line
            for line in skipped
        ), (extra, skipped)
    assert " passed" not in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]
