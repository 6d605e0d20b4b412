"""Slurm node sync: the pure decision (decide.py); sinfo/scontrol and the sync tick (loop.py)."""
