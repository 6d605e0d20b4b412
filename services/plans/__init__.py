"""Gradient-aggregation plans: the pure planner (decide.py), the lifecycle (keeper.py), publishing (loop.py)."""
