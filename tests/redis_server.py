"""Private redis-server instances for the tests: free loopback port, no persistence."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest


def redis_server_binary() -> str:
    """The redis-server to run; missing is a failure under CI=true, a skip elsewhere."""
    binary = shutil.which("redis-server")
    if binary is None:
        message = "redis-server is not installed (apt-get install redis-server)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return binary


def _debug_command_option(binary: str) -> list[str]:
    """Redis 7 refuses DEBUG (the tests' way to stall it) unless allowed, here from loopback."""
    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    major = int(version.split("v=")[1].split(".")[0]) if "v=" in version else 0
    return ["--enable-debug-command", "local"] if major >= 7 else []


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One redis-server process that a test can stop, kill, pause and restart.

    With ``cluster=True`` it is a Redis Cluster of this one node, holding every slot.
    """

    def __init__(self, binary: str, *, cluster: bool = False, persistent: bool = False) -> None:
        self.binary = binary
        self.cluster = cluster
        # Persistent: every write is in the append-only file before it is answered, so a
        # restart that keeps the data loses nothing that was acknowledged.
        self.persistent = persistent
        self.port = free_port()
        self.directory = tempfile.mkdtemp(prefix="keyserial-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        cluster = [*_debug_command_option(self.binary)]
        if self.cluster:  # the bus port is port + 10000 unless given: pick a free one
            cluster = ["--cluster-enabled", "yes", "--cluster-port", str(free_port())]
        self.process = subprocess.Popen(
            [
                self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--dir", self.directory, *cluster,
                *(["--appendonly", "yes", "--appendfsync", "always"] if self.persistent
                  else ["--appendonly", "no"]),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self._wait_for(b"PING\r\n", b"+PONG")
        if self.cluster:
            self._wait_for(b"CLUSTER ADDSLOTSRANGE 0 16383\r\n", b"+OK")
            self._wait_for(b"CLUSTER INFO\r\n", b"cluster_state:ok", anywhere=True)

    def _wait_for(self, command: bytes, answer: bytes, *, anywhere: bool = False) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(command)
                    reply = sock.recv(4096)
                    if (answer in reply) if anywhere else reply.startswith(answer):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} never answered {command!r}")

    def kill(self) -> None:
        """Stop at once, losing all data (there is no persistence)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def pause(self) -> None:
        """Stop the server process (SIGSTOP): connections stay open, nothing is answered."""
        if self.process is not None:
            self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)

    def restart(self, *, keep_data: bool = False) -> None:
        """Kill and start again; the data survives only with ``keep_data`` on a persistent one."""
        self.kill()
        if not keep_data:
            shutil.rmtree(self.directory, ignore_errors=True)
            os.makedirs(self.directory)
        self.start()

    def command(self, command: str) -> bytes:
        """Send one inline command and return the first chunk of the reply."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=30) as sock:
            sock.sendall(command.encode() + b"\r\n")
            return sock.recv(4096)

    def close(self) -> None:
        self.resume()
        self.kill()
        shutil.rmtree(self.directory, ignore_errors=True)
