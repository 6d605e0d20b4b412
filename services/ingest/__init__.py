"""Ingest: who sent a heartbeat (decide.py), the leader's ingest tick (loop.py), the ingest processes."""
