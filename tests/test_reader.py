"""The reader: round trip against a plain HF forward, shuffling/sharding, cache bound, refusal, corruption."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch.utils.data import DataLoader

from hsx.store import LocalStore, open_store
from hsx_reader import (
    ByteCache,
    CorruptBatch,
    Expectations,
    ReaderError,
    RunDataset,
    RunMismatch,
    RunStream,
    collate_packed,
    collate_padded,
)
from tests.test_reader_fixtures import assert_sample_matches
from tests.waiting import scaled


def test_map_dataset_equals_hf_forward(dflash_run):
    ds = RunDataset(str(dflash_run.store), dflash_run.run, expect=Expectations(
        layer_ids=dflash_run.layer_ids, hidden_size=64, dtype=torch.float32))
    assert len(ds) == len(dflash_run.expected) == 160
    for i in range(len(ds)):
        s = ds[i]
        assert s["hidden_states"].shape == (len(s["input_ids"]), 3 * 64)
        assert "final_hidden_states" not in s
        assert_sample_matches(dflash_run, s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden_states"])
    some_id = ds.index.samples[17].sample_id
    assert ds.get(some_id)["sample_id"] == some_id
    # Zero-copy: a sample's hidden states are a view of its batch object's bytes.
    s = ds[3]
    assert s["hidden_states"].untyped_storage().nbytes() > s["hidden_states"].numel() * 4
    with pytest.raises(KeyError, match="not in run"):
        ds.get("no-such-id")


def test_eagle3_final_state_and_range_reads_over_s3(eagle3_run, s3_server, s3_bucket):
    s3 = open_store(f"s3://{s3_bucket}/p", s3_server, "us-east-1", "path")
    for key in LocalStore(eagle3_run.store).list_keys(eagle3_run.run):
        s3.put_bytes(key, (eagle3_run.store / key).read_bytes())
    for fetch in ("range", "object"):
        ds = RunDataset(s3, eagle3_run.run, fetch=fetch, expect=Expectations(store_final=True, layer_ids=[1, 3, 4]))
        for i in range(0, len(ds), 7 if fetch == "object" else 1):
            s = ds[i]
            assert_sample_matches(eagle3_run, s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden_states"],
                                  final=s["final_hidden_states"])


def _ids_of_epoch(stream: RunStream, num_workers: int) -> list[str]:
    loader = DataLoader(stream, batch_size=None, num_workers=num_workers,
                        collate_fn=lambda s: s["sample_id"])
    return list(loader)


def test_stream_covers_every_sample_once_per_epoch_across_ranks_and_workers(dflash_run):
    all_ids = sorted(dflash_run.expected)
    orders = []
    for epoch in (0, 1):
        seen = []
        for rank in range(2):
            stream = RunStream(str(dflash_run.store), dflash_run.run, seed=5, rank=rank, world_size=2)
            stream.set_epoch(epoch)
            seen += _ids_of_epoch(stream, num_workers=2)
        assert sorted(seen) == all_ids  # every sample, exactly once
        orders.append(seen)
    assert orders[0] != orders[1]  # a new order each epoch
    # Pure partition check over many shapes of (ranks x workers), without processes.
    stream = RunStream(str(dflash_run.store), dflash_run.run, seed=1)
    keys = stream.source.index.keys()
    for world, workers in ((1, 1), (3, 2), (4, 4), (len(keys) + 3, 1)):
        got = [k for r in range(world) for w in range(workers) for k in stream.keys_for(r, world, w, workers)]
        assert sorted(got) == sorted(keys)
    # Deterministic for (seed, epoch); values come through the stream intact.
    a = RunStream(str(dflash_run.store), dflash_run.run, seed=9, prefetch=0)
    b = RunStream(str(dflash_run.store), dflash_run.run, seed=9, prefetch=2)
    first = [s["sample_id"] for s in a]
    assert first == [s["sample_id"] for s in b]
    for s in list(b)[:20]:
        assert_sample_matches(dflash_run, s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden_states"])


def test_cache_limit_is_honoured(dflash_run, tmp_path):
    sizes = [(dflash_run.store / k).stat().st_size for k in LocalStore(dflash_run.store).list_keys(f"{dflash_run.run}/batches")]
    limit = int(2.5 * max(sizes))
    for cache_dir in (None, tmp_path / "cache"):
        ds = RunDataset(str(dflash_run.store), dflash_run.run, cache_bytes=limit, cache_dir=cache_dir)
        for i in list(range(len(ds))) + list(range(len(ds)))[::-1]:
            ds[i]
            stats = ds.source.cache.stats
            assert stats.bytes_held <= limit
            if cache_dir:
                on_disk = sum(p.stat().st_size for p in cache_dir.rglob("*") if p.is_file())
                assert on_disk <= limit
        assert stats.peak_bytes <= limit and stats.evictions > 0 and stats.hits > 0
    cache = ByteCache(10)
    assert cache.get("big", lambda k: torch.zeros(11, dtype=torch.uint8)).numel() == 11
    assert "big" not in cache and cache.stats.bytes_held == 0


def test_refuses_a_run_it_does_not_expect(dflash_run):
    for expect, what in ((Expectations(layer_ids=[1, 9, 17]), "layer_ids"), (Expectations(hidden_size=4096), "hidden_size"),
                         (Expectations(dtype="bfloat16"), "dtype"), (Expectations(store_final=True), "store_final")):
        with pytest.raises(RunMismatch, match=what):
            RunStream(str(dflash_run.store), dflash_run.run, expect=expect)
    with pytest.raises(ReaderError, match="no manifest"):
        RunDataset(str(dflash_run.store), "nosuchrun")


def test_truncated_or_corrupt_object_names_its_key(dflash_run, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(dflash_run.store / dflash_run.run, store / dflash_run.run)
    keys = LocalStore(store).list_keys(f"{dflash_run.run}/batches")
    truncated, corrupt = store / keys[0], store / keys[1]
    truncated.write_bytes(truncated.read_bytes()[:-100])
    data = bytearray(corrupt.read_bytes())
    data[8:20] = b"\x00garbage!!!\x01"
    corrupt.write_bytes(bytes(data))
    ds = RunDataset(str(store), dflash_run.run)
    first_of = {ref.key: ref.position for ref in reversed(ds.index.samples)}
    with pytest.raises(CorruptBatch, match=f"{keys[0]}.*truncated"):
        ds[first_of[keys[0]]]
    with pytest.raises(CorruptBatch, match=f"{keys[1]}.*corrupt"):
        ds[first_of[keys[1]]]
    with pytest.raises(CorruptBatch, match=keys[0]):
        list(RunStream(str(store), dflash_run.run, shuffle=False))
    ranged = RunDataset(str(store), dflash_run.run, fetch="range")
    with pytest.raises(CorruptBatch, match=keys[1]):
        ranged[first_of[keys[1]]]


def test_collate_packed_and_padded(dflash_run):
    ds = RunDataset(str(dflash_run.store), dflash_run.run)
    samples = [ds[i] for i in (0, 50, 100)]
    lengths = [len(s["input_ids"]) for s in samples]
    packed = collate_packed(samples)
    assert packed["cu_seqlens"].tolist() == [0, lengths[0], lengths[0] + lengths[1], sum(lengths)]
    assert packed["cu_seqlens"].dtype == torch.int32 and packed["max_seqlen"] == max(lengths)
    assert packed["position_ids"][0].tolist() == [p for n in lengths for p in range(n)]
    assert packed["input_ids"].shape == (1, sum(lengths)) and packed["input_ids"].dtype == torch.int64
    assert packed["hidden_states"].shape == (1, sum(lengths), 192)
    for b, s in enumerate(samples):
        lo, hi = packed["cu_seqlens"][b], packed["cu_seqlens"][b + 1]
        assert torch.equal(packed["hidden_states"][0, lo:hi], s["hidden_states"])
        assert torch.equal(packed["loss_mask"][0, lo:hi], s["loss_mask"])
    padded = collate_padded(samples, pad_token_id=7, pad_to_multiple_of=16)
    width = -(-max(lengths) // 16) * 16
    assert padded["input_ids"].shape == (3, width) and padded["hidden_states"].shape == (3, width, 192)
    for b, s in enumerate(samples):
        n = lengths[b]
        assert padded["input_ids"][b, :n].tolist() == s["input_ids"].tolist()
        assert (padded["input_ids"][b, n:] == 7).all() and padded["attention_mask"][b].sum() == n
        assert (padded["loss_mask"][b, n:] == 0).all() and (padded["hidden_states"][b, n:] == 0).all()
        assert torch.equal(padded["hidden_states"][b, :n], s["hidden_states"])


CACHE_SCRIPT = """
import sys
from torch.utils.data import DataLoader
from hsx_reader import RunDataset
ds = RunDataset(sys.argv[1], sys.argv[2], cache_bytes=1 << 30, cache_dir=sys.argv[3])
for i in range(len(ds)):
    ds[i]
seen = set()
for _ in DataLoader(ds, batch_size=None, num_workers=2):
    seen |= {p.name for p in __import__("pathlib").Path(sys.argv[3]).iterdir()}
print(sorted(seen))
"""


def test_disk_cache_folders_are_removed_at_exit_and_stale_ones_swept(dflash_run, tmp_path):
    """Each process's p<pid> folder was left behind for good (up to the cache size each)."""
    import subprocess
    import sys

    from hsx_reader.cache import OWNER_FILE
    cache_dir = tmp_path / "cache"
    stale, stale_bare = cache_dir / "p999999999", cache_dir / "p999999998"    # no such pids
    for folder in (stale, stale_bare):
        folder.mkdir(parents=True)
        (folder / "0123abcd").write_bytes(b"x" * 1000)
    (stale / OWNER_FILE).touch()                        # its process died without unlocking: no lock held
    out = subprocess.run([sys.executable, "-c", CACHE_SCRIPT, str(dflash_run.store), dflash_run.run, str(cache_dir)],
                         capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 0, out.stderr
    seen = eval(out.stdout.strip().splitlines()[-1])
    assert len(seen) == 3 and all(name.startswith("p") for name in seen)  # the main process's and 2 workers' folders
    assert stale.name not in seen and stale_bare.name not in seen         # swept when the first cache opened
    assert list(cache_dir.iterdir()) == []                                # and every folder gone at exit
    # A folder whose owner lives is kept.
    live = ByteCache(100, process_root=cache_dir)
    live.get("k", lambda k: torch.zeros(10, dtype=torch.uint8))
    other = cache_dir / "p1"                                           # pid 1 lives, folder being created
    other.mkdir()
    from hsx_reader.cache import remove_stale
    assert remove_stale(cache_dir) == [] and live.disk_dir.exists() and other.exists()
    del live
    import gc
    gc.collect()
    assert sorted(p.name for p in cache_dir.iterdir()) == ["p1"]



def test_a_local_object_rewritten_in_place_after_the_read_does_not_change_what_was_returned(dflash_run, tmp_path):
    """A foreign writer rewrites checked objects in place (same size, same inode, no rename): the tensors handed
    out before are the bytes that were checked, not views of a mapping the rewrite shows through (issue 37)."""
    store = tmp_path / "store"
    shutil.copytree(dflash_run.store / dflash_run.run, store / dflash_run.run)
    ds = RunDataset(str(store), dflash_run.run)
    samples = [ds[0], next(iter(RunStream(str(store), dflash_run.run, shuffle=False)))]
    kept = [{k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)} for s in samples]
    for path in {store / ds.index.by_id[s["sample_id"]].key for s in samples}:
        size = path.stat().st_size
        with open(path, "r+b") as fh:
            fh.seek(8)
            fh.write(b"\x5a" * (size - 8))
        assert path.stat().st_size == size
    for sample, before in zip(samples, kept, strict=True):
        for name, tensor in before.items():
            assert torch.equal(sample[name], tensor), f"{name} of {sample['sample_id']} changed with the file"
