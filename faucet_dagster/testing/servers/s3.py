"""An S3 endpoint: moto's server (``moto[server]`` wheel), in memory, on a free loopback port.

moto checks S3's conditional writes (``If-None-Match: *`` on PUT answers 412 when the key exists), which
is what Delta's optimistic commit relies on. An external endpoint (``FAUCET_TEST_S3_ENDPOINT``) is used
with the credentials in ``FAUCET_TEST_S3_ACCESS_KEY_ID`` / ``FAUCET_TEST_S3_SECRET_ACCESS_KEY``.
"""

import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from faucet_dagster.testing.servers._base import (
    HOST,
    S3_ENDPOINT_ENV,
    ManagedServer,
    NotReady,
    port_accepts,
)

S3_ACCESS_KEY_ID_ENV = "FAUCET_TEST_S3_ACCESS_KEY_ID"
S3_SECRET_ACCESS_KEY_ENV = "FAUCET_TEST_S3_SECRET_ACCESS_KEY"
_MOTO_KEY_ID, _MOTO_SECRET = "faucettestkey", "faucet-test-secret-access-key"
"""moto accepts any credentials; these are distinctive so a test can look for the secret in output."""


class S3Server(ManagedServer):
    """An S3-compatible endpoint: moto's server on loopback (in memory: a restart empties it), or the
    external endpoint named by ``FAUCET_TEST_S3_ENDPOINT``.

    moto takes any credentials; ``enforce_auth=True`` makes it check them as S3 does (moto's
    ``INITIAL_NO_AUTH_ACTION_COUNT=0``): no access key is known, so every request is refused with
    ``InvalidAccessKeyId``."""

    kind = "S3"
    env_var = S3_ENDPOINT_ENV
    enforce_auth = False

    def __init__(self, *, enforce_auth: bool = False, **options: Any) -> None:
        super().__init__(**options)
        self.enforce_auth = enforce_auth

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT`` (or the external endpoint)."""
        return self._external if self._external is not None else f"http://{HOST}:{self._port}"

    @property
    def region(self) -> str:
        return os.environ.get("FAUCET_TEST_S3_REGION", "us-east-1")

    @property
    def access_key_id(self) -> str:
        return os.environ.get(S3_ACCESS_KEY_ID_ENV, _MOTO_KEY_ID) if self.is_external else _MOTO_KEY_ID

    @property
    def secret_access_key(self) -> str:
        return os.environ.get(S3_SECRET_ACCESS_KEY_ENV, _MOTO_SECRET) if self.is_external else _MOTO_SECRET

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` (``[a-z0-9-]``, 3 to 63 characters) and return it."""
        self._client().create_bucket(Bucket=name)
        return name

    def _client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
        )

    def _describe(self) -> str:
        return self.endpoint_url

    def _child_env(self, workdir: Path) -> dict[str, str]:
        env = dict(os.environ)
        if self.enforce_auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
        return env

    def _command(self, workdir: Path) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self._port)]

    def _probe(self, timeout: float) -> None:
        if self._external is None and not port_accepts(HOST, self._port):
            raise NotReady(f"nothing listens on {HOST}:{self._port} yet")
        try:
            with urllib.request.urlopen(self.endpoint_url, timeout=timeout):
                return
        except urllib.error.HTTPError:
            return  # an S3 error document (403 for an anonymous request): the endpoint answers
        except OSError as exc:
            raise NotReady(f"{type(exc).__name__}: {exc}") from exc
