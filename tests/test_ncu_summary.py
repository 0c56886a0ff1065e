"""bench/ncu_summary.py on small pages in ncu's formats: the details fields per launch and the hot loop (the
execution count with the most dynamic instructions, not the most common count)."""
import csv
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import ncu_summary  # noqa: E402

DETAILS = """[1] python3@host
  _kern_a (132, 1, 1)x(384, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    SM Frequency                    Ghz         1.78
    Duration                         us       688.06
    Issue Slots Busy               %        44.76
    INF   Shared is the highest-utilized pipeline (41.4%) based on elapsed cycles in the workload
    Registers Per Thread             register/thread               168
  _kern_b (32, 16, 4)x(384, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    SM Frequency                    Ghz         1.80
    Duration                         ms         2.30
    Issue Slots Busy               %        38.94
"""


def _sass(path, rows):
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
              "stall_wait", "stall_barrier", "stall_wait (Not Issued)"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "_kern_a"])
        w.writerow(header)
        for i, (src, samples, executed, wait, barrier) in enumerate(rows):
            w.writerow([hex(16 * i), src, samples, executed, wait, barrier, 0])


def test_details_and_hot_loop(tmp_path):
    (tmp_path / "details.txt").write_text(DETAILS)
    # a 3-instruction loop run 1000 times outweighs 5 once-a-tile instructions run 10 times (the modal count)
    loop = [("FMNMX R1, R2, R3, !PT ;", 30, 1000, 25, 5), ("@!P0 MUFU.EX2 R4, R4 ;", 60, 1000, 50, 10),
            ("QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], RZ ;", 10, 1000, 0, 10)]
    once = [("STG.E [R2], R4 ;", 1, 10, 1, 0)] * 5
    idle = [("NOP ;", 500, 3, 0, 500)]
    _sass(tmp_path / "sass_0__kern_a.csv", once + loop + idle)
    out = tmp_path / "summary.json"
    assert ncu_summary.main([str(tmp_path), "--out", str(out), "--commit", "abc"]) == 0
    result = json.loads(out.read_text())
    a, b = result["launches"]
    assert (a["kernel"], a["grid"], a["block"]) == ("_kern_a", [132, 1, 1], 384)
    assert a["duration_us"] == 688.06 and a["sm_ghz"] == 1.78 and a["busiest_pipe_pct"] == 41.4
    assert a["issue_slots_busy_pct"] == 44.76 and a["registers"] == 168
    assert b["duration_us"] == 2300.0 and "busiest_pipe_pct" not in b and "stalls" not in b
    hot = a["stalls"]["hot_loop"]
    assert hot["instructions"] == 3 and hot["executed_each"] == 1000
    assert hot["by_reason_pct"] == {"wait": 75.0, "barrier": 25.0}
    assert hot["by_opcode_pct"] == {"MUFU": 60.0, "FMNMX": 30.0, "QGMMA": 10.0}
    assert a["stalls"]["all"]["by_opcode_pct"]["NOP"] > 70   # the idle warps dominate the whole kernel
