"""Real servers (`python -m unified recipe=serve`) in subprocesses on free loopback ports."""
from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: Path, *overrides: str, env: dict | None = None, recipe: str = "serve"):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.model_name = model.name
        self.log = tempfile.NamedTemporaryFile(prefix="unified-serve-", suffix=".log", delete=False)
        self.cwd = tempfile.mkdtemp(prefix="unified-serve-cwd-")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "unified", f"recipe={recipe}", f"model={model}", f"port={self.port}", *overrides],
            cwd=self.cwd, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})

    def output(self) -> str:
        return Path(self.log.name).read_text()

    def wait_listening(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited early:\n{self.output()}"
            try:
                httpx.get(self.base_url + "/health", timeout=2)
                return
            except httpx.TransportError:
                time.sleep(0.05)
        raise TimeoutError(f"server did not listen within {timeout}s:\n{self.output()}")

    def wait_ready(self, timeout: float = 180) -> None:
        """Polls /health until it answers 200 or `timeout` passes; a poll that times out (the host busy while the
        engine loads) counts as not ready yet."""
        self.wait_listening(timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TimeoutException:
                pass
            assert self.proc.poll() is None, f"server exited early:\n{self.output()}"
            assert time.monotonic() < deadline, f"server not ready within {timeout}s:\n{self.output()}"
            time.sleep(0.1)

    def metric(self, name: str) -> float:
        text = httpx.get(self.base_url + "/metrics", timeout=5).text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        assert match, f"{name} not in /metrics"
        return float(match.group(1))

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        assert not os.listdir(self.cwd), f"the server cluttered its working directory: {os.listdir(self.cwd)}"
        return self.proc.returncode


def stream_in_background(url: str, body: dict, headers: dict | None = None) -> tuple[list[str], threading.Thread]:
    """Starts a streaming request on a thread; returns once its first event arrived.

    The list fills with each event's data as it arrives; join the thread to wait for the end."""
    events, first_event = [], threading.Event()

    def stream() -> None:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first_event.set()

    client = threading.Thread(target=stream)
    client.start()
    assert first_event.wait(60), "no streamed event within 60 s"
    return events, client


# A tiny model with small limits, so fuzzed and concurrent requests stay fast.
TINY_SERVER_OPTIONS = ("engine.num_blocks=512", "serve.max_tokens=64", "serve.default_max_tokens=16", "serve.max_n=4",
                       "serve.max_messages=8", "serve.max_body_bytes=65536")


@contextlib.contextmanager
def ready(process: ServerProcess):
    """The process once it serves; on leaving, it must stop cleanly (exit 0, working directory left empty)."""
    try:
        process.wait_ready()
        yield process
    finally:
        assert process.stop() == 0, process.output()


@pytest.fixture(scope="session")
def server(tiny_chat_checkpoint):
    """A ready server on the tiny chat model (no API key)."""
    with ready(ServerProcess(tiny_chat_checkpoint, *TINY_SERVER_OPTIONS, env={"UNIFIED_API_KEY": ""})) as process:
        yield process
