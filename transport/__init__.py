"""Bytes between processes: the control-plane protocol (ZeroMQ) and the actor-to-actor data plane; and the one
codec both sides share for a checkpoint's parts on disk and their digests (checkpoint_parts.py)."""
