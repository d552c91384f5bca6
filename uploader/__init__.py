"""The uploader role: moves spool files to the store, verifies them, records them done."""
