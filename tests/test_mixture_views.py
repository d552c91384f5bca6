"""A mixture's sources in `hsx inspect` (rows, rejects, tokens, prefix share each), `hsx status` and the
dashboard's /api/status (rows, samples, tokens, batches planned and done each), with Redis holding nothing
more per sample or per batch than a one-dataset run."""

import json

from dashboard.app import create_app
from dashboard.config import DashboardConfig
from hsx.life import ledger
from hsx.monitor import source_progress
from hsx.store import open_store
from tests.pipeline import planned_specs
from tests.test_mixture import chat, produce_cli, write


def mixture_run(redis_url, model, tmp_path, run):
    a = write(tmp_path / "a.jsonl", [chat(i) for i in range(6)])
    b = write(tmp_path / "b.jsonl", [chat(i, "other") for i in range(3)] + ["{bad json"])
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"sources": [{"dataset": "a.jsonl"}, {"dataset": "b.jsonl"}]}))
    produce_cli(redis_url, model, tmp_path / "store", run, "--mixture", mix, "--max-reject-share", "0.5")
    return a, b, mix


def done(r, store, run, *bids):
    for bid in bids:
        spec = ledger.get_spec(r, run, bid)
        key = f"{run}/batches/{spec.shard}/{bid}.safetensors"
        info = store.put_bytes(key, b"0123456789")
        ledger.mark_done(r, run, spec, key, info.size, info.sha256, by="test")


def test_status_and_dashboard_count_each_source_planned_and_done(r, redis_server, tiny_model, tmp_path, capsys):
    mixture_run(redis_server.url, tiny_model, tmp_path, "mixv")
    specs = sorted(planned_specs(r, "mixv").values(), key=lambda s: s.index)
    of = {s.batch_id: s.sample_ids[0].split("/")[0] for s in specs}
    a_batches = [s for s in specs if of[s.batch_id] == "a"]
    b_batches = [s for s in specs if of[s.batch_id] == "b"]
    assert a_batches and b_batches
    before = source_progress(r, "mixv")
    assert [(s["source"], s["rows"], s["rejected"], s["samples"], s["done"]["batches"]) for s in before] == \
        [("a", 6, 0, 6, 0), ("b", 4, 1, 3, 0)]
    assert before[0]["tokens"] == sum(s.tokens for s in a_batches) and before[0]["batches"] == len(a_batches)
    assert [s["computed_tokens"] for s in before] == [sum(s.computed_tokens for s in a_batches),
                                                      sum(s.computed_tokens for s in b_batches)]
    # all of a's batches done, and b's first
    done(r, open_store(str(tmp_path / "store")), "mixv", *[s.batch_id for s in a_batches], b_batches[0].batch_id)
    after = {s["source"]: s["done"] for s in source_progress(r, "mixv")}
    assert after["a"] == {"batches": len(a_batches), "samples": 6, "tokens": before[0]["tokens"]}
    assert after["b"] == {"batches": 1, "samples": b_batches[0].samples, "tokens": b_batches[0].tokens}

    from hsx_cli import status

    assert status.run(status.StatusConfig(redis_server.url, "mixv", False, False, 1.0)) == 0
    out = capsys.readouterr().out
    assert "  sources  (done/planned)" in out
    assert f"    a: rows 6 read, 0 rejected; batches {len(a_batches)}/{len(a_batches)} (100.0%), samples 6/6 (100.0%)" in out
    assert "    b: rows 4 read, 1 rejected; batches 1/" in out
    assert f"; {before[0]['computed_tokens']:,} tokens computed for them" in out
    assert status.run(status.StatusConfig(redis_server.url, "mixv", True, False, 1.0)) == 0
    assert json.loads(capsys.readouterr().out)["sources"][1]["done"] == after["b"]

    from hsx_tools.watch import watch_plain

    assert watch_plain(r, "mixv", 0.01, max_iterations=1) == 0     # `hsx status --watch` into a log: the same lines
    assert f"    a: rows 6 read, 0 rejected; batches {len(a_batches)}/" in capsys.readouterr().out

    client = create_app(DashboardConfig(redis_url=redis_server.url), r=r).test_client()
    o = client.get("/api/status?run=mixv").json["overview"]
    assert [(s["source"], s["samples"], s["done"]) for s in o["sources"]] == \
        [("a", 6, after["a"]), ("b", 3, after["b"])]
    page = client.get("/?run=mixv").get_data(as_text=True)   # the first view, rendered on the server
    for name, samples in (("a", 6), ("b", 3)):
        row = page.split(f'<tr data-source="{name}">', 1)[1].split("</tr>", 1)[0]
        assert f"{after[name]['samples']} / {samples}" in row, row
        assert f"<td class=\"num\">{before[0 if name == 'a' else 1]['computed_tokens']:,}</td>" in row, row


def test_one_dataset_runs_show_no_sources(r, redis_server, tiny_model, tmp_path):
    a = write(tmp_path / "a.jsonl", [chat(i) for i in range(3)])
    produce_cli(redis_server.url, tiny_model, tmp_path / "store", "onev", "--dataset", a)
    assert source_progress(r, "onev") == []
    client = create_app(DashboardConfig(redis_url=redis_server.url), r=r).test_client()
    assert client.get("/api/status?run=onev").json["overview"]["sources"] == []
    assert 'id="sources-section" hidden' in client.get("/?run=onev").get_data(as_text=True)


def test_inspect_prints_each_source(tiny_model, tmp_path, capsys):
    from hsx_cli import inspect
    from hsx_cli.flags import resolve
    from hsx_cli.main import build_parser

    write(tmp_path / "a.jsonl", [{"messages": [{"role": "system", "content": "shared system prompt " * 8},
                                               *chat(i)["messages"]]} for i in range(5)])
    write(tmp_path / "b.jsonl", [chat(i, "other") for i in range(3)] + ["{bad json"])
    argv = ["inspect", "--dataset", str(tmp_path / "a.jsonl"), "--dataset", str(tmp_path / "b.jsonl"), "--model",
            str(tiny_model), "--layers", "dflash:3", "--samples", "1", "--tokenise-workers", "1", "--max-reject-share", "0.5",
            "--plain"]
    cfg = inspect.COMMAND.config(resolve(inspect.FLAGS, build_parser().parse_args(argv)))
    assert inspect.run(cfg) == 0
    out = capsys.readouterr().out
    assert "source a (a.jsonl): 5 rows read, 5 kept, 0 rejected (0.00%)" in out
    assert "source b (b.jsonl): 4 rows read, 3 kept, 1 rejected (25.00%): bad_json 1" in out
    lines = out.splitlines()
    a_share = lines[lines.index(next(x for x in lines if x.startswith("source a "))) + 2]
    assert a_share.startswith("  shared prefixes: ") and not a_share.startswith("  shared prefixes: 0.0%")
    assert "rows: 9 read, 8 kept" in out and "row 4 (id b/3): line 4 of b.jsonl is not valid JSON" in out


def test_inspect_per_turn_of_a_mixture_measures_every_source(tiny_model, tmp_path, capsys):
    """--per-turn over two sources: the whole rows it is measured against are both sources' rows (was: the first
    source's only), and the lines name the mixture, not its first file."""
    from hsx_cli import inspect
    from hsx_cli.flags import resolve
    from hsx_cli.main import build_parser

    write(tmp_path / "a.jsonl", [chat(i) for i in range(2)])
    write(tmp_path / "b.jsonl", [chat(i, "other") for i in range(3)])
    argv = ["inspect", "--dataset", str(tmp_path / "a.jsonl"), "--dataset", str(tmp_path / "b.jsonl"), "--model",
            str(tiny_model), "--layers", "dflash:3", "--samples", "0", "--tokenise-workers", "1", "--per-turn", "--plain"]
    assert inspect.run(inspect.COMMAND.config(resolve(inspect.FLAGS, build_parser().parse_args(argv)))) == 0
    out = capsys.readouterr().out
    assert out.startswith("mixture of a, b for ")
    assert "per-turn: 5 rows -> 5 samples" in out and "for the 5 whole rows" in out, out
    assert "shared prefixes (2 sources, one sample a turn" in out


def test_a_mixture_run_extracts_and_reads_back_both_sources_same_ids(r, redis_server, tiny_model, tmp_path):
    """Through a worker and an uploader (in process, CPU): the stored run holds a/x0 and b/x0, each its own rows'
    tokens, and the dashboard counts both sources done."""
    from hsx.prep import mixture_of_datasets
    from hsx_reader import RunDataset
    from tests.pipeline import run_pipeline

    a = write(tmp_path / "a.jsonl", [{"id": f"x{i}", **chat(i)} for i in range(3)])
    b = write(tmp_path / "b.jsonl", [{"id": f"x{i}", **chat(i, "something else entirely")} for i in range(2)])
    run_pipeline(redis_server.url, tiny_model, str(tmp_path / "store"), tmp_path / "spool", run="mixe",
                 mixture=mixture_of_datasets([a, b]), window_rows=4)
    from hsx_tools.verify import verify_run

    report = verify_run(r, open_store(str(tmp_path / "store")), "mixe")   # every object read: ids, digests, tokens
    assert report.ok and report.samples == 5, report.lines()
    ds = RunDataset(str(tmp_path / "store"), "mixe")
    assert sorted(ds.source.index.by_id) == ["a/x0", "a/x1", "a/x2", "b/x0", "b/x1"]
    assert len(ds.get("b/x0")["input_ids"]) > len(ds.get("a/x0")["input_ids"])   # b's rows are longer
    assert [(s["source"], s["done"]["samples"], s["samples"]) for s in source_progress(r, "mixe")] == \
        [("a", 3, 3), ("b", 2, 2)]


def test_each_source_s_done_counts_are_kept_as_batches_are_recorded_not_read_from_the_ledger(r, redis_server,
                                                                                               tiny_model, tmp_path):
    """hsx status / the dashboard at 10M samples: a source's done batches, samples and tokens are counters the
    done script moves (O(sources) to read), not a scan of the done ledger and the plan (O(run)). A run whose counts
    do not add up (batches an older hsx recorded) is counted from the ledger, as before."""
    mixture_run(redis_server.url, tiny_model, tmp_path, "mixc")
    specs = sorted(planned_specs(r, "mixc").values(), key=lambda s: s.index)
    assert {ledger.get_spec(r, "mixc", s.batch_id).source for s in specs} == {"a", "b"}   # the plan names it
    a_batches = [s for s in specs if s.sample_ids[0].startswith("a/")]
    b_first = next(s for s in specs if s.sample_ids[0].startswith("b/"))
    done(r, open_store(str(tmp_path / "store")), "mixc", *[s.batch_id for s in a_batches], b_first.batch_id)
    counted = {s["source"]: s["done"] for s in source_progress(r, "mixc")}
    assert counted == {"a": {"batches": len(a_batches), "samples": 6, "tokens": sum(s.tokens for s in a_batches)},
                       "b": {"batches": 1, "samples": b_first.samples, "tokens": b_first.tokens}}
    counters = ledger.done_counters(r, "mixc")
    assert counters["src:b:b"] == 1 and counters["src:a:s"] == 6

    # read without the ledger: its done records hidden, the counts stay (the scan would find none)
    chunks = [k for k in r.scan_iter("hsx:mixc:done:*")]
    assert chunks
    saved = {k: r.hgetall(k) for k in chunks}
    r.delete(*chunks)
    assert {s["source"]: s["done"] for s in source_progress(r, "mixc")} == counted
    for k, fields in saved.items():
        r.hset(k, mapping=fields)

    # a repair takes a batch out: its source's counts move back
    assert ledger.unmark_done(r, "mixc", ledger.get_spec(r, "mixc", b_first.batch_id))
    assert {s["source"]: s["done"] for s in source_progress(r, "mixc")}["b"] == {"batches": 0, "samples": 0,
                                                                                "tokens": 0}
    # counts that do not add up (an older hsx recorded a batch without them): the ledger is scanned instead
    r.hincrby("hsx:mixc:counters", "src:a:b", -1)
    assert {s["source"]: s["done"]["batches"] for s in source_progress(r, "mixc")} == {"a": len(a_batches), "b": 0}
