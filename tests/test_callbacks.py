"""Chief-only writing helpers (the multi-worker behaviour is exercised in test_multiworker)."""

import os

import tfdp
from tfdp.callbacks import is_chief, write_path
from helpers import cpu_devices


class _FakeStrategy:
    def __init__(self, cluster):
        self.cluster = cluster


def _cluster(rank):
    return tfdp.ClusterConfig.from_dict({"cluster": {"worker": ["a:1", "b:2"]},
                                         "task": {"type": "worker", "index": rank}})


def test_chief_writes_to_the_real_path_others_to_a_private_temp_path(tmp_path):
    target = str(tmp_path / "model.keras")
    assert is_chief(_FakeStrategy(_cluster(0))) and write_path(target, _FakeStrategy(_cluster(0))) == target
    other = write_path(target, _FakeStrategy(_cluster(1)))
    assert not is_chief(_FakeStrategy(_cluster(1)))
    assert other != target and os.path.basename(other) == "model.keras"
    assert "worker1" in other and not other.startswith(str(tmp_path))


def test_single_process_is_chief(tmp_path):
    s = tfdp.DataParallelStrategy(devices=cpu_devices(2))
    assert is_chief(s) and write_path(str(tmp_path / "x"), s) == str(tmp_path / "x")
    assert is_chief()  # default strategy: one process


def test_is_chief_answers_for_the_process_job_outside_any_scope(monkeypatch):
    # Before any strategy is built (or outside its scope) the job is the environment's.
    import json

    import tensorflow as tf

    from tfdp.callbacks import is_chief, write_path

    config = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
              "task": {"type": "worker", "index": 1}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    assert is_chief() is False
    assert write_path("/data/model.keras") != "/data/model.keras"
    config["task"]["index"] = 0
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    assert is_chief() is True and write_path("/data/model.keras") == "/data/model.keras"
    # Guard: asking the current (default) strategy, as before, says True on every worker.
    config["task"]["index"] = 1
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    assert is_chief(tf.distribute.get_strategy()) is True
    # A malformed environment is the strategy's to report; here it is one worker.
    monkeypatch.setenv("TF_CONFIG", "{not json")
    assert is_chief() is True
