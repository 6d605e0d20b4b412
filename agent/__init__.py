"""The per-node agent: GPU and power sources, the heartbeat publisher, the job launcher."""
