import json

import pytest

from hsx.life import ledger, queues
from hsx.runspec.manifest import ManifestMismatch
from hsx.store import open_store
from producer.produce import PlanError, produce
from tests.pipeline import planned_specs, produce_config

GOOD = {"messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi, how can I help"}]}


def _write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_rerun_enqueues_nothing_new_and_other_settings_are_refused(r, redis_server, tiny_model, tmp_path):
    cfg = produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="again")
    first = produce(cfg)
    assert first.enqueued == first.batches > 1
    second = produce(cfg)
    assert second.enqueued == 0 and second.already_pending == first.batches
    assert len(queues.queue(r, queues.extract_queue_name("again"))) == first.batches
    # A batch that is done is not enqueued again, a lost job is.
    q = queues.queue(r, queues.extract_queue_name("again"))
    q.empty()
    spec = ledger.get_spec(r, "again", "b0000000")
    key = f"again/batches/{spec.shard}/{spec.batch_id}.safetensors"
    info = open_store(str(tmp_path / "store")).put_bytes(key, b"0123456789")
    ledger.mark_done(r, "again", spec, key, info.size, info.sha256, by="test")
    third = produce(cfg)
    assert third.already_done == 1 and third.enqueued == first.batches - 1
    with pytest.raises(ManifestMismatch, match="layer_ids"):
        produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="again", layers="1,2"))
    with pytest.raises(ManifestMismatch, match="token_budget"):
        produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="again", token_budget=4096))


def test_bad_rows_are_named_and_good_rows_kept(r, redis_server, tiny_model, tmp_path):
    data = _write(tmp_path / "bad.jsonl", [
        GOOD,                                                     # 0 good
        "",                                                       # 1 empty line
        "{not json",                                              # 2 malformed
        "[1, 2]",                                                 # 3 not an object
        {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},  # 4 unknown role
        {"messages": [{"role": "user", "content": "only a question"}]},  # 5 no assistant turn
        {"messages": []},                                         # 6 empty conversation
        {"text": "no conversation at all"},                       # 7 no known field
        {"input_ids": [1, 2, 3]},                                 # 8 pre-tokenised without mask
        {"input_ids": [1, 2, 3], "loss_mask": [0, 1]},            # 9 mask length differs
        {"input_ids": [1, 2, 10**9], "loss_mask": [0, 1, 1]},     # 10 id outside vocabulary
        {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]},  # 11 non-text
        {"id": "dup", **GOOD},                                    # 12 good
        {"id": "dup", **GOOD},                                    # 13 duplicate id
        {"messages": [{"role": "user", "content": "long " * 400}, {"role": "assistant", "content": "ok"}]},  # 14 over-long
        {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},   # 15 good, pre-tokenised
        {"conversations": [{"from": "human", "value": "hey"}, {"from": "gpt", "value": "hello"}]},  # 16 good ShareGPT
        {"id": {"k": 1}, **GOOD},                                 # 17 an id that is an object
    ])
    report = produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="bad", dataset=data,
                                    max_length=256, max_reject_share=1.0))
    t = report.tokenise
    assert t.rows == 18 and t.kept == 4 and t.dropped_overlong == 1 and t.rejected["bad_id"] == 1
    text = "\n".join(report.lines())
    for index, reason in [(1, "line 2 of bad.jsonl is empty"),
                          (2, "line 3 of bad.jsonl is not valid JSON: Expecting property name enclosed in double quotes "
                              "at column 2"), (3, "expected a JSON object"),
                          (4, "unknown role 'robot'"), (5, "no assistant turn"), (6, "empty"),
                          (7, "no 'messages', 'conversations' or 'input_ids'"), (8, "no loss_mask"),
                          (9, "loss_mask must be 3 values"), (10, "outside the vocabulary"), (11, "no text content"),
                          (13, "duplicate sample id 'dup'"), (14, "tokens > max length 256, dropped"),
                          (17, "id column 'id' holds a dict")]:
        line = [x for x in text.splitlines() if x.strip().startswith((f"row {index + 1}:", f"row {index + 1} ("))]
        assert len(line) == 1 and reason in line[0], (index, reason)   # rows are quoted 1-based
    planned = {s for spec in planned_specs(r, "bad").values() for s in spec.sample_ids}
    assert planned == {"0", "dup", "15", "16"}


def test_truncation_is_counted(r, redis_server, tiny_model, tmp_path):
    data = _write(tmp_path / "long.jsonl", [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "word " * 300}]}, GOOD,
        {"id": "all-prompt", "messages": [{"role": "user", "content": "q " * 300}, {"role": "assistant", "content": "a"}]}])
    report = produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="trunc", dataset=data,
                                    max_length=64, overlong="truncate", max_reject_share=0.5))
    # The row cut to its prompt alone is rejected, and counted there only (it was counted truncated too: an
    # outside check, the tenth session)
    assert report.tokenise.truncated == 1 and report.tokenise.kept == 2
    assert report.tokenise.rejected == {"no_assistant_token_after_truncation": 1}
    assert max(spec.padded_len for spec in ledger.all_specs(r, "trunc").values()) <= 64


def test_zero_usable_rows_refuses_to_plan(r, redis_server, tiny_model, tmp_path):
    data = _write(tmp_path / "none.jsonl", ["", "{broken", {"messages": [{"role": "user", "content": "q"}]}])
    with pytest.raises(PlanError, match="no usable rows out of 3"):
        produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="none", dataset=data,
                               max_reject_share=1.0))
    assert ledger.get_manifest(r, "none") is None


def test_parquet_input(r, redis_server, tiny_model, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([{"id": f"p{i}", "messages": GOOD["messages"]} for i in range(5)])
    pq.write_table(table, tmp_path / "d.parquet")
    report = produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="pq",
                                    dataset=tmp_path / "d.parquet"))
    assert report.tokenise.kept == 5


def test_a_deeply_nested_row_is_rejected_and_the_good_rows_planned(r, redis_server, tiny_model, tmp_path):
    """100k nested '[' made json.loads raise RecursionError, which took produce down with no row planned."""
    deep = 100_000
    data = _write(tmp_path / "deep.jsonl", [GOOD, "[" * deep + "]" * deep, {"id": "x", **GOOD},
                                            '{"messages": ' + "[" * deep + "]" * deep + "}", {"id": "y", **GOOD}])
    report = produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="deep", dataset=data,
                                    max_reject_share=1.0))
    assert report.tokenise.rows == 5 and report.tokenise.kept == 3
    text = "\n".join(report.lines())
    for row in (2, 4):
        line = [x for x in text.splitlines() if x.strip().startswith(f"row {row}:")]
        assert len(line) == 1 and "nested too deeply" in line[0], text
    planned = {s for spec in planned_specs(r, "deep").values() for s in spec.sample_ids}
    assert planned == {"0", "x", "y"}
