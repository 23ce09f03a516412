"""A run's checkpoint: its files, lock, metadata, rows, reader, writer, disk trace."""
