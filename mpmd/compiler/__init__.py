"""jaxpr -> stages -> tasks -> per-actor Programs. Pure functions, no I/O."""
