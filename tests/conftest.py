"""Session-wide fixtures: the S3-compatible server for the object-storage tests (see ``object_store``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from object_store import S3Server, s3_environment, start_s3_server


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One server for the session, exported through the ``AWS_*`` variables; skips the test without one."""
    server, why = start_s3_server()
    if server is None:
        pytest.skip(f"no S3-compatible server: {why}")
    with s3_environment(server):
        yield server
    server.close()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """``s3://<a fresh bucket>`` on the session's server."""
    return s3_server.new_bucket()
