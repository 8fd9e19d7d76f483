"""How long the test suite takes on this machine, kept as JSON: the CPU (as scripts/time_recipe.py records it), the
two commands CI runs (the suite without the `slow` end-to-end tests, then those alone), each one's wall-clock,
outcome counts and slowest tests (pytest's JUnit XML).

    python scripts/time_tests.py --out docs/results/testing/suite.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from time_recipe import cpu, packages  # noqa: E402 - a sibling script, not a package

BASE = ["-m", "pytest", "-q", "-n", "auto", "--dist", "loadfile", "--durations=25"]
PHASES = {"suite": ["-m", "not slow"], "slow": ["-m", "slow"]}


def run_phase(marker: list[str], slowest: int, paths: list[str] = ()) -> dict:
    """One pytest command (over `paths`, else the configured test paths): its wall-clock, counts and slowest
    tests, read from the JUnit XML it writes."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, *BASE, *marker, f"--junitxml={xml}", *paths], check=False)
        seconds = time.perf_counter() - start
        root = ET.parse(xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    cases = [(float(c.get("time", 0)), f"{c.get('classname')}::{c.get('name')}") for c in root.iter("testcase")]
    return {"command": " ".join(["python", *BASE, *marker, *paths]), "exit_code": proc.returncode,
            "seconds": round(seconds, 1), **counts, "test_seconds": round(sum(t for t, _ in cases), 1),
            "slowest": [{"test": n, "s": round(t, 1)} for t, n in sorted(cases, reverse=True)[:slowest]]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--slowest", type=int, default=25, help="how many of the slowest tests to keep")
    parser.add_argument("--phases", nargs="+", default=list(PHASES), choices=list(PHASES))
    args = parser.parse_args()
    import torch

    record = {"cpu": cpu(), "torch": torch.__version__, "packages": packages(), "date": time.strftime("%Y-%m-%d")}
    record.update({name: run_phase(PHASES[name], args.slowest) for name in args.phases})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: {"seconds": v["seconds"], "tests": v["tests"]} for k, v in record.items() if k in PHASES}))
    sys.exit(max(record[name]["exit_code"] for name in args.phases))


if __name__ == "__main__":
    main()
