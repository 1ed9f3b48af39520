"""Actor-to-actor data plane: `DataPlane` (ZeroMQ sockets plus a tcp, shm or nccl route per peer)."""

from transport.p2p.base import NothingCame, P2PTransport, TransferError
from transport.p2p.plane import ROUTES, DataPlane

__all__ = ["ROUTES", "DataPlane", "NothingCame", "P2PTransport", "TransferError"]
