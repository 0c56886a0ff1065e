"""Configuration: one dataclass per component, named presets, TOML files and `--set key=value` overrides.

A run's configuration is built in three layers, each overriding the last: the defaults below, a preset
(a dict of overrides), a TOML file whose tables are the sections ([model], [train], ...), then
`--set section.field=value` pairs from the command line.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration value or key that does not exist or does not parse."""


@dataclass
class ModelConfig:
    """A decoder-only transformer. GPT-2 and Llama are two settings of these fields, not two classes."""
    vocab_size: int = 2048           # set from the tokenizer at train time, padded (see pad_vocab_to)
    pad_vocab_to: int = 64           # round the embedding rows up to a multiple of this (tensor-core friendly)
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 0               # 0 = n_head (plain multi-head); fewer = grouped-query attention
    d_model: int = 128
    d_ff: int = 0                    # 0 = 4 * d_model for gelu, 8/3 * d_model rounded up to 256 for swiglu
    norm: str = "layernorm"          # layernorm | rmsnorm
    mlp: str = "gelu"                # gelu | swiglu
    pos: str = "learned"             # learned | rope
    attention: str = "flash"         # flash (bf16) | fp8 | fp8_rotate (ops.fp8_flash_attention; experimental)
                                     # | sdpa (torch's scaled_dot_product_attention: cuDNN on an H200; a yardstick)
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    bias: bool = True
    dropout: float = 0.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def ff_dim(self) -> int:
        if self.d_ff:
            return self.d_ff
        if self.mlp == "swiglu":
            return -(-int(8 * self.d_model / 3) // 256) * 256
        return 4 * self.d_model

    def validate(self) -> None:
        choices = {"norm": ("layernorm", "rmsnorm"), "mlp": ("gelu", "swiglu"), "pos": ("learned", "rope"),
                   "attention": ("flash", "fp8", "fp8_rotate", "sdpa")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"model.{name}={getattr(self, name)!r}; expected one of {allowed}")
        if self.d_model % self.n_head:
            raise ConfigError(f"model.d_model={self.d_model} is not a multiple of model.n_head={self.n_head}")
        if self.n_head % self.kv_heads:
            raise ConfigError(f"model.n_head={self.n_head} is not a multiple of model.n_kv_head={self.kv_heads}")
        if self.head_dim % 8 or self.head_dim > 256:
            raise ConfigError(f"head_dim = d_model / n_head = {self.head_dim}; expected a multiple of 8 up to 256")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout}; expected 0 <= dropout < 1")
        hd = self.head_dim
        if self.attention == "fp8_rotate" and (hd < 32 or hd & (hd - 1)):
            raise ConfigError(f"model.attention='fp8_rotate' needs head_dim a power of two >= 32; it is {hd}")


@dataclass
class DataConfig:
    inputs: list = field(default_factory=list)   # files, folders, globs or JSONL; empty = Python's stdlib source
    dir: str = ""                    # token shards; "" = data/<corpus name>-<vocab_size>
    vocab_size: int = 2048
    tokenizer: str = ""              # a tokenizer.json to use instead of training one
    val_fraction: float = 0.01


@dataclass
class TrainConfig:
    out_dir: str = "runs/tiny"
    batch_size: int = 16             # rows per optimizer step, across all ranks and micro-batches
    grad_accum: int = 1
    max_steps: int = 1000
    lr: float = 6e-3
    min_lr_ratio: float = 0.1        # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0           # largest gradient norm (gradients scaled down to it); 0 = no clipping
    eval_every: int = 100            # evaluate every N steps (0 = only at the end)
    eval_batches: int = 10
    log_every: int = 10
    seed: int = 0
    device: str = "auto"             # auto | cpu | cuda
    dtype: str = "auto"              # auto (bf16 on cuda, fp32 on cpu) | bf16 | fp32
    compile: bool = False            # torch.compile the model
    cuda_graphs: str = "auto"        # auto | true | false: replay each optimizer step as one CUDA graph
                                     # (auto: on a single CUDA process without dropout; see tilewise/graphs.py)
    profile_steps: str = ""          # "A:B": steps A..B-1 under torch.profiler, GPU time by kind in
                                     # out_dir/profile_rank{R}.json (tilewise/profile.py; CUDA only)

    def validate(self) -> None:
        for name, least in (("batch_size", 1), ("grad_accum", 1), ("max_steps", 0), ("eval_every", 0),
                            ("eval_batches", 1), ("log_every", 1), ("warmup_steps", 0)):
            if getattr(self, name) < least:
                raise ConfigError(f"train.{name}={getattr(self, name)}; expected an integer >= {least}")
        from .profile import parse_steps
        try:
            parse_steps(self.profile_steps)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    progress: bool = True


@dataclass
class Fp8Config:
    recipe: str = "off"              # off | delayed | current | blockwise
    format: str = "hybrid"           # hybrid (E4M3 forward, E5M2 gradients) | e4m3
    history_len: int = 16
    amax_compute: str = "max"        # max | most_recent
    margin: int = 0
    fsdp_fp8_all_gather: bool = True  # fsdp/hsdp + delayed: gather Fp8Linear weights in FP8 (tilewise.fp8.fsdp)


@dataclass
class CheckpointConfig:
    every: int = 0                   # save every N steps (0 = only at the end)
    keep: int = 3                    # keep the last K checkpoints
    async_save: bool = True
    at_end: bool = True              # save when the run ends (off for benchmarks and throwaway runs)


@dataclass
class DistributedConfig:
    strategy: str = "none"           # none | ddp | fsdp | hsdp
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    timeout_s: int = 600


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


_GPT2 = {"model.norm": "layernorm", "model.mlp": "gelu", "model.pos": "learned", "model.bias": True,
         "model.tie_embeddings": True, "data.vocab_size": 50257}
_LLAMA = {"model.norm": "rmsnorm", "model.mlp": "swiglu", "model.pos": "rope", "model.bias": False,
          "model.rope_theta": 500000.0, "data.vocab_size": 32768}

PRESETS: dict[str, dict[str, Any]] = {
    # The CPU demo: ~1M parameters, a few minutes on two cores.
    "tiny": {"model.n_layer": 4, "model.n_head": 4, "model.d_model": 128, "model.seq_len": 128,
             "data.vocab_size": 2048, "train.batch_size": 16, "train.lr": 6e-3, "train.max_steps": 1000,
             "train.warmup_steps": 50, "train.eval_every": 250, "train.out_dir": "runs/tiny"},
    "gpt2-124m": {**_GPT2, "model.n_layer": 12, "model.n_head": 12, "model.d_model": 768, "model.seq_len": 1024,
                  "train.batch_size": 32, "train.lr": 6e-4, "train.warmup_steps": 200, "train.max_steps": 5000,
                  "train.eval_every": 500, "train.out_dir": "runs/gpt2-124m"},
    "gpt2-350m": {**_GPT2, "model.n_layer": 24, "model.n_head": 16, "model.d_model": 1024, "model.seq_len": 1024,
                  "train.batch_size": 32, "train.lr": 3e-4, "train.warmup_steps": 200, "train.max_steps": 5000,
                  "train.eval_every": 500, "train.out_dir": "runs/gpt2-350m"},
    "gpt-1.3b": {**_GPT2, "model.n_layer": 24, "model.n_head": 16, "model.d_model": 2048, "model.seq_len": 2048,
                 "train.batch_size": 8, "train.lr": 2e-4, "train.warmup_steps": 200, "train.max_steps": 5000,
                 "train.eval_every": 500, "train.out_dir": "runs/gpt-1.3b"},
    "llama-1b": {**_LLAMA, "model.n_layer": 16, "model.n_head": 32, "model.n_kv_head": 8, "model.d_model": 2048,
                 "model.d_ff": 8192, "model.seq_len": 2048, "train.batch_size": 8, "train.lr": 3e-4,
                 "train.warmup_steps": 200, "train.max_steps": 5000, "train.eval_every": 500,
                 "train.out_dir": "runs/llama-1b"},
}


def _parse_value(text: str) -> Any:
    """A --set value as TOML would read it (numbers, booleans, strings, lists), else the plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _coerce(section: str, name: str, value: Any, current: Any) -> Any:
    key = f"{section}.{name}"
    if isinstance(current, bool):
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if isinstance(current, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}={value!r}: expected an integer")
    if isinstance(current, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}={value!r}: expected a number")
    if isinstance(current, list):
        if isinstance(value, list):
            return value
        return [value] if value != "" else []
    if isinstance(current, str):
        return str(value)
    return value


def apply(cfg: Config, key: str, value: Any) -> None:
    """Set `section.field` on cfg, converting value to the field's type; unknown keys are errors."""
    section, _, name = key.partition(".")
    if not name or not hasattr(cfg, section):
        sections = ", ".join(f.name for f in dataclasses.fields(cfg))
        raise ConfigError(f"unknown config key {key!r}: expected section.field with section one of {sections}")
    part = getattr(cfg, section)
    names = [f.name for f in dataclasses.fields(part)]
    if name not in names:
        raise ConfigError(f"unknown config key {key!r}: {section} has {', '.join(names)}")
    setattr(part, name, _coerce(section, name, value, getattr(part, name)))


def load_config(preset: str | None = None, toml_path: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the preset, then the TOML file, then `key=value` overrides."""
    cfg = Config()
    if preset:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}: expected one of {', '.join(PRESETS)}")
        for key, value in PRESETS[preset].items():
            apply(cfg, key, value)
    if toml_path:
        try:
            with open(toml_path, "rb") as f:
                table = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {toml_path!r} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {toml_path!r} does not parse: {e}") from None
        for section, values in table.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{toml_path}: top-level key {section!r} must be a [section] table")
            for name, value in values.items():
                apply(cfg, f"{section}.{name}", value)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. train.lr=3e-4")
        apply(cfg, key.strip(), _parse_value(text.strip()))
    cfg.model.validate()
    cfg.train.validate()
    return cfg


def from_dict(data: dict) -> Config:
    """The inverse of Config.to_dict (for a run directory's config.json)."""
    cfg = Config()
    for section, values in data.items():
        for name, value in values.items():
            apply(cfg, f"{section}.{name}", value)
    return cfg
