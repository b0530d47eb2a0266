"""Launching work: grids of training runs, torchrun commands, SLURM array scripts and submitit."""
