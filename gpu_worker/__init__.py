"""The GPU worker role: runs extract jobs, writes batch files into the local spool."""
