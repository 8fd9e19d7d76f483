"""A stage registered from outside the package is a command (`mae <name>`, listed by `mae --help`) and a function
(`mae.<name>`, `mae.api.run`), validated the same way; a plugin module named in MAE_PLUGINS registers it for the
command line and the Python API."""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import mae
from mae.cli import main
from mae.config import RunConfig, ranged
from mae.stages import StageResult, get_stage, register_stage, unregister_stage


@dataclass(frozen=True)
class CountConfig(RunConfig):
    """mae count."""

    upto: int = ranged(3, ge=1)
    """Count from 1 to this number."""


def run_count(cfg: CountConfig) -> StageResult:
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    numbers = list(range(1, cfg.upto + 1))
    (out / "numbers.json").write_text(json.dumps(numbers))
    print(f"counted to {cfg.upto}")
    return StageResult(out, {"total": sum(numbers)}, out / "numbers.json")


@pytest.fixture
def count_stage():
    register_stage("count", CountConfig, "Count to a number (a toy stage).")(run_count)
    yield
    unregister_stage("count")


def test_a_stage_registered_outside_the_package_is_listed_helped_and_run(count_stage, tmp_path, capsys):
    assert main(["--help"]) == 0
    assert "count      Count to a number (a toy stage)." in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["count", "--help"])
    helped = capsys.readouterr().out
    assert "--upto UPTO" in helped and "Count from 1 to this number." in helped and "--output_dir" in helped

    assert main(["count", "--upto", "4", "--output_dir", str(tmp_path / "cli")]) == 0
    assert json.loads((tmp_path / "cli" / "numbers.json").read_text()) == [1, 2, 3, 4]
    assert main(["count", "--upto", "0"]) == 2
    assert capsys.readouterr().err.strip() == "mae count: error: --upto 0: must be >= 1"

    result = mae.api.run("count", upto=5, output_dir=tmp_path / "api")
    assert result.metrics == {"total": 15} and result.export == tmp_path / "api" / "numbers.json"
    with pytest.raises(mae.ConfigError, match=r"^--upto 0: must be >= 1$"):
        mae.api.run("count", upto=0)


def test_a_stage_registered_outside_the_package_is_a_function_of_the_package(count_stage, tmp_path):
    from mae import count

    result = count(upto=4, output_dir=tmp_path / "api")
    assert result.metrics == {"total": 10} and mae.count is count and "count" in dir(mae)
    assert "Count to a number (a toy stage)." in count.__doc__
    with pytest.raises(mae.ConfigError, match=r"^--upto 0: must be >= 1$"):
        mae.count(upto=0)


def test_the_default_output_folder_is_named_after_the_stage(count_stage, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert mae.api.run("count").output_dir == Path("outputs/count")
    assert get_stage("count").finalize(CountConfig()).output_dir == "outputs/count"


def test_a_plugin_module_named_in_mae_plugins_adds_its_stage_to_the_command_line_and_the_package(tmp_path):
    (tmp_path / "toy_plugin.py").write_text(
        "from tests.stages.test_registry import CountConfig, run_count\n"
        "from mae.stages import register_stage\n"
        "register_stage('count', CountConfig, 'Count to a number (a toy stage).')(run_count)\n"
    )
    env = {**os.environ, "MAE_PLUGINS": "toy_plugin", "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()])}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "mae", "count", "--upto", "2", "--output_dir", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "counted to 2" in proc.stdout and json.loads((out / "numbers.json").read_text()) == [1, 2]
    code = f"import mae; print(mae.count(upto=3, output_dir={str(tmp_path / 'api')!r}).metrics)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "{'total': 6}" in proc.stdout, proc.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-m", "mae", "--help"], env={**env, "MAE_PLUGINS": "no_such_plugin"},
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "mae: error: MAE_PLUGINS: cannot import plugin module 'no_such_plugin' "
        "(ModuleNotFoundError: No module named 'no_such_plugin')"
    ]
