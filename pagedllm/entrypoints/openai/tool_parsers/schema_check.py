"""Does a tool call's arguments object match its function's ``parameters`` JSON schema (``jsonschema``; remote
``$ref``s are never fetched: jsonschema's default registry resolves none)?"""

from __future__ import annotations

from typing import Any


def arguments_match_schema(args: Any, schema: dict) -> bool:
    """True when ``args`` is a dict valid against ``schema`` (an unusable schema only requires a dict)."""
    if not isinstance(args, dict):
        return False
    import jsonschema

    try:
        jsonschema.validate(args, schema)
    except jsonschema.ValidationError:
        return False
    except jsonschema.SchemaError:
        return True
    except Exception:  # noqa: BLE001 - an unresolvable $ref, a bad pattern...: not a call we can vouch for
        return False
    return True
