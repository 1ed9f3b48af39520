"""The `mpmd-actor` daemon: serves one node's devices to an mpmd controller."""
