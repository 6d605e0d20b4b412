"""Jobs: the pure lifecycle (decide.py), its reconcile tick (loop.py), placement, progress, checkpoints."""
