"""Request fields that constrain the output, mapped onto one ``StructuredOutputsParams`` (vLLM's semantics).

Sources, at most one per request: OpenAI's ``response_format`` (``json_object``, ``json_schema`` with or without
``strict``: the output is always constrained to the schema; ``structural_tag``), vLLM's ``structured_outputs``
object, and the legacy ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields.

Unknown request fields are kept by the request models (``extra="allow"``) and checked here: a field that would
constrain or reshape the output but that we don't implement is a 400 naming it (silently answering unconstrained
with a 200 is the bug this prevents); any other unknown field is logged once per name.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from pagedllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Fields other servers use for constrained output that we don't implement: a 400 rather than a silent 200.
UNSUPPORTED_OUTPUT_FIELDS = {
    "guided_whitespace_pattern": "use structured_outputs.disable_any_whitespace",
    "guided_decoding_backend": "the backend is chosen with --structured-outputs-config",
    "grammar": "use structured_outputs.grammar",  # llama.cpp server
    "json_schema": "use response_format or structured_outputs.json",  # llama.cpp server
    "logits_processors": "custom logits processors are not supported",
    "functions": "use tools",  # OpenAI's deprecated function calling
    "function_call": "use tool_choice",
}

_logged_unknown: set[str] = set()

_LEGACY = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))


def check_unknown_fields(extra: Optional[dict]) -> None:
    """``extra``: the request model's ``model_extra``.

    Raises:
        ValueError: starting with the field's name, for a structured-output field we don't implement.
    """
    for name in extra or ():
        hint = UNSUPPORTED_OUTPUT_FIELDS.get(name)
        if hint is not None:
            raise ValueError(f"{name} is not supported ({hint}).")
        if name not in _logged_unknown and len(_logged_unknown) < 1024:
            _logged_unknown.add(name)
            logger.warning("request field %r is not supported and was ignored (logged once)", name[:64])


def _params(field: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs, source=field)
    except TypeError as e:
        raise ValueError(f"{field} has an unknown key: {e}") from None
    except ValueError as e:
        msg = str(e)
        if msg.startswith("structured_outputs") and field != "structured_outputs":
            msg = f"{field}: {msg}"
        raise ValueError(msg) from None


def from_response_format(rf: Optional[dict]) -> Optional[StructuredOutputsParams]:
    """``response_format`` -> params (None for ``text``). Raises ValueError naming ``response_format``."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise ValueError("response_format must be an object.")
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _params("response_format", json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ValueError("response_format.json_schema must be an object with a 'schema'.")
        schema = js.get("schema", js.get("json_schema"))
        if schema is None:
            schema = {"type": "object"}  # OpenAI allows a name only
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON object.")
        return _params("response_format", json=schema)
    if kind == "structural_tag":
        tag = {k: v for k, v in rf.items() if k != "type"} if "format" not in rf else rf
        return _params("response_format", structural_tag=tag)
    raise ValueError(f"response_format type must be text, json_object, json_schema or structural_tag, got {kind!r}.")


def structured_outputs_from_request(req) -> Optional[StructuredOutputsParams]:
    """The request's one structured-output constraint, or None.

    Raises:
        ValueError: starting with the field's name (``response_format``, ``structured_outputs``, ``guided_*``), for
            a malformed spec or when several sources are set.
    """
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = getattr(req, "response_format", None)
    p = from_response_format(rf)
    if p is not None:
        found.append(("response_format", p))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        if isinstance(so, StructuredOutputsParams):
            found.append(("structured_outputs", so))
        elif isinstance(so, dict):
            so = {k: v for k, v in so.items() if k != "source"}
            found.append(("structured_outputs", _params("structured_outputs", **so)))
        else:
            raise ValueError("structured_outputs must be an object.")
    for legacy, key in _LEGACY:
        v = getattr(req, legacy, None)
        if v is not None:
            found.append((legacy, _params(legacy, **{key: v})))
    if len(found) > 1:
        names = [n for n, _ in found]
        raise ValueError(f"{names[1]} can't be combined with {names[0]}: give one structured-output constraint.")
    return found[0][1] if found else None
