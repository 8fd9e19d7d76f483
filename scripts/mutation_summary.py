"""Writes docs/results/mutation/<module>.json, the kept summary of a module's mutmut 2.5.1 run (from .mutmut-cache),
and the results page docs/results/mutation.md from all of them.

A summary records the tool, the command, the counts, the tests added for the module (by hand) and each survivor's
diff with its verdict. Verdicts are written
by hand in the JSON: "equivalent: why" (the program behaves the same) or "killed by tests/...::test_name" (a test
added since). Rewriting keeps them, matched by diff; a mutant that survived an earlier run and is killed now moves
to `killed_after_survival`. The score is detected / (total - equivalent), where detected counts timeouts and
suspiciously slow runs, which both failed the tests.

    python scripts/mutation_summary.py mae/train/optim.py --tests "tests/train/test_optim.py"   # after a run
    python scripts/mutation_summary.py                                                           # the page only
"""

from __future__ import annotations

import argparse
import json
import sqlite3
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "results" / "mutation"
PAGE = ROOT / "docs" / "results" / "mutation.md"
STATUS = {"ok_killed": "killed", "bad_survived": "survived", "bad_timeout": "timeout", "ok_suspicious": "suspicious"}


def mutants(module: str) -> list[tuple[int, int, str]]:
    """(id, 1-based line, status) of every mutant of `module` in .mutmut-cache."""
    db = sqlite3.connect(ROOT / ".mutmut-cache")
    rows = db.execute(
        "SELECT m.id, l.line_number, m.status FROM Mutant m JOIN Line l ON m.line = l.id"
        " JOIN SourceFile s ON l.sourcefile = s.id WHERE s.filename = ? ORDER BY m.id",
        (module,),
    ).fetchall()
    db.close()
    return [(pk, line + 1, status) for pk, line, status in rows]


def summary(module: str, tests: str, old: dict) -> dict:
    """The module's summary; `old` is the JSON written before (its verdicts and first run's counts)."""
    from mutmut.cache import get_unified_diff

    rows = mutants(module)
    if not rows:
        raise SystemExit(f"{module}: no mutants in .mutmut-cache; run scripts/mutation_test.sh {module} first")
    counts = {name: 0 for name in [*STATUS.values(), "untested", "skipped"]}
    for _, _, status in rows:
        counts[STATUS.get(status, status)] += 1
    earlier = old.get("survivors", []) + old.get("killed_after_survival", [])
    verdicts = {s["diff"]: s["verdict"] for s in earlier}
    survivors = []
    for pk, line, status in rows:
        if status == "bad_survived":
            diff = "\n".join(get_unified_diff(pk, [], update_cache=False).splitlines()[3:])
            survivors.append({"id": pk, "line": line, "diff": diff, "verdict": verdicts.get(diff, "")})
    now = {s["diff"] for s in survivors}
    equivalent = sum(s["verdict"].startswith("equivalent") for s in survivors)
    detected = counts["killed"] + counts["timeout"] + counts["suspicious"]
    return {
        "module": module,
        "tool": "mutmut 2.5.1",
        "command": f"scripts/mutation_test.sh {module} '{tests}'",
        "first_run": old.get("first_run", counts),
        "tests_added": old.get("tests_added", []),  # written by hand: the tests added for this module's mutants
        "counts": {"total": len(rows), **counts},
        "equivalent": equivalent,
        "score_percent": round(100 * detected / (len(rows) - equivalent), 1),
        "survivors": survivors,
        "killed_after_survival": [s for s in earlier if s["diff"] not in now],
    }


def page() -> str:
    """docs/results/mutation.md: one row a kept summary."""
    lines = [
        "# Mutation testing",
        "",
        "Each module's mutants, made and run by [mutmut](https://pypi.org/project/mutmut/) 2.5.1 (pinned in the",
        "`mutation` extra): it writes each mutant into the source file and runs the tests named in the JSON, so",
        "decorated functions and the `python -m mae` processes that tests start run the mutant too. A mutant is",
        "detected when a test fails on it; a survivor is either equivalent (the program behaves the same: each one",
        "argued in the module's JSON) or a missing test. Score = detected / (mutants - equivalent). The tests of",
        "each mutant run in a process forked from one that imported torch and the other dependencies once",
        "(`scripts/mutation_server.py`; `MUTATION_SERVER=0` starts pytest afresh instead). Each run:",
        "",
        "```bash",
        "pip install -e '.[mutation]'",
        "scripts/mutation_test.sh MODULE 'PYTEST SELECTION'     # the JSON's `command`",
        "python scripts/mutation_summary.py MODULE --tests 'PYTEST SELECTION'",
        "```",
        "",
        "| module | mutants | detected | survived | equivalent | score | summary |",
        "|---|---|---|---|---|---|---|",
    ]
    for path in sorted(OUT.glob("*.json")):
        s = json.loads(path.read_text())
        c = s["counts"]
        detected = c["killed"] + c["timeout"] + c["suspicious"]
        score = f"{s['score_percent']}%" + (f" ({c['untested']} not run yet)" if c["untested"] else "")
        lines.append(
            f"| `{s['module']}` | {c['total']} | {detected} | {c['survived']} | {s['equivalent']} | {score} | "
            f"[JSON](mutation/{path.name}) |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module", nargs="?", help="the mutated file, as given to scripts/mutation_test.sh")
    parser.add_argument("--tests", help="the pytest selection the mutants ran against")
    args = parser.parse_args()
    if args.module:
        if not args.tests:
            parser.error("--tests: give the pytest selection the mutants ran against")
        path = OUT / (args.module.removesuffix(".py").replace("/", ".") + ".json")
        old = json.loads(path.read_text()) if path.exists() else {}
        result = summary(args.module, args.tests, old)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        c = result["counts"]
        print(
            f"{path.relative_to(ROOT)}: {c['killed']} killed, {c['survived']} survived ({result['equivalent']}"
            f" argued equivalent), {c['timeout']} timeout, {c['suspicious']} suspicious, {c['untested']} untested;"
            f" score {result['score_percent']}%"
        )
    PAGE.write_text(page())


if __name__ == "__main__":
    main()
