"""Issue 29 item 9: a manifest of the right types but values no run can have (a hand edit, or anyone who can write
to Redis) is refused by every role in one line naming the field, exit 2.

Before: 5 of these ended in "unexpected error" (dtype int4, layer ids [99], [], 10^6 ids, a 10 MB model path) and
12 were accepted, the worker spooling batches with them (layer ids [-1, 2, 3] stored the last layer as id -1,
[2, 2, 3], hidden size 0 and -64, 0 layers, store dtype float8_e5m2, codec lz4, max attempts -1 and 0, a lease
of 10^12 s, token budget -1).
"""

from __future__ import annotations

import json

import pytest

from hsx.life.keys import RunKeys
from hsx.runspec.manifest import Manifest, ManifestError
from hsx_cli.main import main
from tests.manifests import example_manifest

RUN = "mv"
BIG = "/" + "m" * (10 * 2**20)  # a 10 MB path


def limits(**changes) -> dict:
    return {"limits": {"max_attempts": 3, "lease_seconds": 60, **changes}}


# case -> (fields planted over a good manifest, the field the one line must name)
CASES = {
    "dtype int4": ({"dtype": "int4", "store_dtype": "int4"}, "dtype"),
    "layer ids [99]": ({"layer_ids": [99]}, "layer_ids"),
    "layer ids []": ({"layer_ids": []}, "layer_ids"),
    "10^6 layer ids": ({"layer_ids": list(range(10**6))}, "layer_ids"),
    "a 10 MB model path": ({"model": BIG}, "model"),
    "layer ids [-1, 2, 3]": ({"layer_ids": [-1, 2, 3]}, "layer_ids"),
    "layer ids [2, 2, 3]": ({"layer_ids": [2, 2, 3]}, "layer_ids"),
    "layer ids falling": ({"layer_ids": [3, 2, 1]}, "layer_ids"),
    "more layer ids than layers": ({"layer_ids": [0, 1, 2, 3, 4], "num_layers": 4}, "layer_ids"),
    "hidden size 0": ({"hidden_size": 0}, "hidden_size"),
    "hidden size -64": ({"hidden_size": -64}, "hidden_size"),
    "hidden size 2^40": ({"hidden_size": 2**40}, "hidden_size"),
    "0 layers": ({"num_layers": 0}, "num_layers"),
    "10^9 layers": ({"num_layers": 10**9}, "num_layers"),
    "store dtype float8_e5m2": ({"store_dtype": "float8_e5m2"}, "store_dtype"),
    "store dtype another value dtype": ({"store_dtype": "float16"}, "store_dtype"),
    "codec lz4": ({"codec": "lz4"}, "codec"),
    "compute dtype int8": ({"compute_dtype": "int8"}, "compute_dtype"),
    "fp8 accumulation slow": ({"fp8_accumulation": "slow"}, "fp8_accumulation"),
    "overlong maybe": ({"overlong": "maybe"}, "overlong"),
    "max attempts -1": (limits(max_attempts=-1), "limits.max_attempts"),
    "max attempts 0": (limits(max_attempts=0), "limits.max_attempts"),
    "max attempts 10^9": (limits(max_attempts=10**9), "limits.max_attempts"),
    "lease 10^12 s": (limits(lease_seconds=10**12), "limits.lease_seconds"),
    "lease 0 s": (limits(lease_seconds=0), "limits.lease_seconds"),
    "token budget -1": ({"token_budget": -1}, "token_budget"),
    "token budget below max length": ({"token_budget": 100, "max_length": 512}, "token_budget"),
    "max length 0": ({"max_length": 0}, "max_length"),
    "pad multiple 0": ({"pad_multiple": 0}, "pad_multiple"),
    "max batch rows 0": ({"max_batch_rows": 0}, "max_batch_rows"),
    "batches per shard 0": ({"batches_per_shard": 0}, "batches_per_shard"),
    "window rows -5": ({"window_rows": -5}, "window_rows"),
    "pad token id -1": ({"pad_token_id": -1}, "pad_token_id"),
    "empty dataset path": ({"dataset": ""}, "dataset"),
    "a 10 MB store url": ({"store_url": BIG}, "store_url"),
    "config hash not a digest": ({"model_config_hash": "zz"}, "model_config_hash"),
    "run name with a slash": ({"run": "../mv"}, "run"),
    "incarnation not hex": ({"incarnation": "not-an-id"}, "incarnation"),
    "template kwargs of 1 MB": ({"template_kwargs": {"x": "y" * 2**20}}, "template_kwargs"),
}


def test_there_are_the_issues_36_cases_and_more():
    assert len(CASES) >= 36


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_value_is_refused_naming_its_field(case):
    changes, field = CASES[case]
    with pytest.raises(ManifestError) as caught:
        Manifest.from_dict({**example_manifest(RUN).to_dict(), **changes}, "where")
    message = str(caught.value)
    assert message.startswith(f"where: {field} "), message
    assert "\n" not in message and len(message) < 400, message[:500]


def test_every_case_stops_a_worker_in_one_line_exit_2(r, redis_env, tmp_path, capsys):
    """Through `hsx worker` as a user starts it: exit 2 and one line naming the field, before any job is taken."""
    good = example_manifest(RUN).to_dict()
    for case, (changes, field) in sorted(CASES.items()):
        r.set(RunKeys(RUN).manifest, json.dumps({**good, **changes}))
        code = main(["worker", "--run", RUN, "--device", "cpu", "--spool-dir", str(tmp_path / "spool")])
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("hsx worker: ")]
        assert code == 2, (case, err[-500:])
        assert len(lines) == 1 and f"Redis {RunKeys(RUN).manifest}: {field} " in lines[0], (case, err[-500:])
        assert "unexpected error" not in err and "Traceback" not in err, case


def test_the_values_hsx_writes_are_accepted():
    for m in (example_manifest(RUN), example_manifest(RUN, layer_ids=(0,), num_layers=1, window_rows=None,
                                                      store_dtype="float8_e4m3", codec="zstd", compute_dtype="float8")):
        assert Manifest.from_json(m.to_json()) == m
