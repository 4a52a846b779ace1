"""Write docs/events.schema.json from the event types (``python scripts/generate_event_schema.py``).

The file is checked in; tests/unit/test_events_golden.py fails when it no longer
matches what the code generates. ``--check`` exits 1 instead of writing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gpupool.events import event_json_schema

TARGET = Path(__file__).resolve().parents[1] / "docs" / "events.schema.json"


def render() -> str:
    return json.dumps(event_json_schema(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        current = TARGET.read_text() if TARGET.exists() else ""
        if current != text:
            print(f"{TARGET} is stale: run python scripts/generate_event_schema.py")
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
