"""Condense bench/attention_ncu.sh's pages (details.txt and sass_*.csv from `ncu -i`) into one JSON.

Per profiled launch, in order: its grid, duration, SM clock, issue-slot use and the busiest pipe ncu names
(on these kernels the tensor pipe: "Shared is the highest-utilized pipeline (X%)"); from its SASS page the
warp-stall samples by reason and by opcode, over the whole kernel and over its hot loop alone (the
instructions sharing the execution count c that maximizes c x the number of instructions executed c times: the
consumers' per-block loop bodies, both warpgroups' copies; the idle padding warps' NOP, the producer's waits
and the once-a-tile code drop out).

    python bench/ncu_summary.py DIR --out results/sm90/attention_ncu.json [--commit SHA]
"""
from __future__ import annotations

import argparse
import collections
import csv
import glob
import json
import os
import re

def parse_details(text: str) -> list[dict]:
    """One dict per launch section of ncu's details page."""
    launches = []
    for block in re.split(r"\n(?=  \S.*\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\))", text):
        head = re.match(r"\s*(\S+) \((\d+), (\d+), (\d+)\)x\((\d+), 1, 1\)", block)
        if not head:
            continue
        entry = {"kernel": head.group(1), "grid": [int(head.group(i)) for i in (2, 3, 4)],
                 "block": int(head.group(5))}
        for key, pattern in (("duration", r"Duration\s+(\S+)\s+([\d.,]+)"),
                             ("sm_ghz", r"SM Frequency\s+Ghz\s+([\d.]+)"),
                             ("issue_slots_busy_pct", r"Issue Slots Busy\s+%\s+([\d.]+)"),
                             ("registers", r"Registers Per Thread\s+register/thread\s+(\d+)"),
                             ("busiest_pipe_pct", r"highest-utilized pipeline \(([\d.]+)%\)")):
            m = re.search(pattern, block)
            if not m:
                continue
            if key == "duration":
                value = float(m.group(2).replace(",", ""))
                entry["duration_us"] = value * {"us": 1.0, "ms": 1000.0, "ns": 1e-3}.get(m.group(1), 1.0)
            else:
                entry[key] = float(m.group(1))
        launches.append(entry)
    return launches


def parse_sass(path: str) -> dict:
    """Stall samples by reason and opcode, whole kernel and hot loop, from one `--page source --csv` page."""
    rows = list(csv.reader(open(path)))
    header = next(r for r in rows if "Source" in r)
    data = rows[rows.index(header) + 1:]
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]

    def num(r, k):
        try:
            return int(r[col[k]] or 0)
        except (ValueError, IndexError):
            return 0

    counts = collections.Counter(num(r, "Instructions Executed") for r in data)
    counts.pop(0, None)
    modal = max(counts, key=lambda c: c * counts[c]) if counts else None

    def tally(selected):
        by_reason, by_op = collections.Counter(), collections.Counter()
        for r in selected:
            words = r[col["Source"]].split()
            op = (words[1] if words and words[0].startswith("@") else (words[0] if words else "?")).split(".")[0]
            for k in reasons:
                by_reason[k[len("stall_"):]] += num(r, k)
            by_op[op] += num(r, "Warp Stall Sampling (All Samples)")
        total = sum(by_reason.values()) or 1
        ops_total = sum(by_op.values()) or 1
        return {"samples": sum(by_reason.values()),
                "by_reason_pct": {k: round(100 * v / total, 1) for k, v in by_reason.most_common(10)},
                "by_opcode_pct": {k: round(100 * v / ops_total, 1) for k, v in by_op.most_common(10)}}

    loop = [r for r in data if modal and num(r, "Instructions Executed") == modal]
    return {"all": tally(data), "hot_loop": {**tally(loop), "instructions": len(loop), "executed_each": modal}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pages", help="the folder with details.txt and sass_<i>_<kernel>.csv")
    p.add_argument("--out", required=True)
    p.add_argument("--commit", default=None, help="the commit whose kernels were profiled")
    p.add_argument("--command", default="bash bench/attention_ncu.sh", help="how the pages were made")
    args = p.parse_args(argv)
    launches = parse_details(open(os.path.join(args.pages, "details.txt")).read())
    for path in glob.glob(os.path.join(args.pages, "sass_*.csv")):
        m = re.match(r"sass_(\d+)_", os.path.basename(path))
        if m and int(m.group(1)) < len(launches):
            launches[int(m.group(1))]["stalls"] = parse_sass(path)
    result = {"area": "attention_ncu", "commit": args.commit, "command": args.command, "launches": launches}
    with open(args.out, "w") as f:
        f.write(json.dumps(result, indent=1) + "\n")
    for e in launches:
        print(e["kernel"], e.get("duration_us"), e.get("busiest_pipe_pct"), e.get("issue_slots_busy_pct"),
              (e.get("stalls") or {}).get("hot_loop", {}).get("by_reason_pct"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
