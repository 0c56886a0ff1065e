"""The command line: help for every command; user mistakes give one line on stderr and exit status 2."""
import json
import subprocess
import sys

import pytest

from tilewise.cli import COMMANDS, main


def test_help_of_every_command():
    out = subprocess.run([sys.executable, "-m", "tilewise", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for name in COMMANDS:
        assert name in out.stdout
        sub = subprocess.run([sys.executable, "-m", "tilewise", name, "--help"], capture_output=True, text=True)
        assert sub.returncode == 0, sub.stderr
        assert "usage: tilewise " + name in sub.stdout
        assert len(sub.stdout.splitlines()) > 5


def run_cli(args, capsys):
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.err


@pytest.mark.parametrize("make_args, message", [
    (lambda p: ["train", "--set", "train.nope=1"], "unknown config key 'train.nope'"),
    (lambda p: ["train", "--set", "train.max_steps=many"], "expected an integer"),
    (lambda p: ["train", "--config", str(p / "missing.toml")], "does not exist"),
    (lambda p: ["prepare", str(p / "empty"), "--out", str(p / "out")], "empty"),
    (lambda p: ["prepare", str(p / "nowhere"), "--out", str(p / "out")], "does not exist"),
    (lambda p: ["prepare", str(p / "binary"), "--out", str(p / "out")], "no readable text"),
    (lambda p: ["prepare", str(p / "text"), "--out", str(p / "a_file")], "a_file"),
    (lambda p: ["prepare", str(p / "text"), "--out", str(p / "out"), "--vocab-size", "100"], "vocab"),
    (lambda p: ["sample", "--run", str(p / "norun")], "not a run directory"),
    (lambda p: ["train", "--resume", "--set", f"train.out_dir={json.dumps(str(p / 'fresh'))}",
                "--set", f"data.dir={json.dumps(str(p / 'd'))}"], "no checkpoint"),
])
def test_user_mistakes_are_one_line_errors(tmp_path, capsys, make_args, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "blob.txt").write_bytes(b"\x00\x01\x02\xff" * 100)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("hello world\n" * 50)
    (tmp_path / "a_file").write_text("not a directory")
    code, err = run_cli(make_args(tmp_path), capsys)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert message.lower() in lines[0].lower(), lines[0]
