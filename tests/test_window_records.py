"""The producer's typed records (issue 33 item 3): a window's record in Redis and a tokenised row, by name.

A window's record is read back by a resuming producer, so its JSON stays the bytes every hsx since windows wrote.
"""

import pickle
from dataclasses import FrozenInstanceError

import numpy as np
import pytest

from hsx import life
from hsx.life import RunKeys
from hsx.prep.dataset import RowError
from hsx.prep.report import RejectedRow, TokenisedRow
from hsx.prep.windows import TokeniseSettings, _encode_one, _WindowBuilder
from producer import windows
from producer.windows import WindowRecord

# As the producer before typed records wrote window 0 (json.dumps of its dict, compact, keys sorted).
WRITTEN = ('{"batches":3,"enqueued":3,"first_batch":0,"padded_tokens":5200,"padding":0.038461538461538436,'
           '"report":{"dropped_overlong":1,"duplicate_ids":0,"examples":["row 7: 9000 tokens > max length 4096, '
           'dropped"],"formats":{"openai":41},"kept":40,"rejected":{},"rows":41,"truncated":0},"samples":40,'
           '"tokens":5000}')
# Window 1, as an hsx that did not count duplicate ids wrote it.
WRITTEN_BEFORE_DUPLICATES = ('{"batches":2,"enqueued":0,"first_batch":3,"padded_tokens":3000,"padding":0.0,'
                             '"report":{"dropped_overlong":0,"examples":[],"formats":{"sharegpt":30},"kept":30,'
                             '"rejected":{"bad_json":2},"rows":32,"truncated":1},"samples":30,"tokens":3000}')


def test_window_records_load_by_name_and_are_written_back_as_the_same_bytes(r):
    key = RunKeys("wr").windows
    r.hset(key, mapping={"0": WRITTEN, "1": WRITTEN_BEFORE_DUPLICATES, "3": WRITTEN})   # window 2 never recorded
    run = life.Run(r, "wr")
    first, second = windows.load(run)      # the contiguous prefix only
    assert isinstance(first, WindowRecord) and isinstance(second, WindowRecord)
    assert (first.first_batch, first.batches, first.end_batch, first.samples, first.enqueued) == (0, 3, 3, 40, 3)
    assert first.report.dropped_overlong == 1 and first.report.formats == {"openai": 41}
    assert second.first_batch == first.end_batch and second.report.duplicate_ids == 0
    assert second.report.rejected_rows == 2 and second.report.truncated == 1
    windows.record(run, 5, first)
    assert r.hget(key, "5").decode() == WRITTEN == first.to_json()
    with pytest.raises(FrozenInstanceError):
        first.batches = 4


def test_a_tokenised_row_is_a_named_record_that_crosses_processes():
    rejected = _encode_one(RowError(4, "not JSON", "bad_json"))
    assert isinstance(rejected, RejectedRow)
    assert (rejected.index, rejected.row_id, rejected.code, rejected.source_format) == (4, None, "bad_json", "unreadable")
    assert pickle.loads(pickle.dumps(rejected)) == rejected
    row = TokenisedRow(index=0, sample_id="a", input_ids=np.arange(6, dtype=np.int32),
                       loss_mask=np.array([0, 0, 0, 1, 1, 1], np.uint8), source_format="openai")
    back = pickle.loads(pickle.dumps(row))
    assert back.sample_id == "a" and back.input_ids.tolist() == list(range(6))

    builder = _WindowBuilder(0, TokeniseSettings("unused", max_length=4, overlong="truncate"), set())
    builder.add(back)
    builder.add(rejected)
    window = builder.window
    (sample,) = window.samples
    assert sample.sample_id == "a" and sample.input_ids.tolist() == [0, 1, 2, 3]
    assert sample.loss_mask.tolist() == [0, 0, 0, 1]
    assert window.report.rows == 2 and window.report.truncated == 1 and window.report.rejected == {"bad_json": 1}
    assert window.report.formats == {"openai": 1, "unreadable": 1}
    with pytest.raises(FrozenInstanceError):
        sample.sample_id = "b"
    with pytest.raises(FrozenInstanceError):
        window.number = 1
