"""How the side benchmarks (resume, scaling, gpu) report: the table and the machine line on
stdout, ``NAME.json`` (the data) and ``NAME.md`` (the table, then the machine and date) in the
output directory."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def write_report(
    out: str | Path, name: str, table: str, machine: str, data: dict[str, Any]
) -> None:
    print(table)
    print(machine)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"machine": machine, **data}, indent=1))
    (out / f"{name}.md").write_text(f"{table}\n\n{machine}; {time.strftime('%Y-%m-%d')}\n")
