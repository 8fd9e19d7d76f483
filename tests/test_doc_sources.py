"""The documentation's facts have sources: every relative link and repository path in the README and docs/ leads to
a file; every measured number in the README and the guides is in a kept JSON or a recipe's header (or is named
below as not a measurement); step counts are the training loader's; the API reference and the migration and
recipe tables are current."""

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

import mae
from mae.cli import build_parser
from mae.data.samplers import EpochSampler
from mae.train.loaders import make_loader

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
# Guides: the README and the pages directly under docs/ (results/ holds the studies, reference/ is generated).
GUIDES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A path inside the repository written in backticks: `recipes/...`, `scripts/x.py`, `docs/results/...`.
REPO_PATH = re.compile(r"`((?:docs|recipes|scripts|studies|tests|mae)/[\w*./-]+)`")
# A number with a unit that makes it a measurement: a percentage, a duration, a rate, a speed ratio.
MEASURED = re.compile(
    r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)\s?(?:%|x(?![\w])| ?(?:min|minutes|hours?|h|s|seconds|ms|images/s|img/s)\b)"
)
# Numbers in the README and guides that carry a measurement's unit but are not measurements, each with why.
NOT_MEASURED = {
    "README.md": set(),
    "docs/data.md": {"20", "5"},  # the data-wait warning's threshold and when it is judged
    "docs/distributed.md": {"110", "30", "90"},  # the launcher's shutdown timeouts; FSDP's share of the weights
    "docs/faq.md": {"3600"},  # seconds in an hour
    "docs/pretraining.md": {"0.2", "1.25"},  # the bf16 timing's length and threshold (mae/train/accelerator.py)
    "docs/speed.md": {"10", "1.25"},  # a data-wait share to act on; the bf16 threshold
}


def kept_numbers() -> set[str]:
    """Every number of every kept JSON under docs/, as written and rounded (seconds also as minutes)."""
    found: set[str] = set()

    def walk(value, key=""):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, k if key != "seconds" else "seconds")
        elif isinstance(value, list):
            for v in value:
                walk(v, key)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            found.update({str(value), f"{value:.1f}", f"{value:.2f}", f"{round(value)}"})
            if key == "seconds":
                found.add(f"{value / 60:.1f}")

    for path in DOCS.rglob("*.json"):
        walk(json.loads(path.read_text()))
    return found


def header_numbers() -> set[str]:
    """Every number in a recipe's header (its leading comment lines)."""
    found: set[str] = set()
    for recipe in (ROOT / "recipes").rglob("*.yaml"):
        head = "\n".join(line for line in recipe.read_text().splitlines() if line.startswith("#"))
        found.update(n.replace(",", "") for n in re.findall(r"\d[\d,]*(?:\.\d+)?", head))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_repository_path_resolves(page):
    missing = []
    text = page.read_text()
    for link in LINK.findall(text):
        target = link.split("#")[0]
        if target and not re.match(r"[a-z]+:", target) and not (page.parent / target).exists():
            missing.append(f"({link})")
    for path in REPO_PATH.findall(text):
        path = path.rstrip(".")
        if not any(ROOT.glob(path)) and not (ROOT / path).exists():
            missing.append(f"`{path}`")
    assert not missing, f"{page.relative_to(ROOT)}: links or paths to missing files: {missing}"


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_measured_number_in_the_readme_and_guides_has_a_kept_source(page):
    sources = kept_numbers() | header_numbers()
    name = str(page.relative_to(ROOT))
    allowed = NOT_MEASURED.get(name, set())
    unsourced = [n for n in (m.replace(",", "") for m in MEASURED.findall(page.read_text()))
                 if n not in sources and n not in allowed]  # fmt: skip
    assert not unsourced, f"{name}: measured numbers with no kept JSON or recipe header behind them: {unsourced}"


def test_the_allow_list_names_only_numbers_the_pages_still_hold():
    for name, numbers in NOT_MEASURED.items():
        held = {n.replace(",", "") for n in MEASURED.findall((ROOT / name).read_text())}
        assert numbers <= held, f"{name}: no longer holds {sorted(numbers - held)}; drop them from NOT_MEASURED"


def steps_per_epoch(images: int, batch: int, processes: int = 1, accum: int = 1) -> int:
    """The docs' rule: the last partial batch is dropped, then micro-batches are grouped by accumulation."""
    return math.ceil(images // (batch * processes) / accum)


@pytest.mark.parametrize("images,batch", [(54_000, 128), (60_000, 128), (6_000, 128), (54_000, 256), (100, 64)])
def test_the_step_rule_is_the_training_loaders(images, batch):
    loader = make_loader(range(images), batch_size=batch, collate_fn=torch.tensor, num_workers=0,
                         sampler=EpochSampler(images, seed=0))  # fmt: skip
    assert len(loader) == steps_per_epoch(images, batch)


# Step counts the recipes and pages write, with what they count: (file, written, images, batch, epochs).
STEP_CLAIMS = [
    ("recipes/pretrain/continue.yaml", "421", 54_000, 128, 1),
    ("docs/results/continued_pretraining.md", "421 steps", 54_000, 128, 1),
    ("recipes/fashion_mnist/finetune.yaml", "1,684", 54_000, 128, 4),
    ("recipes/fashion_mnist/finetune.yaml", "1,872", 60_000, 128, 4),
    ("docs/results/finetune_budgets.md", "1,684", 54_000, 128, 4),
    ("docs/results/finetune_budgets.md", "1,872", 60_000, 128, 4),
    ("recipes/fashion_mnist/linprobe.yaml", "12,600", 54_000, 256, 60),
    ("recipes/fashion_mnist/linprobe.yaml", "14,040", 60_000, 256, 60),
    ("docs/results/finetune_budgets.md", "12,600", 54_000, 256, 60),
    ("docs/speed.md", "6,552", 60_000, 128, 14),
    ("docs/speed.md", "468 steps", 60_000, 128, 1),
]


@pytest.mark.parametrize("file,written,images,batch,epochs", STEP_CLAIMS, ids=lambda x: str(x))
def test_written_step_counts_are_the_loaders(file, written, images, batch, epochs):
    assert written in (ROOT / file).read_text(), f"{file} no longer says {written}: update STEP_CLAIMS"
    assert int(written.split()[0].replace(",", "")) == epochs * steps_per_epoch(images, batch)


def test_a_step_budget_grows_the_epochs_as_the_trainer_does():
    """recipes/fashion_mnist/finetune.yaml on a 6,000-image set: min_steps 1600 at 46 steps an epoch."""
    per_epoch = steps_per_epoch(6_000, 128)
    epochs = max(4, math.ceil(1600 / per_epoch))
    assert (per_epoch, epochs, epochs * per_epoch) == (46, 35, 1610)
    assert "6,000 images: 35 epochs" in (ROOT / "recipes/fashion_mnist/finetune.yaml").read_text()


def test_the_api_reference_is_current_and_names_every_public_name():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import api_reference
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    written = (DOCS / "reference" / "api.md").read_text()
    assert written == api_reference.render(), "docs/reference/api.md is stale: run python scripts/api_reference.py"
    for name in mae.__all__:
        assert f"::: mae.{name}\n" in written or f"### mae.{name}\n" in written or f"`mae.{name}`" in written, name


def test_every_option_the_migration_page_names_exists():
    page = (DOCS / "migrating.md").read_text()
    ours = {a.option_strings[0] for a in build_parser("pretrain")._actions if a.option_strings}
    named = set()
    for row in page.splitlines():
        if row.startswith("| `--"):
            cell = row.split("|")[2]
            named |= {o for o in re.findall(r"`(--[\w.]+)", cell)}
    assert len(named) >= 25 and named <= ours | {"--push_to_hub"}, sorted(named - ours)
    assert "--push_to_hub" in {a.option_strings[0] for a in build_parser("export")._actions if a.option_strings}


def test_the_recipe_table_lists_every_recipe():
    table = (DOCS / "recipes.md").read_text()
    recipes = sorted(str(p.relative_to(ROOT / "recipes")) for p in (ROOT / "recipes").rglob("*.yaml"))
    assert recipes and all(f"| `{r}` |" in table for r in recipes), [r for r in recipes if f"| `{r}` |" not in table]
