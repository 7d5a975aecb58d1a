"""Load the committed golden vectors (protos/golden/*.json) as Python values."""

from __future__ import annotations

import json
import os

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "protos", "golden")


def from_json(value):
    """Undo the JSON convention: ``{"$hex": "..."}`` is a bytes value."""
    if isinstance(value, dict):
        if set(value) == {"$hex"}:
            return bytes.fromhex(value["$hex"])
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def load(name: str):
    with open(os.path.join(GOLDEN_DIR, name)) as f:
        return json.load(f)


def ids(vectors) -> list[str]:
    return [v["name"] for v in vectors]
