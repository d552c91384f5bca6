"""Tool commands (verify, export, watch, demo, the tiny model): built on the kernel, imported only by the CLI and tests."""
