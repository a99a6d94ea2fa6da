"""Wrong NATS credentials are an AuthError (not retryable), never a ConnectionFailed retried for ever.

A NATS server of its own, with users: the connection without credentials is mapped to a user
(``no_auth_user``) so the harness's readiness probe works; one with a wrong password or token is refused
with ``-ERR 'Authorization Violation'``.
"""

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from faucet_nats.config import NatsConnectionConfig
from faucet_nats.jetstream import connect

from faucet_dagster.protocol import AuthError
from faucet_dagster.testing import NatsServer

RIGHT = "right-password-1"
WRONG = "wrong-password-2"


class NatsServerWithUsers(NatsServer):
    """The harness's NATS server with two users, ``app`` (password) and ``anonymous`` (no_auth_user)."""

    def _command(self, workdir: Path) -> list[str]:
        conf = workdir / "users.conf"
        conf.write_text(
            "authorization {\n"
            f'  users = [ {{user: app, password: "{RIGHT}"}}, {{user: anonymous, password: "unused-3"}} ]\n'
            "}\n"
            "no_auth_user: anonymous\n"
        )
        return [*super()._command(workdir), "-c", str(conf)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with NatsServerWithUsers(base_dir=tmp_path_factory.mktemp("nats_users")).start() as started:
        yield started


def config(url: str, auth: dict[str, object]) -> NatsConnectionConfig:
    return NatsConnectionConfig.parse({"servers": [url], "auth": auth, "connect_timeout": 2.0})


async def connect_and_close(cfg: NatsConnectionConfig) -> None:
    client = await connect(cfg, where="test")
    await client.close()


def test_a_wrong_password_or_token_is_an_auth_error_naming_no_secret(server: NatsServer) -> None:
    asyncio.run(
        connect_and_close(
            config(server.url, {"type": "user_password", "config": {"username": "app", "password": RIGHT}})
        )
    )
    for auth in (
        {"type": "user_password", "config": {"username": "app", "password": WRONG}},
        {"type": "token", "config": {"token": WRONG}},
    ):
        with pytest.raises(AuthError) as caught:
            asyncio.run(connect_and_close(config(server.url, auth)))
        assert not caught.value.retryable
        assert WRONG not in str(caught.value) and server.url in str(caught.value)
