"""Slurm: node sync (nodes/) and the job backend (jobs/), each a pure decide.py and its loop.py."""
