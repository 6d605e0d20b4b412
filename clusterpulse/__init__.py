"""The contract every program of ClusterPulse imports: the wire schemas and Redis keys, settings,
the retry policy, the Redis ACL rules and the job and node states."""
