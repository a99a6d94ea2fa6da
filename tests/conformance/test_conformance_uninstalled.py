"""``conformance_tests`` runs on a ConnectorSpec that is not installed: nothing looks it up by name
(check 5 plans the capabilities of the connector built from this spec). The other checks are the
installed ``sql`` sink's, run in ``test_conformance_sql.py``; a spec object sent to the scenarios'
worker processes is ``test_subclassed_connector.py``'s."""

from faucet_dagster.conformance import ConformanceOptions
from faucet_dagster.conformance.classes import conformance_tests
from faucet_dagster.conformance.targets import sql_sink
from faucet_dagster.protocol import ConnectorSpec, Role, get_connector

UNINSTALLED = ConnectorSpec("uninstalled_sql", {Role.SINK: get_connector("sql").roles[Role.SINK]})

TestUninstalledSink = conformance_tests(
    sink=UNINSTALLED,
    config=sql_sink,
    options=ConformanceOptions(checks=frozenset({"config_schema", "capabilities"})),
)
