"""Print the recipe key reference (every key of every stage: type, defaults, meaning), generated
from the config dataclasses; `--write` puts it into docs/keys.md between its markers.

    python scripts/key_reference.py [--write]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    from rlkit.keys import BEGIN, END, reference
    from rlkit.stages import config_types

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the table in docs/keys.md")
    table = reference(config_types())
    if not parser.parse_args().write:
        print(table, end="")
        return 0
    readme = ROOT / "docs" / "keys.md"
    text = readme.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme}: no {BEGIN} ... {END} markers to write between")
    head, rest = text.split(BEGIN, 1)
    readme.write_text(f"{head}{BEGIN}\n{table}{END}{rest.split(END, 1)[1]}", encoding="utf-8")
    print(f"wrote {len(table.splitlines()) - 2} keys into {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
