"""The benchmark scripts' shared pieces on CPU: bench/common.py's results writing, and the FP8 attention
ablation's variants, whose source edits must each still find their line in fp8_attention.py."""
import json
import os
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def test_write_result_writes_every_folder_whole_and_reports_one_it_cannot(tmp_path, capsys):
    from common import write_result
    blocked = tmp_path / "a_file"
    blocked.write_text("not a folder")
    good = tmp_path / "new" / "folder"
    result = {"rows": [{"x": 1.5}], "when": object()}
    write_result(result, "area.json", [None, str(blocked), "", str(good)], default=str)
    got = json.loads((good / "area.json").read_text())
    assert got["rows"] == [{"x": 1.5}] and got["when"].startswith("<object")
    assert os.listdir(good) == ["area.json"]             # the temporary file was renamed, not left
    assert str(blocked) in capsys.readouterr().err
    write_result({"rows": []}, "area.json", [str(good)])  # replaces the old file
    assert json.loads((good / "area.json").read_text()) == {"rows": []}


def test_write_result_names_the_folder_it_could_not_write(tmp_path, capsys):
    from common import write_result
    blocked = tmp_path / "a_file"
    blocked.write_text("not a folder")
    write_result({"rows": []}, "area.json", [str(blocked)])
    err = capsys.readouterr().err
    assert "could not write" in err and "a_file" in err


def test_fp8_attention_ablation_variants_find_their_lines():
    """Every variant of bench/fp8_attention_ablate.py loads: each replaced expression occurs exactly once in
    fp8_attention.py (an edit of the kernels that moves one fails here, not on the GPU)."""
    import fp8_attention_ablate as ablate
    with tempfile.TemporaryDirectory() as folder:
        for name, subs in ablate.VARIANTS.items():
            mod = ablate.load_variant(name, subs, folder)
            assert mod.FP8_CONFIGS["fp8_dkdv"][128] == ablate.CONFIGS["fp8_dkdv"]
            source = open(os.path.join(folder, f"_ablate_{name}.py")).read()
            for old, new in subs:
                assert new in source and (old == new or old not in source)
    with pytest.raises(RuntimeError, match="occurs 0 times"):
        ablate.load_variant("broken", [("a line that is not there", "x")], tempfile.gettempdir())


def test_gpu_clocks_summarize_nvidia_smi_lines_and_say_none_without_samples():
    """The e2e timings carry the SM clock and power they ran at: nvidia-smi's lines summarized (median, min),
    unreadable lines skipped, no samples (no nvidia-smi here) None rather than a made-up clock."""
    from common import GpuClocks, summarize_clocks
    got = summarize_clocks("1980, 610.5\n1755, 699.9\n[N/A], [N/A]\n1830, 650.0\n")
    assert got == {"sm_mhz_median": 1830.0, "sm_mhz_min": 1755.0, "power_w_median": 650.0, "samples": 3}
    assert summarize_clocks("") is None and summarize_clocks("[N/A], [N/A]\n") is None
    with GpuClocks(period_ms=50) as clocks:
        pass
    summary = clocks.summary()
    assert summary is None or summary["samples"] >= 1
