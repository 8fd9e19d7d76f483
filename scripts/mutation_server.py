"""A fork server for mutation testing: pytest runs in a child forked from a process that has already imported the
heavy dependencies (torch, timm, accelerate, ...), so a mutant costs its tests, not ~7 s of imports on a slow CPU.

    python scripts/mutation_server.py --serve SOCKET          # imports (MUTATION_PRELOAD, comma-separated), serves
    python scripts/mutation_server.py --client SOCKET -x -q tests/...   # one pytest run; its output, its exit status

The server never imports `mae`: each child imports it from the files on disk, where mutmut has written the mutant,
and writes no bytecode. A child runs in its own session with the client's working directory and environment and is
killed with its process group after MUTANT_TIMEOUT_S (exit status 124). A client that finds no server runs pytest
itself (as does one whose server dies mid-run), so a dead server slows the run and never decides a mutant.
"""

import json
import os
import signal
import socket
import sys
import time

_EXIT = "\n@@mutation-server-exit "
_PRELOAD = (  # what a test run imports from outside the project, pytest's plugins included (pytest would otherwise
    # rewrite their asserts on every run; already imported, they are only warned about)
    "torch", "torchvision", "timm", "accelerate", "numpy", "PIL.Image", "safetensors.torch", "jsonargparse", "datasets",
    "onnx", "onnxruntime", "yaml", "tqdm", "pytest", "_pytest.python", "_pytest.fixtures", "hypothesis",
    "_hypothesis_pytestplugin", "anyio", "anyio.pytest_plugin", "pytest_benchmark.plugin", "platformdirs",
    "xdist.plugin", "xdist.looponfail", "pytest_timeout", "pytest_randomly",
)  # fmt: skip


def _child(conn, request):
    os.setsid()
    os.dup2(conn.fileno(), 1)
    os.dup2(conn.fileno(), 2)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.dont_write_bytecode = True
    sys.argv = ["pytest", *request["args"]]
    sys.path[0] = request["cwd"]
    import pytest

    code = 1
    try:
        code = int(pytest.main(request["args"]))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)
    return 124


def serve(path):
    import importlib

    for name in os.environ.get("MUTATION_PRELOAD", ",".join(_PRELOAD)).split(","):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    assert not any(m == "mae" or m.startswith("mae.") for m in sys.modules), "the server must not import mae"
    if os.path.exists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    print(f"mutation server ready on {path}", flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            request = json.loads(conn.makefile("r").readline())
            pid = os.fork()
            if pid == 0:
                server.close()
                _child(conn, request)
            code = _wait(pid, float(request["env"].get("MUTANT_TIMEOUT_S", 300)))
            conn.sendall(f"{_EXIT}{code}\n".encode())


def client(path, args):
    request = {"args": args, "cwd": os.getcwd(), "env": dict(os.environ)}
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
    except OSError:
        os.execvp(sys.executable, [sys.executable, "-m", "pytest", *args])  # no server: pytest in this process
    conn.sendall((json.dumps(request) + "\n").encode())
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    out, sep, code = data.decode(errors="replace").rpartition(_EXIT)
    if not sep:  # the server died mid-run
        os.execvp(sys.executable, [sys.executable, "-m", "pytest", *args])
    sys.stdout.write(out)
    return int(code)


if __name__ == "__main__":
    mode, path, *rest = sys.argv[1:]
    if mode == "--serve":
        serve(path)
    else:
        sys.exit(client(path, rest))
