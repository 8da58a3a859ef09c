"""ClusterConfig parsing: valid TF_CONFIGs, every malformed case, and fuzzing."""

import json

import pytest
from hypothesis import given, settings, strategies as st

from tfdp.cluster import ClusterConfig, ClusterConfigError


def cfg(cluster, task):
    return json.dumps({"cluster": cluster, "task": task})


def test_absent_tf_config_is_single_worker():
    c = ClusterConfig.from_env({})
    assert c.num_workers == 1 and c.is_chief and c.task_type == "worker" and c.task_index == 0
    assert ClusterConfig.from_env({"TF_CONFIG": "  "}) == c


def test_workers_only():
    c = ClusterConfig.from_json(cfg({"worker": ["a:1", "b:2", "c:3"]}, {"type": "worker", "index": 2}))
    assert c.workers == ["a:1", "b:2", "c:3"]
    assert (c.num_workers, c.task_type, c.task_index, c.rank, c.is_chief) == (3, "worker", 2, 2, False)
    assert ClusterConfig.from_json(c.to_json()) == c


def test_chief_is_rank_zero():
    cluster = {"chief": ["c:1"], "worker": ["w:1", "w:2"]}
    chief = ClusterConfig.from_json(cfg(cluster, {"type": "chief", "index": 0}))
    worker = ClusterConfig.from_json(cfg(cluster, {"type": "worker", "index": 0}))
    assert chief.workers == ["c:1", "w:1", "w:2"]
    assert chief.is_chief and chief.rank == 0
    assert not worker.is_chief and worker.rank == 1


@pytest.mark.parametrize("text,field", [
    ("{not json", "(whole value)"),
    ("[1, 2]", "(whole value)"),
    (json.dumps({"task": {"type": "worker", "index": 0}}), "cluster"),
    (json.dumps({"cluster": {"worker": ["a:1"]}}), "task"),
    (cfg({"worker": ["a:1"]}, {"type": "worker", "index": 1}), "task.index"),
    (cfg({"worker": ["a:1"]}, {"type": "worker", "index": -1}), "task.index"),
    (cfg({"worker": ["a:1"]}, {"type": "worker", "index": "x"}), "task.index"),
    (cfg({"worker": ["a:1", "a:1"]}, {"type": "worker", "index": 0}), "cluster"),
    (cfg({"worker": ["a:port"]}, {"type": "worker", "index": 0}), "cluster.worker[0]"),
    (cfg({"worker": ["a:99999"]}, {"type": "worker", "index": 0}), "cluster.worker[0]"),
    (cfg({"worker": ["nohostport"]}, {"type": "worker", "index": 0}), "cluster.worker[0]"),
    (cfg({"worker": []}, {"type": "worker", "index": 0}), "cluster.worker"),
    (cfg({"worker": "a:1"}, {"type": "worker", "index": 0}), "cluster.worker"),
    (cfg({"worker": ["a:1"], "ps": ["p:1"]}, {"type": "worker", "index": 0}), "cluster.ps"),
    (cfg({"worker": ["a:1"], "evaluator": ["e:1"]}, {"type": "worker", "index": 0}), "cluster.evaluator"),
    (cfg({"worker": ["a:1"]}, {"type": "evaluator", "index": 0}), "task.type"),
    (cfg({"worker": ["a:1"]}, {"type": "chief", "index": 0}), "task.type"),
    (cfg({"worker": ["a:1"], "chief": ["c:1", "d:1"]}, {"type": "worker", "index": 0}), "cluster.chief"),
])
def test_malformed_inputs_name_field_and_fix(text, field):
    with pytest.raises(ClusterConfigError) as info:
        ClusterConfig.from_json(text)
    message = str(info.value)
    assert f"TF_CONFIG {field}=" in message
    assert "Fix:" in message
    assert isinstance(info.value, ValueError)


def test_rejects_parameter_servers_with_the_reason():
    with pytest.raises(ClusterConfigError, match="synchronous all-reduce"):
        ClusterConfig.from_json(cfg({"worker": ["a:1"], "ps": ["p:1"]}, {"type": "worker", "index": 0}))


# --- fuzzing -----------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_fuzz_arbitrary_text_never_crashes_unexpectedly(text):
    try:
        ClusterConfig.from_json(text)
    except ClusterConfigError as e:
        assert "Fix:" in str(e)


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({}, optional={
    "cluster": st.dictionaries(st.sampled_from(["worker", "chief", "ps", "evaluator", "x"]),
                               st.lists(st.sampled_from(["a:1", "b:2", "c", "d:x", "", 3, "e:70000"]),
                                        max_size=4) | json_values, max_size=3),
    "task": st.fixed_dictionaries({}, optional={"type": st.sampled_from(["worker", "chief", "ps", 1]),
                                                "index": st.integers(-2, 5) | st.text(max_size=2)}) | json_values,
}))
def test_fuzz_structured_configs(config):
    try:
        c = ClusterConfig.from_dict(config)
    except ClusterConfigError as e:
        assert "Fix:" in str(e)
        return
    # Accepted configs are self-consistent.
    assert 0 <= c.rank < c.num_workers
    assert len(set(c.workers)) == len(c.workers)
    assert c.workers[c.rank] == c.cluster_spec[c.task_type][c.task_index]
    assert ClusterConfig.from_json(c.to_json()) == c
