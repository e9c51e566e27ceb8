"""The OpenAPI schema's generator: public text only.

drf-spectacular turns docstrings into the published reference: a view's or an
action's docstring becomes the operation's description, a serializer's the
component's, a ``get_<field>`` method's the field's. Our docstrings are notes for
the people who work on the code (query counts, scopes, which selector does
what), so none of them is published. What users read is written for them:
``extend_schema(description=...)``, ``extend_schema_serializer(description=...)``
and fields' ``help_text``.
"""

from __future__ import annotations

from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import get_doc, get_override


class PublicAutoSchema(AutoSchema):
    def get_description(self) -> str:
        return ""  # extend_schema(description=...) overrides this method

    def _map_basic_serializer(self, serializer, direction):
        schema = super()._map_basic_serializer(serializer, direction)
        described = get_override(serializer, "description", None)
        if described:
            schema["description"] = described
        else:
            schema.pop("description", None)
        return schema

    def _map_response_type_hint(self, method):
        schema = super()._map_response_type_hint(method)
        if isinstance(schema, dict) and schema.get("description") and schema["description"] == get_doc(method):
            schema = {k: v for k, v in schema.items() if k != "description"}
        return schema
