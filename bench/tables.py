"""Regenerate the README's benchmark tables from bench/results/*.json (never edit those tables by hand).

Each results file has {"area", "gpu", "torch", "triton", "commit", "date", "rows": [...]}; every row has a
"shape" dict and numeric columns. The table shows the rows' keys in first-seen order, less nested details.

    python bench/tables.py            # rewrites the block between the bench-tables markers in README.md
    python bench/tables.py --check    # exits 1 if README.md is out of date
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START, END = "<!-- bench-tables:start -->", "<!-- bench-tables:end -->"


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_cell(v)}" for k, v in value.items())
    return str(value)


def _commit(commit) -> str:
    """A sha shortened to 10 characters; a description of several (merged rows) whole."""
    commit = str(commit)
    return commit if " " in commit else commit[:10]


def table(result: dict) -> str:
    rows = result.get("rows", [])
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    # Detail columns (nested values other than the shape, or never filled) stay in the JSON only.
    columns = [c for c in columns if c == "shape" or (
        any(row.get(c) is not None for row in rows)
        and not any(isinstance(row.get(c), (dict, list)) for row in rows))]
    command = result.get('command', 'PYTHONPATH=src python3 bench/' + result.get('area', '?') + '.py')
    if result.get("commands"):   # rows merged from several runs (bench/multigpu.py --merge): each one's commit
        command = "` + `".join(result["commands"])
    lines = [f"### {result.get('area', '?')}",
             f"{result.get('gpu', '?')}, torch {result.get('torch', '?')}, triton {result.get('triton', '?')}, "
             f"commit {_commit(result.get('commit', '?'))}, {result.get('date', '?')}. "
             f"Reproduce: `{command}`",
             "",
             "| " + " | ".join(columns) + " |",
             "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def tables_of(result: dict) -> list[str]:
    """One table, or one per part where the rows name parts (bench/multigpu.py), as their columns differ."""
    groups = {}
    for row in result.get("rows", []):
        groups.setdefault(row.get("shape", {}).get("part"), []).append(row)
    if len(groups) < 2:
        return [table(result)]
    return [table({**result, "area": f"{result.get('area', '?')}: {part}", "rows": rows})
            for part, rows in groups.items()]


def render() -> str:
    paths = sorted(glob.glob(os.path.join(ROOT, "bench", "results", "*.json")))
    parts = []
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        parts += tables_of(result)
        if result.get("fp8_rows"):  # bench/attention.py --fp8: its own run, commit and rows
            parts.append(table({**result, **result.get("fp8_env", {}), "area": f"{result['area']} (FP8)",
                                "rows": result["fp8_rows"],
                                "command": "TILEWISE_COMMIT=<sha> BENCH_ARGS=--fp8-only bash bench/h200.sh attention"}))
    return "\n\n".join(parts) if parts else "No results yet."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md's tables are out of date")
    args = parser.parse_args()
    readme = os.path.join(ROOT, "README.md")
    with open(readme) as f:
        text = f.read()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    new = f"{head}{START}\n{render()}\n{END}{tail}"
    if args.check:
        return 0 if new == text else 1
    with open(readme, "w") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
