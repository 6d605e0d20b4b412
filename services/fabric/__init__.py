"""The fabric check (the preflight): the pure rounds and verdict (decide.py) and the leader's loop (loop.py)."""
