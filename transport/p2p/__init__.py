"""Actor-to-actor data plane. `make_transport(kind, ...)` picks an implementation by name."""

from transport.p2p.base import P2PTransport, TransferError


def make_transport(kind: str, actor_id: int, host: str = "127.0.0.1") -> P2PTransport:
    """Create the data-plane endpoint of one actor. Kinds: "tcp" (ZeroMQ)."""
    if kind == "tcp":
        from transport.p2p.tcp import TcpTransport

        return TcpTransport(actor_id, host)
    raise ValueError(f"unknown p2p transport {kind!r}; available: 'tcp'")


__all__ = ["P2PTransport", "TransferError", "make_transport"]
