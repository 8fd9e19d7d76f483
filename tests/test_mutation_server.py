"""scripts/mutation_server.py: a forked child's pytest status and output reach the client, a child past its time is
killed (124), each child reads the files on disk as they are now, and without a server the client runs pytest."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "mutation_server.py"


def client(sock, *args, cwd, **env):
    cmd = [sys.executable, str(SCRIPT), "--client", str(sock), "-q", "-p", "no:randomly", "-p", "no:cacheprovider"]
    return subprocess.run([*cmd, *args], cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True)


@pytest.fixture
def project(tmp_path):
    (tmp_path / "lib.py").write_text("VALUE = 1\n")
    (tmp_path / "test_lib.py").write_text("import lib\n\ndef test_value():\n    assert lib.VALUE == 1\n")
    (tmp_path / "test_slow.py").write_text("import time\n\ndef test_sleeps():\n    time.sleep(60)\n")
    return tmp_path


def test_a_child_runs_the_files_on_disk_and_returns_pytest_status(project):
    sock = project / "s.sock"
    env = {**os.environ, "MUTATION_PRELOAD": "json"}
    server = subprocess.Popen([sys.executable, str(SCRIPT), "--serve", str(sock)], env=env, cwd=project)
    try:
        for _ in range(300):
            if sock.exists():
                break
            time.sleep(0.1)
        ok = client(sock, "test_lib.py", cwd=project)
        assert ok.returncode == 0 and "1 passed" in ok.stdout
        (project / "lib.py").write_text("VALUE = 2\n")  # a mutant of the same size, written within the second
        bad = client(sock, "test_lib.py", cwd=project)
        assert bad.returncode == 1 and "1 failed" in bad.stdout
        start = time.monotonic()
        slow = client(sock, "test_slow.py", cwd=project, MUTANT_TIMEOUT_S="1")
        assert slow.returncode == 124 and time.monotonic() - start < 30
        assert client(sock, "test_lib.py", cwd=project).returncode == 1  # the server serves on after a kill
    finally:
        server.kill()
        server.wait()


def test_without_a_server_the_client_runs_pytest_itself(project):
    ok = client(project / "none.sock", "test_lib.py", cwd=project)
    assert ok.returncode == 0 and "1 passed" in ok.stdout
