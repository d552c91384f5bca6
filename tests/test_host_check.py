"""Issue 33 item 3: a worker's start checks are one kernel call (hsx.runspec.check_host): the run's store
answers and holds the run, the model is visible, and it is the run's model (config hash); once loaded, its
weights are the run's (issue 37 item 3: the manifest's fingerprint, or the first worker's record)."""

from __future__ import annotations

import pytest

from hsx.prep import UnknownScheme, weights_fingerprint
from hsx.runspec import ModelMismatch, RunNotVisible, check_host, check_weights, config_hash
from hsx.store import open_store
from tests.manifests import example_manifest


@pytest.fixture
def run_of_tiny(tiny_model, tmp_path):
    store = tmp_path / "store"
    manifest = example_manifest("hc", str(store), model=str(tiny_model), model_config_hash=config_hash(str(tiny_model)),
                                model_weights=weights_fingerprint(str(tiny_model)))
    manifest.save(open_store(str(store)))
    return manifest


def test_the_runs_own_model_gets_the_runs_store(run_of_tiny, tiny_model):
    store = check_host(run_of_tiny, str(tiny_model), "worker", "h1")
    assert store.head("hc/manifest.json") is not None


def test_another_config_or_checkpoint_or_an_unseen_model_is_refused(run_of_tiny, tiny_model, tmp_path):
    other = run_of_tiny.__class__.from_dict({**run_of_tiny.to_dict(), "model_config_hash": "1" * 64})
    with pytest.raises(ModelMismatch, match="config hash differs"):
        check_host(other, str(tiny_model), "worker", "h1")
    with pytest.raises(RunNotVisible, match="cannot see the run's model"):
        check_host(run_of_tiny, str(tmp_path / "nowhere"), "worker", "h1")
    unseen = run_of_tiny.__class__.from_dict({**run_of_tiny.to_dict(), "store_url": str(tmp_path / "empty"),
                                              "store": {"url": str(tmp_path / "empty")}})
    with pytest.raises(RunNotVisible, match="cannot see the run's store"):
        check_host(unseen, str(tiny_model), "worker", "h1")


def test_the_loaded_weights_are_checked_against_the_manifest_or_the_first_workers_record(run_of_tiny, tiny_model):
    ours = weights_fingerprint(str(tiny_model))
    offered: list[str] = []

    def record(held: str):
        def offer(fingerprint: str) -> dict:
            offered.append(fingerprint)
            return {"fingerprint": held, "model": "/first/model", "worker": "w1"}
        return offer

    assert check_weights(run_of_tiny, str(tiny_model), weights_fingerprint, record("unused")) == ours
    assert offered == []   # the manifest holds this hsx's scheme: no record needed
    with pytest.raises(ModelMismatch, match="another checkpoint .* its weights are blake3-v1:x, the run's"):
        check_weights(run_of_tiny, str(tiny_model), lambda model, scheme: "blake3-v1:x", record("unused"))
    assert check_weights(run_of_tiny, str(tiny_model), lambda model, scheme: "", record("unused")) == ""  # no files
    bare = run_of_tiny.__class__.from_dict({**run_of_tiny.to_dict(), "model_weights": ""})
    assert check_weights(bare, str(tiny_model), weights_fingerprint, record(ours)) == ours
    assert offered == [ours]
    with pytest.raises(ModelMismatch, match="first worker .w1. loaded them from /first/model are blake3-v1:y"):
        check_weights(bare, str(tiny_model), weights_fingerprint, record("blake3-v1:y"))
    newer = run_of_tiny.__class__.from_dict({**run_of_tiny.to_dict(), "model_weights": "blake9-v7:z"})
    with pytest.raises(UnknownScheme, match="blake9-v7.*cannot compute"):
        check_weights(newer, str(tiny_model), weights_fingerprint, record(ours))
