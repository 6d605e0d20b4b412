"""Node health: the pure state machine (decide.py) and the evaluation tick (loop.py)."""
