"""The Slurm job backend: sbatch line, batch script and states (decide.py); the backend tick (loop.py)."""
