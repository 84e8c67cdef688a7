"""Getting task events into the index: message parsing, the Pulse consumer, reconciliation."""
