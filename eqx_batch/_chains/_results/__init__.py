"""What a run returns: `Chains`, `Problems`, `NonFinite`, the trace as ArviZ data."""
