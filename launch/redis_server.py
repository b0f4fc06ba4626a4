"""A Redis server of this machine's own (Debian's redis-server) on a localhost port, for the stream
demo and tests: started as a plain child process (no daemon), its append-only file in a folder of
the caller's, so that a server stopped and started again on the same folder has every entry it
acknowledged."""
import os
import shutil
import socket
import subprocess
import time
from typing import Optional

INSTALL_HINT = "install Debian's redis-server (as root: apt-get install redis-server; `make setup` does it)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, folder: str, port: Optional[int] = None, fsync: str = "always"):
        """fsync: Redis' appendfsync, "always" (an acknowledged entry survives a kill) or "everysec"."""
        self.folder, self.port, self.fsync = os.path.abspath(folder), port or free_port(), fsync
        self.process: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> "RedisServer":
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError(f"redis-server is not on PATH: {INSTALL_HINT}")
        os.makedirs(self.folder, exist_ok=True)
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.folder, "--save", "",
             "--appendonly", "yes", "--appendfsync", self.fsync, "--daemonize", "no", "--protected-mode", "yes",
             "--logfile", os.path.join(self.folder, "redis.log")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited with {self.process.returncode}; see "
                                   f"{os.path.join(self.folder, 'redis.log')}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server on port {self.port} did not answer within {timeout_s:g} s")

    def stop(self, kill: bool = False) -> None:
        if self.process is not None and self.process.poll() is None:
            (self.process.kill if kill else self.process.terminate)()
            self.process.wait(timeout=30)
        self.process = None

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
