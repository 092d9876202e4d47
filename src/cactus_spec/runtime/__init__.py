"""Decoding: one sequence's state (``generation``), where drafts come from (``drafters``),
one iteration over a batch (``stepper``), how far to draft (``policy``), continuous batching
(``scheduler``, ``batch``), and the engine its callers use (``engine``)."""
