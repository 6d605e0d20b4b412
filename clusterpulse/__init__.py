"""Shared pieces of ClusterPulse: the wire contract, settings, retry policy and the `pulse` CLI."""
