"""The pretraining engine end to end, through the command line it ships."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from accelerate.state import AcceleratorState
from safetensors import safe_open
from safetensors.torch import load_file

import mae
from mae.cli import main
from mae.models.masking import list_masks
from tests.conftest import make_images, make_labeled
from tests.launch import run_on_a_free_port

FAST = [
    "--model.name",
    "mae_vit_micro_patch8",
    "--model.img_size",
    "32",
    "--data.num_workers",
    "0",
    "--loop.progress",
    "false",
    "--loop.mixed_precision",
    "no",
    "--loop.log_every",
    "1",
    "--optim.warmup_epochs",
    "0.5",
    "--optim.lr",
    "1e-3",
]


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def run(*args) -> int:
    AcceleratorState._reset_state(True)
    return main(["pretrain", *FAST, *map(str, args)])


def metrics(out: Path, eval_lines=False) -> list[dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if ("eval" in m) == eval_lines]


def test_pretrain_converges_and_leaves_the_output_folder(tmp_path):
    make_images(tmp_path / "imgs", n=64, formats=("png", "jpg", "webp", "bmp"))
    out = tmp_path / "run"
    assert run("--data.path", tmp_path / "imgs", "--loop.epochs", 4, "--loop.batch_size", 8, "--output_dir", out) == 0
    for name in ("config.yaml", "metrics.jsonl", "encoder.safetensors", "preview.png"):
        assert (out / name).is_file(), name
    assert list((out / "checkpoints").glob("step_*"))
    steps = metrics(out)
    assert [m["step"] for m in steps] == list(range(1, 33))
    assert all({"step", "epoch", "loss", "lr"} <= set(m) for m in steps)
    first = sum(m["loss"] for m in steps[:4]) / 4
    last = sum(m["loss"] for m in steps[-4:]) / 4
    assert last < 0.8 * first, (first, last)
    # the encoder is a plain timm ViT: it loads strictly
    vit = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=96, depth=3, num_heads=3, num_classes=0
    )
    vit.load_state_dict(load_file(out / "encoder.safetensors"), strict=True)


@pytest.mark.parametrize("masking,decoder", [(m, "mae") for m in list_masks()] + [("random", "cross")])
def test_resume_is_bit_identical(tmp_path, masking, decoder):
    make_images(tmp_path / "imgs", n=24)
    args = [
        "--model.masking",
        masking,
        "--model.decoder",
        decoder,
        "--data.path",
        tmp_path / "imgs",
        "--loop.epochs",
        3,
        "--loop.batch_size",
        4,
        "--loop.checkpoint_every",
        5,
        "--loop.keep_checkpoints",
        10,
    ]
    full, part = tmp_path / "full", tmp_path / "part"
    assert run(*args, "--output_dir", full) == 0
    # A run interrupted after step 5 (mid-epoch 0): only its first checkpoint exists.
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "step_00000005", part / "checkpoints" / "step_00000005")
    assert run(*args, "--output_dir", part) == 0
    a = load_file(full / "checkpoints" / "step_00000018" / "model.safetensors")
    b = load_file(part / "checkpoints" / "step_00000018" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [m["loss"] for m in metrics(part)][-13:] == [m["loss"] for m in metrics(full)][-13:]
    # whatever the decoder, the export is the encoder alone and plain timm loads it strictly
    weights = load_file(part / "encoder.safetensors")
    vit = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=96, depth=3, num_heads=3, num_classes=0
    )
    vit.load_state_dict(weights, strict=True)


def test_resume_refuses_a_changed_config_but_allows_more_epochs(tmp_path, capsys):
    make_images(tmp_path / "imgs", n=16)
    args = ["--data.path", tmp_path / "imgs", "--loop.batch_size", 8, "--output_dir", tmp_path / "run"]
    assert run(*args, "--loop.epochs", 1) == 0
    assert run(*args, "--loop.epochs", 1, "--model.mask_ratio", 0.5) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.mask_ratio: 0.75 -> 0.5" in err[0] and "--resume never" in err[0]
    assert run(*args, "--loop.epochs", 2) == 0
    assert metrics(tmp_path / "run")[-1]["step"] == 4
    assert run(*args, "--loop.epochs", 1, "--model.mask_ratio", 0.5, "--resume", "never") == 0


def test_gradient_accumulation_matches_the_full_batch(tmp_path):
    make_images(tmp_path / "imgs", n=32)
    common = ["--data.path", tmp_path / "imgs", "--loop.epochs", 1]
    assert run(*common, "--loop.batch_size", 8, "--output_dir", tmp_path / "full") == 0
    assert run(*common, "--loop.batch_size", 4, "--loop.accum_steps", 2, "--output_dir", tmp_path / "acc") == 0
    a, b = metrics(tmp_path / "full"), metrics(tmp_path / "acc")
    assert len(a) == len(b) == 4
    for x, y in zip(a, b, strict=True):
        assert x["step"] == y["step"] and abs(x["loss"] - y["loss"]) < 1e-5
    wa, wb = load_file(tmp_path / "full" / "encoder.safetensors"), load_file(tmp_path / "acc" / "encoder.safetensors")
    for k in wa:
        # Adam turns float noise in near-zero gradients into updates of up to lr (1e-3) per step.
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=2e-4)


@pytest.mark.slow
@pytest.mark.parametrize("masking", list_masks())
def test_two_processes_match_one(tmp_path, masking):
    make_images(tmp_path / "imgs", n=32)
    common = [*FAST, "--model.masking", masking, "--data.path", str(tmp_path / "imgs"), "--loop.epochs", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # the rendezvous binds a free port itself: no race with other runs
        "--nproc_per_node",
        "2",
        "-m",
        "mae",
        "pretrain",
        *common,
        "--loop.batch_size",
        "4",
        "--output_dir",
        str(tmp_path / "two"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 process(es)" in proc.stdout + proc.stderr
    assert run(*common[len(FAST) :], "--loop.batch_size", 8, "--output_dir", tmp_path / "one") == 0
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert len(one) == len(two) == 8
    for x, y in zip(one, two, strict=True):
        assert abs(x["loss"] - y["loss"]) < 1e-5
    wa, wb = load_file(tmp_path / "one" / "encoder.safetensors"), load_file(tmp_path / "two" / "encoder.safetensors")
    for k in wa:
        # Adam turns float noise in near-zero gradients into updates of up to lr (1e-3) per step.
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=2e-4)


def test_corrupt_files_are_skipped_and_counted(tmp_path):
    make_images(tmp_path / "imgs", n=16)
    (tmp_path / "imgs" / "text.jpg").write_text("not an image")
    (tmp_path / "imgs" / "empty.png").write_bytes(b"")
    with pytest.warns(UserWarning, match="text.jpg"):
        assert (
            run(
                "--data.path",
                tmp_path / "imgs",
                "--loop.epochs",
                2,
                "--loop.batch_size",
                6,
                "--output_dir",
                tmp_path / "run",
            )
            == 0
        )
    assert metrics(tmp_path / "run")[-1]["skipped_files"] == 2  # two distinct bad files, met in each of two epochs


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--data.path", "/no/such/folder"], "--data.path /no/such/folder: no such file or folder"),
        (["--data.path", "{empty}"], "no images found"),
        (["--model.img_size", "30"], "--model.img_size 30: must be a positive multiple of the patch size 8"),
        (["--model.mask_ratio", "1.0"], "--model.mask_ratio 1.0: must be in [0, 1)"),
        (["--model.name", "mae_vit_nope"], "unknown preset 'mae_vit_nope'"),
        (["--loop.epochs", "-1"], "--loop.epochs -1: must be >= 1"),
        (["--optim.blrr", "1e-3"], "unrecognized arguments: --optim.blrr"),
        (["--loop.batch_size", "many"], "loop.batch_size"),
        (["--loop.batch_size", "64"], "cannot fill one batch"),
        (["--model.masking", "stripes"], "--model.masking stripes: unknown masking 'stripes'; choose one of: block,"),
        (["--model.masking", "grid", "--model.mask_ratio", "0.5"], "--model.masking grid: grid masking keeps one"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, args, expected):
    (tmp_path / "empty").mkdir()
    make_images(tmp_path / "imgs", n=4)
    args = [a.replace("{empty}", str(tmp_path / "empty")) for a in args]
    if "--data.path" not in args:
        args = ["--data.path", str(tmp_path / "imgs"), *args]
    code = run(*args, "--output_dir", tmp_path / "out")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("mae pretrain: error:") and expected in err[0], err


def test_typo_in_a_recipe_is_an_error(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim:\n  blr: 1e-3\n  warmpu_epochs: 3\n")
    assert run("--config", recipe, "--output_dir", tmp_path / "o") == 2
    assert "warmpu_epochs" in capsys.readouterr().err


def test_console_script_prints_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mae", "pretrain", "--data.path", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("mae pretrain: error: --data.path")


def test_print_config_shows_resolved_values(capsys):
    with pytest.raises(SystemExit):
        main(["pretrain", "--data.path", "x", "--optim.blr", "0.003", "--print_config"])
    out = capsys.readouterr().out
    assert "blr: 0.003" in out and "mask_ratio: 0.75" in out


def test_print_config_without_data_shows_what_the_demo_runs(capsys):
    import yaml

    from mae.config import DEMO_OVERRIDES

    with pytest.raises(SystemExit):
        main(["pretrain", "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    for key, value in DEMO_OVERRIDES.items():  # the demo's settings, not the ViT-B/800-epoch defaults
        section, _, name = key.rpartition(".")
        assert (printed[section][name] if section else printed[name]) == value, key
    with pytest.raises(SystemExit):  # the user's own options still win
        main(["pretrain", "--loop.epochs", "3", "--print_config=skip_null"])
    assert yaml.safe_load(capsys.readouterr().out)["loop"]["epochs"] == 3


@pytest.mark.slow
def test_demo_and_visualize(tmp_path):
    out = tmp_path / "demo"
    AcceleratorState._reset_state(True)
    assert main(["pretrain", "--loop.epochs", "1", "--loop.progress", "false", "--output_dir", str(out)]) == 0
    saved = (out / "config.yaml").read_text()
    assert "mae_vit_tiny_patch16" in saved and "path: null" in saved
    assert (out / "preview.png").is_file()
    from PIL import Image

    photo = tmp_path / "photo.png"
    Image.new("RGB", (100, 80), (200, 100, 50)).save(photo)
    assert (
        main(
            [
                "visualize",
                "--checkpoint",
                str(out),
                "--images",
                str(photo),
                str(photo),
                "--output",
                str(tmp_path / "grid.png"),
            ]
        )
        == 0
    )
    with Image.open(tmp_path / "grid.png") as grid:
        assert grid.size == (4 * 128 + 5 * 2, 2 * 128 + 3 * 2)  # 64-px images drawn 2x: at least 128 px


def test_nonfinite_losses_are_skipped_then_stop_the_run(tmp_path, monkeypatch, capsys):
    from mae.train.tasks import PretrainTask

    make_images(tmp_path / "imgs", n=16)
    real_forward = PretrainTask.forward
    calls = {"n": 0}

    def flaky(self, batch):
        calls["n"] += 1
        out = real_forward(self, batch)
        return {"loss": out["loss"] * float("nan")} if calls["n"] in (2, 3) else out

    monkeypatch.setattr(PretrainTask, "forward", flaky)
    args = ["--data.path", tmp_path / "imgs", "--loop.batch_size", 4, "--loop.epochs", 2]
    assert run(*args, "--output_dir", tmp_path / "a") == 0
    last = metrics(tmp_path / "a")[-1]
    assert last["nonfinite_steps"] == 2 and last["step"] == 8
    # the two skipped steps log no loss (null); every other step trained normally
    assert [m["step"] for m in metrics(tmp_path / "a") if m["loss"] is None] == [2, 3]

    def always_nan(self, batch):
        return {"loss": real_forward(self, batch)["loss"] * float("nan")}

    monkeypatch.setattr(PretrainTask, "forward", always_nan)
    assert run(*args, "--output_dir", tmp_path / "b", "--loop.max_nonfinite_steps", 3) == 1
    err = capsys.readouterr().err
    assert "3 non-finite losses in a row" in err and "Traceback" not in err


def test_knn_monitor_logs_top1_at_each_evaluation(tmp_path):
    from tests.conftest import make_labeled

    make_images(tmp_path / "imgs", n=16)
    make_labeled(tmp_path / "lab", per_class=8)
    assert (
        run(
            "--data.path",
            tmp_path / "imgs",
            "--loop.epochs",
            2,
            "--loop.batch_size",
            8,
            "--loop.eval_every",
            1,
            "--monitor.knn_data",
            tmp_path / "lab",
            "--output_dir",
            tmp_path / "run",
        )
        == 0
    )
    lines = metrics(tmp_path / "run", eval_lines=True)
    assert [m["epoch"] for m in lines] == [1, 2]
    # the last monitor's top-1 is the k-NN stage's on the final encoder (same split fraction, k and temperature)
    AcceleratorState._reset_state(True)
    assert main(["knn", "--pretrained", str(tmp_path / "run"), "--data.path", str(tmp_path / "lab"),
                 "--data.val_fraction", "0.2", "--data.num_workers", "0", "--loop.mixed_precision", "no",
                 "--model.img_size", "32", "--output_dir", str(tmp_path / "knn")]) == 0  # fmt: skip
    assert lines[-1]["knn_top1"] == pytest.approx(metrics(tmp_path / "knn", eval_lines=True)[-1]["top1"])


def test_compile_without_a_cpp_compiler_is_one_line(tmp_path, capsys, monkeypatch):
    from torch._inductor import cpp_builder
    from torch._inductor.exc import InvalidCxxCompiler

    def no_compiler():
        raise InvalidCxxCompiler()

    # Patch the probe, not inductor's config: undoing a patch of `cpp.cxx` leaves the setting missing for
    # every later test in the process.
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    make_images(tmp_path / "imgs", n=8)
    code = run("--data.path", tmp_path / "imgs", "--loop.batch_size", 4, "--loop.compile", "true",
               "--output_dir", tmp_path / "out")  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "--loop.compile" in err[0] and "C++ compiler" in err[0], err


@pytest.mark.slow
def test_compiled_pretraining_matches_eager_and_exports_plain_weights(tmp_path):
    make_images(tmp_path / "imgs", n=16)
    common = ["--data.path", tmp_path / "imgs", "--loop.epochs", 2, "--loop.batch_size", 8, "--loop.eval_every", 1]
    assert run(*common, "--output_dir", tmp_path / "eager") == 0
    assert run(*common, "--loop.compile", "true", "--output_dir", tmp_path / "compiled") == 0
    eager, compiled = metrics(tmp_path / "eager"), metrics(tmp_path / "compiled")
    assert len(eager) == len(compiled) == 4
    for x, y in zip(eager, compiled, strict=True):
        assert abs(x["loss"] - y["loss"]) < 1e-3 * x["loss"], (x, y)
    assert len(metrics(tmp_path / "compiled", eval_lines=True)) == 2  # the previews ran
    weights = load_file(tmp_path / "compiled" / "encoder.safetensors")
    assert not [k for k in weights if "_orig_mod" in k]
    vit = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=96, depth=3, num_heads=3, num_classes=0
    )
    vit.load_state_dict(weights, strict=True)


TIMM_VITS = {
    # register tokens, no class token, average pooling, positions for the patches only
    "vit_little_patch16_reg4_gap_256": ["--model.patch_size", 8],
    # a class token and register tokens, LayerScale
    "vit_small_patch14_reg4_dinov2": ["--model.patch_size", 8, "--model.embed_dim", 96, "--model.num_heads", 3],
}


@pytest.mark.parametrize("arch", sorted(TIMM_VITS))
def test_a_timm_vit_with_register_tokens_pretrains_and_exports(tmp_path, arch, capsys):
    make_images(tmp_path / "imgs", n=16)
    out = tmp_path / "run"
    small = ["--model.depth", 2, "--model.decoder_embed_dim", 64, "--model.decoder_depth", 1,
             "--model.decoder_num_heads", 2]  # fmt: skip
    args = ["--model.name", arch, *TIMM_VITS[arch], *small, "--data.path", tmp_path / "imgs", "--loop.batch_size", 8]
    assert run(*args, "--loop.epochs", 2, "--output_dir", out) == 0
    losses = [m["loss"] for m in metrics(out)]
    assert len(losses) == 4 and all(0 < x < 10 for x in losses)  # finite, and a normalized-pixel loss's size
    capsys.readouterr()
    assert run(*args, "--loop.epochs", 3, "--output_dir", out) == 0  # resumes, one more epoch
    assert f"resuming from {out / 'checkpoints' / 'step_00000004'} (step 4, epoch 2)" in capsys.readouterr().out
    resumed = metrics(out)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5, 6] and [m["loss"] for m in resumed[:4]] == losses
    path = out / "encoder.safetensors"
    meta = safe_open(str(path), "pt").metadata()
    assert meta["architecture"] == arch
    vit = timm.create_model(arch, pretrained=True, **json.loads(meta["model_args"]),
                            pretrained_cfg_overlay=dict(file=str(path), num_classes=0)).eval()  # fmt: skip
    model = mae.load_pretrained(out).eval()
    vit.load_state_dict(load_file(path), strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(vit.forward_features(x), model.encoder.forward_features(x))
    assert vit.num_prefix_tokens == model.adapter.num_prefix_tokens >= 4
    # and the downstream stages take it (the probe's cls-token default becomes the average without one)
    labeled = make_labeled(tmp_path / "labeled", per_class=8)
    for stage in ("linprobe", "finetune"):
        AcceleratorState._reset_state(True)
        assert main([stage, "--pretrained", str(out), "--data.path", str(labeled), "--loop.epochs", "1",
                     "--loop.batch_size", "8", "--data.num_workers", "0", "--loop.progress", "false",
                     "--output_dir", str(tmp_path / stage)]) == 0  # fmt: skip
    # each stage evaluated the same held-out images and exported a 3-class timm classifier of the same ViT
    held_out = {metrics(tmp_path / s, eval_lines=True)[-1]["samples"] for s in ("linprobe", "finetune")}
    assert len(held_out) == 1 and held_out.pop() > 0
    encoder = load_file(path)
    for stage in ("linprobe", "finetune"):
        weights = load_file(tmp_path / stage / "classifier.safetensors")
        shared = set(encoder) & set(weights)
        assert {"head.weight", "head.bias"} <= set(weights) - shared and "blocks.1.mlp.fc2.weight" in shared, stage
        assert weights["head.weight"].shape == (3, vit.embed_dim), stage
        frozen = all(torch.equal(encoder[k], weights[k]) for k in shared)
        assert frozen == (stage == "linprobe"), stage  # the probe never touches the encoder; fine-tuning trains it


def test_mlp_ratios_reach_the_model_the_export_and_the_downstream_stages(tmp_path):
    """--model.mlp_ratio / --model.decoder_mlp_ratio size the MLPs; timm rebuilds the export from its model_args,
    a run folder reloads with the same shapes, and fine-tuning takes it."""
    make_images(tmp_path / "imgs", n=16)
    out = tmp_path / "run"
    args = ["--model.mlp_ratio", 2, "--model.decoder_mlp_ratio", 1.5, "--model.decoder_embed_dim", 64,
            "--model.decoder_depth", 1, "--model.decoder_num_heads", 2, "--loop.batch_size", 8]  # fmt: skip
    assert run(*args, "--data.path", tmp_path / "imgs", "--loop.epochs", 1, "--output_dir", out) == 0
    model = mae.load_pretrained(out)
    assert model.encoder.blocks[0].mlp.fc1.out_features == 2 * model.encoder.embed_dim
    assert model.decoder.blocks[0].mlp.fc1.out_features == 96
    path = out / "encoder.safetensors"
    meta = safe_open(str(path), "pt").metadata()
    model_args = json.loads(meta["model_args"])
    assert model_args["mlp_ratio"] == 2
    vit = timm.create_model(meta["architecture"], num_classes=0, **model_args)
    vit.load_state_dict(load_file(path), strict=True)
    labeled = make_labeled(tmp_path / "labeled", per_class=8)
    AcceleratorState._reset_state(True)
    assert main(["finetune", "--pretrained", str(out), "--data.path", str(labeled), "--loop.epochs", "1",
                 "--loop.batch_size", "8", "--data.num_workers", "0", "--loop.progress", "false",
                 "--output_dir", str(tmp_path / "ft")]) == 0  # fmt: skip
    assert run("--model.mlp_ratio", 0.001, "--output_dir", tmp_path / "bad") == 2


SYNCS = ("item", "cpu", "tolist", "numpy", "__bool__", "__float__", "__int__")


def test_no_host_sync_between_log_lines(tmp_path, monkeypatch):
    """Steps between two log lines never wait on the device: no .item(), bool(tensor), .cpu() ... in the
    training process (the data pipeline runs in worker processes)."""
    from mae.train import loop_state as loop
    from mae.train.metrics import MetricsWriter

    events: list[str] = []
    for name in SYNCS:
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _r=real, _n=name, **k: events.append(_n) or _r(self, *a, **k)
        )
    real_collect, real_write = loop.Skips.collect, MetricsWriter.write
    monkeypatch.setattr(loop.Skips, "collect", lambda self, *a: events.append("<log") or real_collect(self, *a))
    monkeypatch.setattr(MetricsWriter, "write", lambda self, r: real_write(self, r) or events.append("log>"))
    make_images(tmp_path / "imgs", n=64)
    args = ["--data.path", tmp_path / "imgs", "--loop.batch_size", 4, "--loop.epochs", 1, "--loop.log_every", 5,
            "--data.num_workers", 2, "--loop.mixed_precision", "auto"]  # fmt: skip
    assert run(*args, "--output_dir", tmp_path / "o") == 0
    text = " ".join(events)
    between = [part.split("<log")[0].split() for part in text.split("log>")[1:-1]]
    assert len(between) >= 2  # the steps 6-10 and 11-15 of the 16-step epoch
    assert all(not syncs for syncs in between[:2]), between[:2]


@pytest.mark.slow
def test_accelerate_launch_matches_torchrun(tmp_path):
    """The README's launcher for many GPUs and nodes, here two CPU processes from a config file: the same
    encoder, bit for bit, as torchrun's two processes. (Accelerate launches `distributed_type: MULTI_CPU` through
    mpirun only, one process without it; a MULTI_GPU config on a machine with no GPU runs torchrun's launcher,
    and each process finds no GPU and joins over gloo, as `MULTI_CPU`.)"""
    make_images(tmp_path / "imgs", n=16)
    config = tmp_path / "two_processes.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\nnum_machines: 1\n"
        "machine_rank: 0\ngpu_ids: all\nmixed_precision: 'no'\nuse_cpu: false\nrdzv_backend: static\n"
        "same_network: true\nmain_training_function: main\n"
    )
    args = ["pretrain", *FAST, "--data.path", str(tmp_path / "imgs"), "--loop.epochs", "2", "--loop.batch_size", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # CPU processes, GPU or not
    launchers = {
        "accelerate": lambda port: [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                                    "--main_process_port", str(port)],
        "torchrun": lambda port: [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc_per_node", "2"],  # binds a free port itself
    }  # fmt: skip
    for name, launcher in launchers.items():
        out = ["-m", "mae", *args, "--output_dir", str(tmp_path / name)]
        proc = run_on_a_free_port(lambda port, ln=launcher, out=out: [*ln(port), *out], env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "2 process(es)" in proc.stdout + proc.stderr
    a, b = (load_file(tmp_path / name / "encoder.safetensors") for name in launchers)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [m["loss"] for m in metrics(tmp_path / "accelerate")] == [m["loss"] for m in metrics(tmp_path / "torchrun")]
