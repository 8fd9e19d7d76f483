"""scripts/time_tests.py keeps what a pytest command did: the counts and slowest tests from its JUnit XML."""

import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_a_phase_counts_what_its_marker_selects_and_lists_the_slowest(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from time_tests import PHASES, run_phase

    (tmp_path / "test_a.py").write_text(
        "import time, pytest\n"
        "def test_fast(): pass\n"
        "def test_fails(): assert False\n"
        "@pytest.mark.skip(reason='never')\ndef test_skipped(): pass\n"
        "@pytest.mark.slow\ndef test_slow(): time.sleep(0.3)\n"
    )
    suite = run_phase(PHASES["suite"], 2, [str(tmp_path)])
    assert (suite["tests"], suite["failures"], suite["skipped"], suite["exit_code"]) == (3, 1, 1, 1)
    assert len(suite["slowest"]) == 2 and not any("test_slow" in s["test"] for s in suite["slowest"])
    slow = run_phase(PHASES["slow"], 5, [str(tmp_path)])
    assert (slow["tests"], slow["failures"], slow["exit_code"]) == (1, 0, 0)
    assert [s["test"].rsplit("::", 1)[1] for s in slow["slowest"]] == ["test_slow"] and slow["slowest"][0]["s"] >= 0.3
    assert slow["command"].endswith(f"-m slow {tmp_path}") and sys.executable not in slow["command"]
