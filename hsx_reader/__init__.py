"""Read a completed run for training: map-style and streaming datasets, collate functions.

    from hsx_reader import RunStream, Expectations, collate_packed
    ds = RunStream("s3://bucket/prefix", "myrun", expect=Expectations(layer_ids=[1, 9, 17], dtype="bfloat16"))
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=4, collate_fn=collate_packed)

Needs only the store (manifest + index + batch objects), not Redis; ``RunFollower`` follows a run
still being extracted and reads its Redis ledger too. Never
imports a role (producer, gpu_worker, uploader, dashboard).
"""

from hsx_reader.cache import ByteCache, CacheStats
from hsx_reader.collate import collate_packed, collate_padded
from hsx_reader.dataset import RunDataset
from hsx_reader.follow import Cursor, RunFollower
from hsx_reader.objects import CorruptBatch
from hsx_reader.run import Expectations, ReaderError, RunIndex, RunMismatch, SampleRef, load_run
from hsx_reader.stream import RunStream

__all__ = ["ByteCache", "CacheStats", "CorruptBatch", "Cursor", "Expectations", "ReaderError", "RunDataset", "RunIndex",
           "RunFollower", "RunMismatch", "RunStream", "SampleRef", "collate_packed", "collate_padded", "load_run"]
