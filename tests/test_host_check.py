"""Issue 33 item 3: a worker's start checks are one kernel call (hsx.runspec.check_host): the run's store
answers and holds the run, the model is visible, and it is the run's model (config hash, weights)."""

from __future__ import annotations

import pytest

from hsx.prep import weights_fingerprint
from hsx.runspec import ModelMismatch, RunNotVisible, check_host, config_hash
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
    store = check_host(run_of_tiny, str(tiny_model), "worker", "h1", weights_fingerprint)
    assert store.head("hc/manifest.json") is not None


def test_another_config_or_checkpoint_or_an_unseen_model_is_refused(run_of_tiny, tiny_model, tmp_path):
    other = run_of_tiny.__class__.from_dict({**run_of_tiny.to_dict(), "model_config_hash": "1" * 64})
    with pytest.raises(ModelMismatch, match="config hash differs"):
        check_host(other, str(tiny_model), "worker", "h1", weights_fingerprint)
    with pytest.raises(ModelMismatch, match="another checkpoint .* its weights are sampled-v1:x"):
        check_host(run_of_tiny, str(tiny_model), "worker", "h1", lambda model: "sampled-v1:x")
    assert check_host(run_of_tiny, str(tiny_model), "worker", "h1", lambda model: "")  # no weight files here
    with pytest.raises(RunNotVisible, match="cannot see the run's model"):
        check_host(run_of_tiny, str(tmp_path / "nowhere"), "worker", "h1", weights_fingerprint)
    unseen = run_of_tiny.__class__.from_dict({**run_of_tiny.to_dict(), "store_url": str(tmp_path / "empty"),
                                              "store": {"url": str(tmp_path / "empty")}})
    with pytest.raises(RunNotVisible, match="cannot see the run's store"):
        check_host(unseen, str(tiny_model), "worker", "h1", weights_fingerprint)
