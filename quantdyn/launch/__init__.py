"""Launching work: grids of training runs, torchrun commands, SLURM arrays (sbatch)."""
