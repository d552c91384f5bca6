"""Whether this host sees what a run's manifest names: its store and its model (docs/architecture.md, rule 8).

A role checks at start (the worker) or when it first meets a run (the uploader): a local store
folder another host wrote must be mounted here at the same absolute path, or the run must use
S3. One line says what is missing and the fix; nothing is created at the unseen path (an
uploader that wrote there would split the run's batches across two folders).
"""

from __future__ import annotations

import socket
from pathlib import Path

from hsx.errors import HsxError
from hsx.runspec.manifest import Manifest
from hsx.store import layout


class RunNotVisible(HsxError):
    """This host cannot see the run's store or model; the message says which path and the fix."""


def open_run_store(manifest: Manifest, role: str, host: str | None = None):
    """The run's store, opened only once its manifest is seen there; RunNotVisible otherwise."""
    run, host = manifest.run, host or socket.gethostname()
    settings = manifest.store   # absolute: Manifest resolves (and reports) a relative one an older hsx wrote
    if settings.is_local:
        root = Path(settings.url.removeprefix("file://")).expanduser()
        if not (root / layout.manifest_key(run)).is_file():
            raise RunNotVisible(f"this {role} cannot see the run's store {root.resolve()} from host {host} (no "
                                f"{layout.manifest_key(run)} there): mount it at that path or use S3")
        return settings.open()
    store = settings.open()
    if store.head(layout.manifest_key(run)) is None:
        raise RunNotVisible(f"this {role} cannot see run {run}'s manifest in its store {settings.url} from host "
                            f"{host}: check the endpoint ({settings.endpoint_url or 'AWS default'}), the bucket and "
                            "the credentials of this host")
    return store


def check_model_visible(model: str, role: str, host: str | None = None) -> None:
    """A local model folder the manifest names must exist here (a hub id is fetched, not checked)."""
    if Path(model).is_absolute() and not Path(model).exists():
        raise RunNotVisible(f"this {role} cannot see the run's model {model} from host "
                            f"{host or socket.gethostname()}: copy or mount it at that path, or pass --model")
