"""The run configuration: everything a training run needs, typed and saved
with every checkpoint (``config.yaml`` in the run directory)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from quantdyn.config import from_dict
from quantdyn.data.prepare import DataConfig
from quantdyn.data.tokenizer import parse_tokenizer_spec
from quantdyn.errors import QuantdynError, unknown_name
from quantdyn.models.gpt import ModelConfig
from quantdyn.quantize.catalogue import parse_quantizer
from quantdyn.runs import RunDir
from quantdyn.schedules import ScheduleConfig, wsd_bounds
from quantdyn.train.loggers import LOGGERS
from quantdyn.train.optimizers import OptimConfig
from quantdyn.train.qat import QATConfig


@dataclass(frozen=True)
class LoopConfig:
    """The training loop."""

    steps: int = 1000
    """Optimizer steps in total."""
    batch_size: int = 32
    """Sequences per micro-batch per process."""
    seq_len: int = 128
    """Tokens per training sequence."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (paper A: 1.0; 0 = off)."""
    eval_every: int = 100
    """Validation loss every N steps (0 = only at checkpoints)."""
    eval_windows: int = 200
    """Held-out windows of seq_len tokens for validation loss."""
    checkpoint_every: int = 0
    """Checkpoint every N steps (0 = only checkpoint_tokens and the final step)."""
    checkpoint_tokens: tuple[int, ...] = ()
    """Also checkpoint as soon as these token counts are reached."""
    log_every: int = 10
    """Train-loss rows every N steps."""
    dtype: str = "auto"
    """auto (bf16 autocast on GPU, float32 on CPU) | float32 | bfloat16."""
    compile: bool = False
    """torch.compile the model."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N (under torchrun: cuda:LOCAL_RANK)."""
    threads: int = 0
    """CPU threads (0 = torch default)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them (less memory, about
    one more forward per step); names and checkpoints are unchanged."""

    def __post_init__(self):
        for k in ("steps", "batch_size", "seq_len", "grad_accum", "eval_windows"):
            if getattr(self, k) < 1:
                raise QuantdynError(f"train.{k} must be >= 1")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise QuantdynError(f"train.dtype '{self.dtype}' must be auto, float32 or bfloat16")


DIST_STRATEGIES: tuple[str, ...] = ("ddp", "fsdp2")
"""How a run started by torchrun spreads over its processes (see quantdyn/train/distributed.py)."""


@dataclass(frozen=True)
class DistConfig:
    """Data-parallel training over the processes torchrun starts (one process: plain training)."""

    strategy: str = "ddp"
    """ddp: every process holds the whole model and optimizer state, gradients are all-reduced
    (DistributedDataParallel); fsdp2: parameters, gradients and optimizer state are sharded over the
    processes (torch.distributed.fsdp.fully_shard per block + root) — for models whose optimizer state
    does not fit one device. fsdp2 needs torchrun (even with --nproc_per_node 1)."""
    reshard_after_forward: bool = True
    """fsdp2: free the gathered parameters of a block after its forward and gather them again for the
    backward (less memory, one more all-gather per block); False keeps them until the backward."""
    data_timeout_min: int = 1440
    """Minutes the other processes wait for rank 0 to prepare the token shards (tokenizing a large
    corpus can take hours; the training collectives keep torch's default timeout)."""

    def __post_init__(self):
        if self.strategy not in DIST_STRATEGIES:
            raise unknown_name("dist.strategy", self.strategy, DIST_STRATEGIES)
        if self.data_timeout_min < 1:
            raise QuantdynError(f"dist.data_timeout_min={self.data_timeout_min} must be >= 1 (minutes)")


@dataclass(frozen=True)
class AveragingConfig:
    """Online weight averaging in the trainer (paper A: LAWA, EMA)."""

    lawa_window: int = 0
    """LAWA: average of the last K snapshots (0 = off)."""
    lawa_every: int = 0
    """LAWA: take a snapshot every P steps."""
    ema_decay: float = 0.0
    """EMA decay per step (0 = off), e.g. 0.999."""
    ema_half_life_tokens: int = 0
    """Alternative to ema_decay: half-life in tokens (decay = 0.5 ** (tokens_per_step / half_life))."""

    def __post_init__(self):
        if self.lawa_window < 0 or self.lawa_every < 0:
            raise QuantdynError("averaging.lawa_window and lawa_every must be >= 0")
        if bool(self.lawa_window) != bool(self.lawa_every):
            raise QuantdynError("averaging: set both lawa_window (K) and lawa_every (P), or neither")
        if not 0.0 <= self.ema_decay < 1.0:
            raise QuantdynError("averaging.ema_decay must lie in [0, 1)")
        if self.ema_decay and self.ema_half_life_tokens:
            raise QuantdynError("averaging: give ema_decay or ema_half_life_tokens, not both")


@dataclass(frozen=True)
class MonitorConfig:
    """In-training quantization monitor (quantdyn.monitor.PTQMonitor): Δ CE, relative Δ CE, KL and top-1
    agreement of chosen quantizers on the current weights every N steps. The commands that train
    (`quantdyn train`, `cooldown`, `grid`) build it from this section with quantdyn.monitor.hooks_for."""

    every: int = 0
    """Steps between measurements (0 = off)."""
    quantizers: tuple[str, ...] = ("rtn4",)
    """Quantizer specs (e.g. rtn4, gptq3)."""
    calib_samples: int = 16
    """Calibration windows for GPTQ/AWQ."""
    eval_windows: int = 64
    """Held-out windows for Δ CE."""
    warning_every: int = 0
    """The cheap early warning every this many steps (0 = off): warn/curvature_along_update, the loss's curvature
    along the weights' update since the previous warning, from three forward passes on 4 held-out windows."""

    def __post_init__(self):
        if self.every < 0 or self.warning_every < 0:
            raise QuantdynError("monitor.every and monitor.warning_every must be >= 0")
        if self.every:
            for q in self.quantizers:
                parse_quantizer(q)  # an unknown quantizer fails before training starts


@dataclass(frozen=True)
class LogConfig:
    """Where the run's metrics go and what the console shows.

    Every destination gets the same metric names: train/loss, train/lr, train/grad_norm,
    train/tokens_per_s, train/tokens, val/loss, ptq/<quantizer>/delta_ce, ... (quantdyn/train/loggers.py)."""

    to: tuple[str, ...] = ("jsonl",)
    """Destinations: jsonl (RUN_DIR/metrics.jsonl), csv (RUN_DIR/metrics.csv), tensorboard (event files in
    RUN_DIR/tensorboard; extra ``quantdyn[tensorboard]``), wandb (Weights & Biases; extra ``quantdyn[wandb]``;
    WANDB_MODE=offline works without an account). metrics.jsonl is the run's own record (resume, report and
    grid read it): it is written whether or not jsonl is listed."""
    print_every: int = 0
    """Without a terminal (a log file, CI): one plain line every N steps with step, loss, LR and tokens/s
    (0 = train.log_every). On a terminal a progress bar shows the same."""
    wandb_project: str = "quantdyn"
    """Weights & Biases project."""
    wandb_entity: str = ""
    """Weights & Biases entity (team or user; '' = the account's default)."""
    wandb_mode: str = ""
    """online | offline | disabled ('' = the WANDB_MODE environment variable, else wandb's default)."""

    def __post_init__(self):
        seen = set()
        for name in self.to:
            LOGGERS.get(name)  # an unknown destination: did-you-mean and the valid names
            if name in seen:
                raise QuantdynError(f"log.to names '{name}' twice; list each destination once")
            seen.add(name)
        if self.print_every < 0:
            raise QuantdynError(f"log.print_every={self.print_every} must be >= 0 (0 = train.log_every)")
        if self.wandb_mode not in ("", "online", "offline", "disabled"):
            raise unknown_name("log.wandb_mode", self.wandb_mode, ("online", "offline", "disabled"))


OPTIMIZER_STARTS: tuple[str, ...] = ("estimate", "fresh")
"""How the optimizer of a run that starts from a checkpoint's weights alone (model.hf) begins."""


@dataclass(frozen=True)
class OptimizerStartConfig:
    """How the optimizer starts in a run whose first weights come from a checkpoint without optimizer state
    (``model.hf``: public checkpoints carry weights only). A resume, and a branch of a quantdyn run, continue
    the saved optimizer state instead; a GPT trained from scratch starts fresh."""

    mode: str = "estimate"
    """estimate: ``steps`` optimizer steps at LR 0 before step 1, on batches of their own (not the run's), fill
    the optimizer's state (AdamW's moments m and v, bias correction counting them) from the data while the
    weights stay bit for bit as loaded; the run then starts like a stable-phase run, not with AdamW's
    sign-like first update. fresh: an empty optimizer state (with schedule.warmup: a re-warm-up)."""
    steps: int = 20
    """Steps of the estimate (AdamW's v averages over ~1/(1-beta2) steps; its bias correction makes a few tens
    enough for the update's scale)."""

    def __post_init__(self):
        if self.mode not in OPTIMIZER_STARTS:
            raise unknown_name("optimizer_start.mode", self.mode, OPTIMIZER_STARTS)
        if self.steps < 0 or (self.mode == "estimate" and self.steps < 1):
            raise QuantdynError(f"optimizer_start.steps={self.steps} must be >= 1 with mode estimate")


@dataclass(frozen=True)
class RunConfig:
    """A training run."""

    name: str = "run"
    """Run name; the run directory is out_dir/name."""
    out_dir: str = "runs"
    """Parent directory of run directories."""
    seed: int = 0
    """Seed for initialisation and data order."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: LoopConfig = field(default_factory=LoopConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    log: LogConfig = field(default_factory=LogConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    qat: QATConfig | None = None
    """Quantization-aware training (paper B: QuEST W4A4): fake-quantize every block linear's weights
    and inputs in the forward pass; None = full-precision training."""
    init_weights: str = ""
    """Start from this checkpoint's weights (fresh optimizer, step 0) — e.g. QAT fine-tuning of an FP model."""
    optimizer_start: OptimizerStartConfig = field(default_factory=OptimizerStartConfig)
    """model.hf: how the optimizer starts from weights alone (written to run.json)."""

    def __post_init__(self):
        if not self.name or "/" in self.name:
            raise QuantdynError(f"run name '{self.name}' must be non-empty and contain no '/'")
        if self.model.hf and self.init_weights:
            raise QuantdynError("init_weights does not go with model.hf (the weights are model.hf's); drop one")
        if self.qat is not None and self.qat.method == "format" and self.dist.strategy == "fsdp2":
            raise QuantdynError(f"qat.format={self.qat.format} quantizes whole weights, which fsdp2 shards; use "
                                "dist.strategy=ddp (the default)")
        if self.model.hf and self.optimizer_start.mode == "estimate" and self.optim.name == "schedulefree_adamw":
            raise QuantdynError("optimizer_start.mode=estimate steps at LR 0, which schedule-free AdamW cannot; "
                                "use optimizer_start.mode=fresh with a schedule.warmup")

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step for ONE process (the trainer multiplies by world size)."""
        return self.train.batch_size * self.train.seq_len * self.train.grad_accum


def check_warmdown(cfg: RunConfig) -> None:
    """A WSD warmdown (schedule.decay) that the user set longer than the run is one line. Called where a user's
    schedule is read (`quantdyn train`, grids, study specs), not in RunConfig itself: tiny runs with the default
    decay and a handful of steps are valid configs there."""
    s, steps = cfg.schedule, cfg.train.steps
    if s.name != "wsd":
        return
    decay = wsd_bounds(s, steps)[1]
    if decay > steps:
        raise QuantdynError(f"run '{cfg.name}': schedule.decay={s.decay:g} is a warmdown of {decay} steps, longer than "
                            f"the run's {steps} (train.steps); give a fraction of the run (e.g. 0.2) or at most "
                            f"{steps} steps")


def data_config_of(cfg: RunConfig) -> DataConfig:
    """The data section the run reads: with ``model.hf`` the model's own tokenizer (model.hf itself) unless
    data.tokenizer names another pretrained tokenizer (checked against the model's vocabulary when the data
    is opened); a bpe or gpt2 tokenizer other than the default cannot go with a pretrained model."""
    d = cfg.data
    if not cfg.model.hf or d.tokenizer == cfg.model.hf:
        return d
    kind = parse_tokenizer_spec(d.tokenizer)[0]
    if d.tokenizer == DataConfig().tokenizer:
        return replace(d, tokenizer=cfg.model.hf)
    if kind != "hf":
        raise QuantdynError(f"data.tokenizer '{d.tokenizer}' does not go with model.hf '{cfg.model.hf}', which "
                            "reads its own tokenizer's ids; drop data.tokenizer (the model's own is used)")
    return d


def load_run_config(run_dir: Path) -> RunConfig:
    """The typed config of the training run in ``run_dir`` (its config.yaml; quantdyn.runs reads it)."""
    return from_dict(RunConfig, RunDir(run_dir).read_config())
