"""Hydra launcher ``wf_slurm``: a ``-m`` sweep whose points all go to SLURM at once (docs/slurm.md)."""
