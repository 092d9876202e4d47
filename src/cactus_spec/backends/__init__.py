"""Backends: the models the engine runs, behind one protocol (``base.Backend``)."""
