"""Persistence: what the database keeps of a node (decide.py), the outbox, and the persist tick (loop.py)."""
