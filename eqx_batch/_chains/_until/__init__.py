"""`until`: how a run stops, its rule and checks, diagnostics, moments and records."""
