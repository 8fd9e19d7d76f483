"""The shared-storage check at the start of a multi-process stage, one process playing each role (the collectives
stand in): a process that finds the main process's marker goes on, one that does not stops with the one line, and
the main process leaves no marker behind. tests/train/test_multinode.py runs it across two real nodes."""

from types import SimpleNamespace

import pytest

import mae.train.accelerator as acc
from mae.errors import ConfigError
from mae.run_folder import shared_marker


def process(rank: int) -> SimpleNamespace:
    return SimpleNamespace(num_processes=2, process_index=rank, is_main_process=rank == 0)


@pytest.fixture
def collectives(monkeypatch):
    """broadcast sends the main process's token (into the list, as Accelerate's does); gather returns the main
    process's record and then this one's."""
    sent = {"token": "feedc0de", "main": (0, "head", "/shared/run", True)}

    def broadcast(objects: list) -> list:
        objects[0] = objects[0] or sent["token"]
        return objects

    monkeypatch.setattr(acc, "broadcast_object_list", broadcast)
    monkeypatch.setattr(acc, "gather_object", lambda mine: mine if mine[0][0] == 0 else [sent["main"], *mine])
    monkeypatch.setattr(acc, "SHARED_WAIT_S", 0.3)
    return sent


def test_a_process_that_sees_the_marker_goes_on(tmp_path, collectives):
    shared_marker(tmp_path, "feedc0de").write_text("feedc0de")
    acc.check_shared_output_dir(process(1), tmp_path)


@pytest.mark.parametrize("found", ["nothing", "another run's token"])
def test_a_process_that_does_not_stops_with_one_line(tmp_path, collectives, found):
    if found != "nothing":
        shared_marker(tmp_path, "feedc0de").write_text("0ld70ken")
    with pytest.raises(ConfigError) as e:
        acc.check_shared_output_dir(process(1), tmp_path)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"--output_dir {tmp_path}: the process on host ")
    assert "(rank 1)" in message and "main process on host head writes (/shared/run)" in message
    assert "--output_dir must be on storage all nodes share" in message


def test_the_main_process_removes_its_marker(tmp_path, collectives):
    acc.check_shared_output_dir(process(0), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_one_process_writes_nothing(tmp_path):
    acc.check_shared_output_dir(SimpleNamespace(num_processes=1), tmp_path)
    assert list(tmp_path.iterdir()) == []
