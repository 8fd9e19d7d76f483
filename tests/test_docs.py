"""The documentation is true: every `mae ...` command in the README and docs/ parses, every Python block runs (or
says why it cannot), the option reference is current, and the Python walk-through runs on tiny data."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mae
from mae.cli import build_parser, parse
from mae.errors import MaeError
from mae.stages import list_stages
from tests.conftest import held_out, last_eval, make_images, make_labeled

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# An HTML comment right before a fenced block: `<!-- not run: why -->`, or `<!-- run by tests/FILE.py -->`.
BLOCK = re.compile(r"(?:<!-- (?P<marker>[^>]*?) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)```", re.S)
# Where a documented command names a path the parser or the recipe loader reads.
RECIPE = re.compile(r"(?<![\w/])recipes/")


def blocks(page: Path, lang: str) -> list[tuple[str | None, str]]:
    return [(m["marker"], m["code"]) for m in BLOCK.finditer(page.read_text()) if m["lang"] == lang]


def commands(page: Path) -> list[list[str]]:
    """The words after `mae` of every `mae STAGE ...` line of the page's bash blocks (`accelerate launch ... -m mae`,
    `torchrun ... -m mae` and `VAR=value mae` included; `...` stands for options the line leaves out)."""
    found = []
    for marker, code in blocks(page, "bash"):
        if marker and marker.startswith("not run"):
            continue
        for line in code.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            starts = [i + 1 for i, w in enumerate(words) if w == "mae" and (i == 0 or words[i - 1] in ("-m",) or
                      re.fullmatch(r"\w+=\S*", words[i - 1]))]  # fmt: skip
            if starts and len(words) > starts[0] and words[starts[0]] not in ("--help", "-h"):
                found.append([w for w in words[starts[0] :] if w != "..."])
    return found


def documented_commands() -> list[tuple[str, list[str]]]:
    return [(f"{p.relative_to(ROOT)}: mae {' '.join(c)}", c) for p in PAGES for c in commands(p)]


def test_the_readmes_links_into_docs_are_relative_and_lead_to_files():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert len(local) >= 10 and all((ROOT / link).is_file() for link in local), [
        link for link in local if not (ROOT / link).is_file()
    ]
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 200 and any(line == "## Your images" for line in readme[:80])


def test_the_pages_hold_commands_for_every_stage_they_name():
    named = {c[0] for _, c in documented_commands()}
    assert {"pretrain", "linprobe", "finetune", "knn", "visualize", "stats", "shard", "export"} <= named
    assert named <= set(list_stages()), named - set(list_stages())


@pytest.mark.parametrize("where,words", documented_commands(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_documented_command_parses(where, words, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # recipes/... as the pages write them, from a clone's root
    stage, argv = words[0], words[1:]
    argv = [RECIPE.sub(str(ROOT / "recipes") + "/", w) for w in argv]
    if "--help" in argv or any(a.startswith("--print_config") for a in argv):
        with pytest.raises(SystemExit) as done:
            parse(stage, argv)
        assert done.value.code == 0, capsys.readouterr().err
        return
    try:
        cfg = parse(stage, argv)
    except MaeError as e:
        pytest.fail(f"{where}\n  {e}")
    assert type(cfg) is mae.stages.get_stage(stage).config
    if stage in ("linprobe", "finetune", "knn") or getattr(cfg, "attention", False):
        assert cfg.pretrained, f"{where}: the stage refuses to start without --pretrained"


def test_the_cli_reference_is_current_and_lists_every_option_of_every_stage(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # undone after the test, the module cache too
    import cli_reference

    written = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert written == cli_reference.render(), "docs/reference/cli.md is stale: run python scripts/cli_reference.py"
    for stage in list_stages():
        section = written.split(f"## mae {stage}\n")[1].split("\n## mae ")[0]
        for action in build_parser(stage)._actions:
            if action.option_strings and action.option_strings[0] not in ("-h", "--config", "--print_config"):
                if action.help != "Path to a configuration file.":  # a whole section as a YAML file
                    help_text = " ".join(action.help.split()).replace("|", "\\|")
                    assert f"| `{action.option_strings[0]}` |" in section and help_text in section, action.dest


def python_blocks() -> list[tuple[str, str | None, str]]:
    return [(f"{p.relative_to(ROOT)}#{i}", marker, code) for p in PAGES for i, (marker, code) in
            enumerate(blocks(p, "python"))]  # fmt: skip


def test_every_python_block_runs_here_or_says_why_not(tmp_path):
    """Blocks without a marker run, page by page, in a fresh interpreter (a block may register a mask or a
    stage: the test process's registries stay as they are); the others name their reason or their test."""
    pages: dict[str, list[str]] = {}
    for where, marker, code in python_blocks():
        page = where.split("#")[0]
        if marker is None:
            pages.setdefault(page, []).append(code)
        elif marker.startswith("run by "):
            test_file = ROOT / marker.removeprefix("run by ").strip()
            assert test_file.is_file() and Path(page).name in test_file.read_text(), (where, marker)
        else:
            assert re.fullmatch(r"not run: .{10,}", marker), (where, marker)
    pages.pop("docs/python.md", None)  # the walk-through has its own test, below, on tiny data
    assert pages, "no Python block runs as written"
    for page, codes in pages.items():
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-c", "\n".join(codes)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env=env)  # fmt: skip
        assert done.returncode == 0, f"{page}:\n{done.stderr[-2000:]}"


def _merged(base: dict, forced: dict) -> dict:
    out = dict(base)
    for key, value in forced.items():
        out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out


@pytest.mark.slow
def test_the_python_walk_through_runs_on_tiny_data(tmp_path, monkeypatch, evaluations):
    """docs/python.md top to bottom, as printed, with a tiny model and one or two epochs forced in."""
    make_images(tmp_path / "pictures", n=16)
    make_labeled(tmp_path / "labeled", per_class=8)
    monkeypatch.chdir(tmp_path)
    tiny = {
        "pretrain": {"model": {"name": "mae_vit_micro_patch8", "img_size": 32}, "optim": {"warmup_epochs": 0.5},
                     "loop": {"epochs": 1, "batch_size": 8}},
        "knn": {"loop": {"batch_size": 8}},
        "finetune": {"optim": {"warmup_epochs": 0.5}, "loop": {"epochs": 2, "batch_size": 8, "mixed_precision": "no"}},
    }  # fmt: skip
    quiet = {"loop": {"progress": False}, "data": {"num_workers": 0}}

    class Tiny:  # `mae` as the page uses it, every stage call made tiny
        def __getattr__(self, name):
            real = getattr(mae, name)
            if name not in tiny:
                return real

            def call(config=None, **overrides):
                if isinstance(config, str):
                    config = ROOT / config  # recipes/... from a clone's root
                forced = _merged(tiny[name], quiet if name != "knn" else {"data": {"num_workers": 0}})
                return real(config, **_merged(overrides, forced))

            return call

    page = (ROOT / "docs" / "python.md").read_text()
    code = "\n".join(c for marker, c in blocks(ROOT / "docs" / "python.md", "python") if marker is None)
    assert "mae.pretrain(" in code and "mae.load_classifier(" in code and code.count("```") == 0, page[:80]
    files, labels = held_out(tmp_path / "labeled")  # what the fine-tune evaluates, in its order
    first_image = files[0]
    code = re.sub(r'"labeled/[^"]+\.jpg"', repr(first_image), code)
    code = code.replace("import mae\n", "")
    namespace = {"mae": Tiny()}
    exec(code, namespace)  # noqa: S102 - the page's own code
    assert namespace["pre"].export == Path("runs/small/encoder.safetensors") and namespace["pre"].export.is_file()
    assert namespace["knn"].metrics["top1"] == last_eval(tmp_path / "runs" / "knn")["top1"]
    assert namespace["ft"].export == Path("runs/ft/classifier.safetensors")
    assert namespace["clf"].classes == ["blue", "green", "red"]
    logits, logged_labels = evaluations[-1]  # the page's image scored as the fine-tune's last evaluation did
    assert logged_labels.tolist() == labels
    torch.testing.assert_close(namespace["probs"], logits[0].softmax(-1), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kept", sorted((ROOT / "docs" / "results").glob("anomaly_study*/results.json")),
                         ids=lambda p: p.parent.name)  # fmt: skip
def test_the_anomaly_tables_are_the_kept_studies(kept):
    """docs/results/anomaly.md's table of a kept study (`python -m studies.anomaly --table`) shows its numbers: the
    MAE's score (its bold row) is there, and every row of the table holding it is a row of the study's table (a table
    may leave rows out or reorder them, never change one)."""
    from studies import anomaly_scores

    head, _, *rows = anomaly_scores.table(json.loads(kept.read_text())).splitlines()
    ours = next(r for r in rows if r.startswith("| **"))
    page = (ROOT / "docs" / "results" / "anomaly.md").read_text().split("\n\n")  # a table is one paragraph
    shown = [[r for r in p.splitlines() if r.startswith("| ") and r != head] for p in page if ours in p.splitlines()]
    assert shown, f"{kept.parent.name}: the MAE's score, {ours[:60]}..., is in no table of docs/results/anomaly.md"
    for table in shown:
        assert set(table) <= set(rows), f"{kept.parent.name}: rows not its study's: {sorted(set(table) - set(rows))}"
