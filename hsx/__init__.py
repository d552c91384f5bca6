"""hsx: hidden-state extraction from a target LLM, durably into S3.

The shared kernel. Roles (producer, gpu_worker, uploader, dashboard) import
only this package and meet in Redis and in files; a long-running role builds
on hsx.fleet.role.Role.
"""

__version__ = "0.1.0"
