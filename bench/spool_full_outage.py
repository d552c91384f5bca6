"""The GPU worker during a store outage with its spool on a small file system (issue 23 item 1).

Runs tests/spool_outage.py's scenario: private redis-server, moto S3 behind a
fault proxy, one `hsx worker` (CPU, tiny Qwen3) and one `hsx upload`, the spool
on a tmpfs mounted for the run (needs root). Prints jobs the worker took in the
outage (and after the spool filled), batches failed, dead letters, and the
time from the store's return to the run's completion.

    sudo .venv/bin/python bench/spool_full_outage.py --outage-seconds 120 --fs-mib 1
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hsx_tools.demo import sample_dataset  # noqa: E402
from hsx_tools.tinymodel import build_tiny_model  # noqa: E402
from tests.spool_outage import run_outage  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outage-seconds", type=float, default=120)
    ap.add_argument("--fs-mib", type=float, default=1.0, help="size of the spool's tmpfs")
    ap.add_argument("--samples", type=int, default=160)
    args = ap.parse_args()
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_tiny_model(work / "tiny-qwen3", sample_path=sample_dataset())
        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        moto.start()
        try:
            host, port = moto.get_host_and_port()
            endpoint = f"http://{host}:{port}"
            import boto3

            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
            report = run_outage(work / "run", model, endpoint, "bench", args.outage_seconds,
                                fs_bytes=int(args.fs_mib * 2**20), samples=args.samples)
        finally:
            moto.stop()
    print("\n".join(report.lines()))


if __name__ == "__main__":
    main()
