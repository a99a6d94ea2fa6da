"""Codec lookup works from entry points alone: no connector config, no network, no Dagster."""

import subprocess
import sys
import textwrap

import pytest

from faucet_dagster.protocol import CodecRegistry, ConfigError, IntegerPositionCodec, default_codec_registry

ISOLATED_LOOKUP = textwrap.dedent(
    """
    import socket, sys

    def no_network(*args, **kwargs):
        raise RuntimeError("network access attempted during codec lookup")

    socket.socket.connect = no_network
    socket.create_connection = no_network
    socket.getaddrinfo = no_network

    from faucet_dagster.protocol import default_codec_registry

    registry = default_codec_registry()
    lsn = registry.get("postgres.lsn")
    assert lsn.canonicalize(lsn.validate("A/1")) == "A/1"
    assert registry.get("kafka.offset").compare(1, 2) < 0
    assert registry.get("nats.stream_sequence").validate("7") == 7
    assert "dagster" not in sys.modules, "codec lookup imported dagster"
    print(",".join(registry.names()))
    """
)


def test_registry_lookup_in_a_subprocess_with_no_network_and_no_config() -> None:
    result = subprocess.run(
        [sys.executable, "-c", ISOLATED_LOOKUP],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().split(",") == ["kafka.offset", "nats.stream_sequence", "postgres.lsn"]


def test_unknown_codec_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError) as caught:
        default_codec_registry().get("nope.codec")
    assert "nope.codec" in str(caught.value)


def test_registering_two_codecs_under_one_name_is_refused() -> None:
    class First(IntegerPositionCodec):
        name = "test.dup"

    class Second(IntegerPositionCodec):
        name = "test.dup"

    registry = CodecRegistry()
    registry.register(First())
    registry.register(First())
    with pytest.raises(ConfigError):
        registry.register(Second())


def test_importing_the_protocol_does_not_import_dagster() -> None:
    code = "import sys, faucet_dagster.protocol, faucet_dagster.planner; print('dagster' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "False"
