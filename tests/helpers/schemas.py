"""JSON schemas the structured-output tests share."""

from __future__ import annotations

# A person: the default model's structured-output tests ask for one (engine and wire alike).
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 30},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "minLength": 1, "maxLength": 30},
                         "hobbies": {"type": "array", "maxItems": 3,
                                     "items": {"type": "string", "minLength": 1, "maxLength": 20}}}}
