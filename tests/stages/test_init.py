"""`mae pretrain --init`: continued pretraining from public weights (official, transformers, our exports),
checked against the reference formulations on the first step, resumable, with one-line errors for bad files."""

import json
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from accelerate.state import AcceleratorState
from safetensors.torch import load_file, save_file

import mae
from mae.cli import main
from mae.data.open import open_source
from mae.data.transforms import PretrainSamples, normalize
from tests.conftest import make_images
from tests.test_importers import DHEADS, HEADS, official_forward, official_state
from tests.train.test_reliability import DRIVER, KILLS

STEP = ["--loop.epochs", "1", "--loop.batch_size", "8", "--loop.log_every", "1", "--loop.mixed_precision", "no",
        "--optim.warmup_epochs", "0", "--loop.progress", "false", "--data.num_workers", "0"]  # fmt: skip
HEAD_COUNTS = ["--model.num_heads", str(HEADS), "--model.decoder_num_heads", str(DHEADS)]
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def cli(*args) -> int:
    AcceleratorState._reset_state(True)
    return main([str(a) for a in args])


def first_loss(out) -> float:
    return next(m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if m["step"] == 1)["loss"]


def first_batch(folder, seed=0):
    """The 8 images of the single first batch as the run prepares them (normalised) and their noise: every image
    is in it, so the loss (a mean over all masked patches) does not depend on their order."""
    samples = PretrainSamples(open_source(str(folder)), img_size=(32, 32), patch_size=8, seed=seed)
    items = [samples[(0, i)] for i in range(len(samples))]
    return normalize(torch.stack([s["image"] for s in items]), MEAN, STD), torch.stack([s["noise"] for s in items])


@pytest.fixture
def images(tmp_path):
    make_images(tmp_path / "imgs", n=8, size=40)
    return tmp_path / "imgs"


def test_official_weights_first_step_loss_is_the_official_formulations(tmp_path, images):
    sd = official_state(decoder=True)
    torch.save({"model": sd}, tmp_path / "mae_pretrain_full.pth")
    out = tmp_path / "run"
    assert cli("pretrain", "--init", tmp_path / "mae_pretrain_full.pth", *HEAD_COUNTS, *STEP,
               "--data.path", images, "--output_dir", out) == 0  # fmt: skip
    imgs, noise = first_batch(images)
    with torch.no_grad():
        expected, _, _ = official_forward(sd, imgs, noise)
    assert first_loss(out) == pytest.approx(expected.item(), rel=1e-5)
    saved = json.loads(json.dumps(__import__("yaml").safe_load((out / "config.yaml").read_text())))
    assert saved["init"] == str(tmp_path / "mae_pretrain_full.pth") and len(saved["init_sha256"]) == 64
    assert saved["model"]["embed_dim"] == 64 and saved["model"]["decoder_embed_dim"] == 32
    meta = json.loads(mae.weights.files.read_metadata(out / "encoder.safetensors")["config"])
    assert meta["init_sha256"] == saved["init_sha256"]  # the export records where the run started


def test_a_transformers_folder_first_step_loss_is_transformers(tmp_path, images):
    import transformers

    from tests.models.test_hf_parity import _hf_model

    torch.manual_seed(3)
    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf")
    out = tmp_path / "run"
    assert cli("pretrain", "--init", tmp_path / "hf", *STEP, "--data.path", images, "--output_dir", out) == 0
    imgs, noise = first_batch(images)
    with torch.no_grad():
        expected = hf(pixel_values=imgs, noise=noise).loss
    assert isinstance(hf, transformers.ViTMAEForPreTraining)
    assert first_loss(out) == pytest.approx(expected.item(), rel=1e-5)


def test_an_encoder_only_file_starts_a_fresh_decoder_and_says_so(tmp_path, images, capsys):
    torch.save({"model": official_state(decoder=False)}, tmp_path / "encoder.pth")
    assert cli("pretrain", "--init", tmp_path / "encoder.pth", *HEAD_COUNTS, *STEP, "--data.path", images,
               "--output_dir", tmp_path / "run") == 0  # fmt: skip
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mae pretrain: warning: --init")]
    assert len(warned) == 1 and "holds an encoder only" in warned[0] and "decoder is freshly initialised" in warned[0]


def test_another_channel_count_and_image_size_adapt_the_weights(tmp_path, images):
    from PIL import Image

    torch.save({"model": official_state(decoder=True)}, tmp_path / "rgb.pth")
    (tmp_path / "gray").mkdir()
    for i, f in enumerate(sorted(images.rglob("*.*"))):
        Image.open(f).convert("L").save(tmp_path / "gray" / f"{i}.png")
    out = tmp_path / "run"
    assert cli("pretrain", "--init", tmp_path / "rgb.pth", *HEAD_COUNTS, *STEP, "--data.path", tmp_path / "gray",
               "--model.in_chans", "1", "--model.img_size", "48", "--output_dir", out) == 0  # fmt: skip
    enc = mae.load_encoder(out)
    assert enc.patch_embed.proj.weight.shape == (64, 1, 8, 8) and tuple(enc.patch_embed.grid_size) == (6, 6)


def test_bad_init_files_are_one_line_errors(tmp_path, images, capsys):
    torch.save({"model": official_state(decoder=True)}, tmp_path / "ok.pth")
    save_file({"decoder.embed.weight": torch.zeros(4, 4)}, str(tmp_path / "decoder_only.safetensors"))
    whole = (tmp_path / "ok.pth").read_bytes()
    (tmp_path / "corrupt.pth").write_bytes(whole[: len(whole) // 2])  # a download cut short
    cases = {
        (tmp_path / "decoder_only.safetensors", ()): "no encoder weights in it",
        (tmp_path / "corrupt.pth", ()): "not a readable PyTorch checkpoint",
        (tmp_path / "missing.pth", ()): "no such file or folder",
        (tmp_path / "ok.pth", ("--model.patch_size", "16")): "its weights have patch_size 8, not the 16 asked for",
    }
    for (path, extra), expected in cases.items():
        code = cli("pretrain", "--init", path, *HEAD_COUNTS, *extra, *STEP, "--data.path", images,
                   "--output_dir", tmp_path / "bad")  # fmt: skip
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, (path, err)
        assert err[0].startswith(f"mae pretrain: error: --init {path}: ") and expected in err[0], err


def test_a_classifier_gives_its_encoder_and_drops_its_head(tmp_path, images, capsys):
    from mae.models.classifier import build_classifier
    from mae.weights.importers import read_encoder

    model = mae.create_mae("mae_vit_micro_patch8")
    mae.export_encoder(model, tmp_path / "enc.safetensors")
    vit, _, _ = build_classifier(read_encoder(str(tmp_path / "enc.safetensors")), 5, global_pool="avg")
    save_file({k: v.contiguous() for k, v in vit.state_dict().items()}, str(tmp_path / "classifier.safetensors"))
    out = tmp_path / "run"
    assert cli("pretrain", "--init", tmp_path / "classifier.safetensors", *STEP, "--data.path", images,
               "--output_dir", out) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "is a classifier: its classifier head is dropped and its fc_norm serves as the encoder's final norm" in err
    start = load_file(str(out / "checkpoints" / "step_00000001" / "model.safetensors"))
    assert "encoder.head.weight" not in start and start["encoder.norm.weight"].shape == (96,)


def test_an_export_with_its_decoder_round_trips_exactly_through_init(tmp_path, images):
    model = mae.create_mae("mae_vit_micro_patch8", norm_pix_loss=True)
    mae.export_encoder(model, tmp_path / "enc.safetensors", with_decoder=True)
    out = tmp_path / "run"
    assert cli("pretrain", "--init", tmp_path / "enc.safetensors", *STEP, "--data.path", images,
               "--output_dir", out, "--export_decoder", "true") == 0  # fmt: skip
    imgs, noise = first_batch(images)
    with torch.no_grad():
        expected = model.train()(imgs, noise=noise).loss
    assert first_loss(out) == pytest.approx(expected.item(), rel=1e-6)  # (the batch's order aside)
    back = mae.load_pretrained(tmp_path / "enc.safetensors").state_dict()  # what --init starts from, bit for bit
    assert back.keys() == model.state_dict().keys() and all(
        torch.equal(back[k], v) for k, v in model.state_dict().items()
    )
    trained = mae.load_pretrained(out / "encoder.safetensors")  # the run's own export carries its decoder too
    final = load_file(str(out / "checkpoints" / "step_00000001" / "model.safetensors"))
    assert all(torch.equal(v, final[k]) for k, v in trained.state_dict().items() if k.startswith("decoder."))


@pytest.mark.slow
def test_sigkill_in_an_init_run_then_rerun_is_bit_identical(tmp_path, images):
    torch.save({"model": official_state(decoder=True)}, tmp_path / "init.pth")
    make_images(tmp_path / "many", n=16)
    args = ["pretrain", "--init", str(tmp_path / "init.pth"), *HEAD_COUNTS, "--data.path", str(tmp_path / "many"),
            "--loop.epochs", "3", "--loop.batch_size", "4", "--loop.checkpoint_every", "2", "--loop.progress",
            "false", "--data.num_workers", "0", "--loop.mixed_precision", "no"]  # fmt: skip

    def child(out, inject=""):
        code = DRIVER.format(inject=textwrap.dedent(inject))
        return subprocess.run([sys.executable, "-c", code, *args, "--output_dir", str(out)], capture_output=True,
                              text=True, timeout=300)  # fmt: skip

    def final(out):
        return load_file(sorted((out / "checkpoints").glob("step_*"))[-1] / "model.safetensors")

    assert child(tmp_path / "whole").returncode == 0
    killed = child(tmp_path / "killed", KILLS["during_a_step"])
    assert killed.returncode == -signal.SIGKILL
    (tmp_path / "init.pth").rename(tmp_path / "moved.pth")  # a resumed run needs the weights only to check them
    torch.save({"model": official_state(decoder=True)}, tmp_path / "init.pth")  # the same bytes back in place
    resumed = child(tmp_path / "killed")
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-2000:]
    a, b = final(tmp_path / "whole"), final(tmp_path / "killed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    torch.save({"model": official_state(decoder=True, seed=1)}, tmp_path / "init.pth")  # other weights: refused
    changed = child(tmp_path / "killed")
    assert changed.returncode == 2 and "was trained with a different config (init_sha256: " in changed.stderr


def test_a_given_init_sha256_must_match_the_file(tmp_path, images, capsys):
    torch.save({"model": official_state(decoder=True)}, tmp_path / "init.pth")
    code = cli("pretrain", "--init", tmp_path / "init.pth", *HEAD_COUNTS, *STEP, "--data.path", images,
               "--init_sha256", "0" * 64, "--output_dir", tmp_path / "run")  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"mae pretrain: error: --init_sha256 {'0' * 64}: ")
    assert "the weights changed since the run started" in err[0]
