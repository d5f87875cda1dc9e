"""Does a tool call's arguments object match its function's ``parameters`` JSON schema (``jsonschema``)?"""

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
    return True
