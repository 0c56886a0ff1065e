import pytest

from tilewise.config import ConfigError, from_dict, load_config


def test_layers_override_in_order(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[train]\nlr = 1e-3\nmax_steps = 50\n[model]\nnorm = "rmsnorm"\n')
    cfg = load_config("tiny", str(toml), ["train.max_steps=7", "data.inputs=['a.txt', 'b/']"])
    assert cfg.train.lr == 1e-3          # from the file, over the preset
    assert cfg.train.max_steps == 7      # --set over the file
    assert cfg.model.norm == "rmsnorm"
    assert cfg.model.d_model == 128      # the preset
    assert cfg.data.inputs == ["a.txt", "b/"]


def test_round_trip_through_dict():
    cfg = load_config("llama-1b", overrides=["train.seed=3"])
    assert from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("override, message", [
    ("train.nope=1", "unknown config key 'train.nope'"),
    ("nope.lr=1", "unknown config key 'nope.lr'"),
    ("train.max_steps=abc", "expected an integer"),
    ("train.compile=3", "expected true or false"),
    ("train.lr", "expected key=value"),
    ("model.norm=batchnorm", "model.norm='batchnorm'"),
    ("model.n_head=5", "not a multiple of model.n_head"),
    ("train.log_every=0", "train.log_every=0; expected an integer >= 1"),
    ("train.eval_every=-1", "train.eval_every=-1; expected an integer >= 0"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_config("tiny", overrides=[override])


def test_unknown_preset_and_missing_file():
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        load_config("huge")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(None, "/nonexistent/run.toml")
