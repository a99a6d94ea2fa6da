"""FCP check 1: the config schema is a valid JSON Schema of an object that the setup's config
satisfies.
"""

import json

import jsonschema

from faucet_dagster.conformance.bounded.common import SCHEMA_RULE
from faucet_dagster.conformance.harness import Subject
from faucet_dagster.conformance.options import ConformanceFailure, Outcome
from faucet_dagster.protocol import Sink, Source


async def config_schema(subject: Subject) -> Outcome:
    """The role's config schema is a valid JSON Schema of an object, and the setup's config is valid."""
    built = subject.build()
    if isinstance(built, Source | Sink):
        schema = built.config_schema()
    else:
        schema = subject.spec.roles[subject.role].config_model.json_schema()
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        where = "/".join(str(part) for part in exc.path) or "<root>"
        raise ConformanceFailure(
            SCHEMA_RULE, f"the config schema is not a valid JSON Schema at {where}: {exc.message}"
        ) from None
    if schema.get("type") != "object":
        raise ConformanceFailure(
            SCHEMA_RULE, f"the config schema describes a {schema.get('type')!r}, not an object"
        )
    config = json.loads(json.dumps(subject.setup.config, default=str))
    errors = sorted(validator(schema).iter_errors(config), key=lambda error: error.json_path)
    if errors:
        raise ConformanceFailure(
            SCHEMA_RULE,
            f"a config the connector accepts does not validate against its schema: {errors[0].json_path}: "
            f"{errors[0].message}",
        )
    return Outcome.passed(f"{validator.__name__} schema with {len(schema.get('properties', {}))} properties")
