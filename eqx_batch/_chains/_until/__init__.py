"""`until`: its rule and checks, the diagnostics, their moments, the checks' records."""
