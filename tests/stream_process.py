"""A code-server-like process for stop and exit tests: a Kafka to NATS stream's sensor, ticked while
a control file says so, closed by the interpreter's exit as a code server is.

``python tests/stream_process.py CONFIG.json``: the config names the servers, the topic, the target
stream, the state store and the control directory, the epochs' age, and shortens the process's
clocks (the reader's idle stop, the exit's linger and close) so a test runs in seconds. While
``<control>/tick`` exists the sensor is ticked every ``TICK_EVERY`` seconds (a running sensor);
without it nothing ticks (a stopped sensor: the reader stops after its idle time). Once
``<control>/quit`` exists the process returns from ``main`` and exits normally, which closes the
cached runners (``runner_cache``'s exit hook). Each tick writes one JSON line on stdout.
"""

import json
import sys
import time
from pathlib import Path
from typing import Any

TICK_EVERY = 0.3


def main(config_path: str) -> int:
    config: dict[str, Any] = json.loads(Path(config_path).read_text())
    import dagster as dg

    from faucet_dagster.declarations.resources import FaucetConnection
    from faucet_dagster.protocol import ReadLimits
    from faucet_dagster.streams import runner_cache, sensor
    from faucet_dagster.streams.declaration import FaucetStream

    sensor.READER_STOP_SECONDS = config["reader_stop_seconds"]
    runner_cache.EXIT_CLOSE_SECONDS = config["exit_close_seconds"]
    runner_cache.EXIT_LINGER_SECONDS = config["exit_linger_seconds"]
    stream = FaucetStream(
        name=config["name"],
        source=FaucetConnection(
            connector="kafka",
            config={
                "bootstrap_servers": config["kafka_bootstrap"],
                "topics": [config["topic"]],
                "group_id": config["group"],
            },
        ).using(),
        sink=FaucetConnection(
            connector="nats",
            config={
                "servers": [config["nats_url"]],
                "stream": config["target"],
                "subject": f"{config['target']}.rows",
                "duplicate_window": config["duplicate_window"],
                "watermark_bucket": f"w_{config['target']}",
            },
        ).using(),
        resources=(config["topic"],),
        limits=ReadLimits(records=50_000, idle=0.5, age=config["epoch_age"]),
        lease_seconds=config["lease_seconds"],
        state_url=config["state_url"],
    )
    evaluate = sensor.faucet_stream_sensor(stream, minimum_interval_seconds=1)
    # What the code server resolves the sensor's target (the sink asset) against.
    definitions = dg.Definitions(assets=[stream.asset_spec()], sensors=[evaluate])
    control = Path(config["control_dir"])
    instance = dg.DagsterInstance.ephemeral()
    cursor: str | None = None
    while not (control / "quit").exists():
        if (control / "tick").exists():
            try:
                context = dg.build_sensor_context(instance=instance, cursor=cursor, definitions=definitions)
                result = evaluate.evaluate_tick(context)
                cursor = result.cursor
                print(json.dumps({"event": "tick", "skip": result.skip_message}), flush=True)
            except Exception as exc:  # noqa: BLE001 - a failing tick is what the test looks at
                print(json.dumps({"event": "error", "message": str(exc)}), flush=True)
        time.sleep(TICK_EVERY)
    print(json.dumps({"event": "exiting"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
