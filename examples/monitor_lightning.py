"""The PTQ monitor as a Lightning callback (pip install 'quantdyn[lightning]' torch==<your torch>).

    python examples/monitor_lightning.py [--steps 60] [--every 20] [--out runs/example-lightning]

A LightningModule wraps quantdyn's GPT; ``PTQMonitorCallback(monitor)`` finds the causal LM inside it and
every ``--every`` optimizer steps logs RTN 4-bit and GPTQ 3-bit Δ CE, KL, ... (ptq/<quantizer>/<metric>) to the
Trainer's loggers — here Lightning's CSVLogger (OUT/lightning_logs/version_0/metrics.csv); a TensorBoard or
W&B logger gets them the same way. Runs on a CPU in well under a minute.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

try:
    import lightning.pytorch as L
    from lightning.pytorch.loggers import CSVLogger
except ImportError:  # the older package name
    import pytorch_lightning as L
    from pytorch_lightning.loggers import CSVLogger

from quantdyn.data.prepare import DataConfig, prepare_data
from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config
from quantdyn.monitor import PTQMonitor
from quantdyn.monitor.lightning import PTQMonitorCallback

DATA = DataConfig(source="builtin:kjv", tokenizer="bpe:512", max_tokens=200_000, bpe_train_chars=400_000)


class LitLM(L.LightningModule):
    def __init__(self, vocab_size: int, steps: int):
        super().__init__()
        self.model = GPT(resolve_model_config(ModelConfig(n_layer=2, d_model=64, n_head=2, max_seq_len=128), vocab_size))
        self.steps = steps

    def training_step(self, batch, batch_idx):
        logits = self.model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
        decay_from = int(self.steps * 0.7)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: 1.0 if s < decay_from else max(0.0, (self.steps - s) / (self.steps - decay_from)))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv: list[str] | None = None) -> tuple[object, PTQMonitor]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("runs/example-lightning"))
    args = ap.parse_args(argv)

    data = prepare_data(DATA, progress=False)
    torch.manual_seed(0)
    tokens = np.asarray(data.train, dtype=np.int64)
    starts = np.random.default_rng(0).integers(0, len(tokens) - 65, size=args.steps * 16)
    windows = torch.from_numpy(np.stack([tokens[s : s + 65] for s in starts]))
    loader = torch.utils.data.DataLoader(windows, batch_size=16, shuffle=False)

    monitor = PTQMonitor(["rtn4", "gptq3"], eval_ids=data.split("val"), calib_ids=data.split("calib"),
                         every=args.every, seq_len=64, eval_windows=16, calib_samples=8)
    logger = CSVLogger(str(args.out), name="lightning_logs", version=0)
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=logger,
                        log_every_n_steps=min(10, args.steps), callbacks=[PTQMonitorCallback(monitor)],
                        enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LitLM(data.vocab_size, args.steps), loader)
    monitor.close()
    return trainer, monitor


if __name__ == "__main__":
    main()
