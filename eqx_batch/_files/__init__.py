"""Files: `save` and `load`, the file format, its leaf records, atomic writes."""
