"""Every stage through the command line at its defaults: only paths, size, epochs and batch size given.

Recipes set many options; users often set none. This is what a new user's first commands run.
"""

import json
import os
import subprocess
import sys

import pytest
from accelerate.state import AcceleratorState

from mae.cli import main
from tests.conftest import held_out, make_images, make_labeled


def cli(*args) -> int:
    AcceleratorState._reset_state(True)
    return main([str(a) for a in args])


def evals(out) -> list[dict]:
    return [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval" in m]


def logged_top1(out, evaluation, labels) -> None:
    """The run's last logged top-1 is the accuracy of its last evaluation, over the held-out `labels`."""
    logits, logged_labels = evaluation
    assert logged_labels.tolist() == labels, out
    correct = (logits.argmax(1) == logged_labels).float().mean().item()
    assert evals(out)[-1]["top1"] == pytest.approx(100 * correct) and evals(out)[-1]["samples"] == len(labels)


@pytest.mark.slow
def test_every_stage_runs_at_its_defaults(tmp_path, capsys, evaluations):
    make_images(tmp_path / "imgs", n=16)
    labeled = make_labeled(tmp_path / "labeled", per_class=12)
    size = ["--model.img_size", 32]
    pre = tmp_path / "pre"
    assert cli("pretrain", "--data.path", tmp_path / "imgs", "--output_dir", pre, *size,
               "--loop.epochs", 1, "--loop.batch_size", 8) == 0  # fmt: skip
    assert (pre / "encoder.safetensors").is_file() and (pre / "preview.png").is_file()

    common = ["--pretrained", pre, "--data.path", labeled, "--loop.epochs", 2, "--loop.batch_size", 8]
    for mode in ("cached", "augmented"):
        assert cli("linprobe", *common, "--mode", mode, "--output_dir", tmp_path / mode) == 0
        logged_top1(tmp_path / mode, evaluations[-1], held_out(labeled)[1])
    assert cli("finetune", *common, "--output_dir", tmp_path / "ft") == 0
    assert (tmp_path / "ft" / "classifier.safetensors").is_file()
    logged_top1(tmp_path / "ft", evaluations[-1], held_out(labeled)[1])
    assert cli("knn", "--pretrained", pre, "--data.path", labeled, "--loop.batch_size", 8,
               "--output_dir", tmp_path / "knn") == 0  # fmt: skip
    knn = evals(tmp_path / "knn")[-1]  # 4 queries (10% of 36): top-1 is a count of them
    assert knn["samples"] == len(held_out(labeled)[1]) == 4 and knn["top1"] in (0, 25, 50, 75, 100), knn
    assert cli("export", "--checkpoint", pre, "--output", tmp_path / "enc.safetensors") == 0
    image = next((labeled / "red").iterdir())
    assert cli("visualize", "--checkpoint", pre, "--images", image, "--output", tmp_path / "rec.png") == 0
    att = tmp_path / "att.png"
    assert cli("visualize", "--attention", "--pretrained", pre, "--images", image, "--output", att) == 0
    assert (tmp_path / "rec.png").is_file() and att.is_file()

    out = capsys.readouterr()
    assert "Traceback" not in out.err
    # The probe and fine-tuning show their accuracy on the console, not only in metrics.jsonl.
    assert out.out.count("top1") >= 3
    # Default warm-ups (40, 10, 5 epochs) are longer than these runs: each stage says so at start.
    assert out.err.count("--optim.warmup_epochs") >= 3


def test_auto_precision_takes_bf16_on_a_cpu_only_where_it_was_timed_faster(monkeypatch):
    from mae.train import accelerator as run

    monkeypatch.setattr(run.torch.cuda, "is_available", lambda: False)
    for speedup, expected in ((0.5, "no"), (1.1, "no"), (run.BF16_PAYS, "bf16"), (2.2, "bf16")):
        monkeypatch.setattr(run, "cpu_bf16_speedup", lambda s=speedup: s)
        run.agreed_bf16_speedup.cache_clear()  # decided once per process: forget the answer before
        assert run.resolve_precision("auto") == expected
        assert run.resolve_precision("no") == "no" and run.resolve_precision("bf16") == "bf16"
    monkeypatch.setattr(run, "cpu_has_bf16", lambda: True)
    assert run.describe_precision("auto", "bf16") == "bf16 (auto: bf16 matrix products 2.20x fp32 on this CPU)"
    assert run.describe_precision("bf16", "bf16") == "bf16"
    run.agreed_bf16_speedup.cache_clear()


@pytest.mark.slow
def test_every_process_of_a_cpu_run_takes_the_precision_of_the_slowest(tmp_path):
    """Each rank times its own cores; one whose bf16 pays and one whose does not must still agree."""
    script = tmp_path / "ranks.py"
    script.write_text(
        "import os\n"
        "from mae.train import accelerator as run\n"
        "run.cpu_bf16_speedup = lambda: 2.2 if os.environ['RANK'] == '0' else 0.5\n"
        "choice = f\"{run.resolve_precision('auto')} {run.agreed_bf16_speedup()}\"\n"
        f"open(os.path.join({str(tmp_path)!r}, 'rank' + os.environ['RANK']), 'w').write(choice)\n"
        "run.PartialState().destroy_process_group()\n"  # as every stage ends (Accelerator.end_training)
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["no 0.5", "no 0.5"]


def test_bf16_speedup_is_timed_where_the_cpu_has_bf16_and_zero_where_it_has_not(monkeypatch):
    from mae.train import accelerator as run

    run.cpu_bf16_speedup.cache_clear()
    monkeypatch.setattr(run, "cpu_has_bf16", lambda: False)
    assert run.cpu_bf16_speedup(64, 1) == 0.0
    run.cpu_bf16_speedup.cache_clear()  # timed once per process: forget the answer above
    monkeypatch.setattr(run, "cpu_has_bf16", lambda: True)
    assert run.cpu_bf16_speedup(64, 1) > 0  # a real timing of 64 x 64 products in both precisions
    run.cpu_bf16_speedup.cache_clear()


def test_a_cpu_run_keeps_its_freed_host_memory_for_the_next_step():
    """A step's activations freed and allocated again must not be faulted in afresh, page by page."""
    script = (
        "import resource, torch\n"
        "from mae.train.speed import configure_speed\n"
        "configure_speed(torch.nn.Linear(2, 2), 'cpu', 'no')\n"
        "def step():\n"
        "    acts = [torch.ones(6 * 2**20) for _ in range(4)]  # 4 x 24 MiB, every page written\n"
        "    del acts\n"
        "step(), step()  # the heap grows to the step's size\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "for _ in range(8):\n"
        "    step()\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n"
    )
    from mae.train.speed import keep_freed_memory

    if not keep_freed_memory():
        pytest.skip("not glibc's malloc")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    touched = 8 * 4 * 24 * 2**20 // 4096  # pages the eight steps write (glibc's defaults: nearly all faulted afresh)
    assert int(out.stdout) < touched * 0.05, f"{out.stdout.strip()} page faults over {touched} pages written"
