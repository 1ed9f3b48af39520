"""Bytes between processes: the control-plane protocol (ZeroMQ) and the actor-to-actor data plane."""
