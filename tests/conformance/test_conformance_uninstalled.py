"""``conformance_tests`` runs on a ConnectorSpec that is not installed: nothing looks it up by name
(check 5 plans the capabilities of the connector built from this spec)."""

from faucet_dagster.conformance.classes import conformance_tests
from faucet_dagster.conformance.targets import sql_sink
from faucet_dagster.protocol import ConnectorSpec, Role, get_connector

UNINSTALLED = ConnectorSpec("uninstalled_sql", {Role.SINK: get_connector("sql").roles[Role.SINK]})

TestUninstalledSink = conformance_tests(sink=UNINSTALLED, config=sql_sink)
