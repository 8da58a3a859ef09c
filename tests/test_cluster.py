"""Cluster discovery: TF_CONFIG (TFJob layouts), Vertex CLUSTER_SPEC, SageMaker, Slurm (pure
parts), cluster_resolver; malformed input and fuzzing; one real 2-process run per layout."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tfdp.cluster import slurm
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
    (cfg({"worker": ["a:1"]}, {"type": "evaluator", "index": 0}), "task.type"),
    (cfg({"worker": ["a:1"], "evaluator": ["e:1"]}, {"type": "evaluator", "index": 0}), "task.type"),
    (cfg({"worker": ["a:1"], "chief": ["c:1"], "master": ["m:1"]}, {"type": "worker", "index": 0}),
     "cluster.master"),
    (cfg({"worker": ["a:1"], "trainer": ["t:1"]}, {"type": "worker", "index": 0}), "cluster.trainer"),
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


# --- Kubernetes (Kubeflow TFJob) --------------------------------------------------------

TFJOB_CLUSTER = {"chief": ["train-chief-0.ns.svc:2222"],
                 "worker": ["train-worker-0.ns.svc:2222", "train-worker-1.ns.svc:2222"],
                 "evaluator": ["train-evaluator-0.ns.svc:2222"]}


def tfjob(task_type, index, cluster=TFJOB_CLUSTER):
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index},
                       "environment": "cloud"})


def test_tfjob_chief_and_workers_form_the_ring_without_the_evaluator():
    chief = ClusterConfig.from_env({"TF_CONFIG": tfjob("chief", 0)})
    worker = ClusterConfig.from_env({"TF_CONFIG": tfjob("worker", 1)})
    ring = ["train-chief-0.ns.svc:2222", "train-worker-0.ns.svc:2222", "train-worker-1.ns.svc:2222"]
    assert chief.workers == worker.workers == ring
    assert (chief.rank, worker.rank, worker.num_workers) == (0, 2, 3)
    assert "evaluator" not in worker.cluster_spec  # TensorFlow never waits for it
    assert chief.source == "TF_CONFIG"
    assert any("evaluator (1 task(s)) is not part of training" in n for n in worker.notes)


def test_tfjob_master_from_older_operators_is_the_chief():
    cluster = {"master": ["m:2222"], "worker": ["w0:2222", "w1:2222"]}
    master = ClusterConfig.from_json(tfjob("master", 0, cluster))
    worker = ClusterConfig.from_json(tfjob("worker", 0, cluster))
    assert master.task_type == "chief" and master.rank == 0 and master.is_chief
    assert worker.rank == 1 and worker.workers == ["m:2222", "w0:2222", "w1:2222"]
    assert master.to_dict()["cluster"] == {"chief": ["m:2222"], "worker": ["w0:2222", "w1:2222"]}
    assert "master is the chief" in master.notes


def test_the_evaluator_task_is_told_what_to_do_instead():
    with pytest.raises(ClusterConfigError) as info:
        ClusterConfig.from_env({"TF_CONFIG": tfjob("evaluator", 0)})
    message = str(info.value)
    assert "TF_CONFIG task.type='evaluator'" in message
    assert "not part of tfdp's synchronous training ring" in message
    assert "checkpoints_iterator" in message and "validation_data" in message


def test_parameter_servers_are_refused_with_the_reason_and_the_fix():
    # SageMaker's parameter_server mode writes master + ps + worker.
    config = {"cluster": {"master": ["algo-1:2222"], "ps": ["algo-1:2223", "algo-2:2223"],
                          "worker": ["algo-2:2222"]}, "environment": "cloud",
              "task": {"type": "master", "index": 0}}
    with pytest.raises(ClusterConfigError) as info:
        ClusterConfig.from_dict(config)
    message = str(info.value)
    assert "TF_CONFIG cluster.ps=" in message and "ParameterServerStrategy" in message
    assert "multi_worker_mirrored_strategy" in message and "no PS replicas" in message


# --- Vertex AI --------------------------------------------------------------------------

def vertex(task_type, index, pools=None):
    pools = pools or {"workerpool0": ["cmle-training-workerpool0-ab-0:2222"],
                      "workerpool1": ["cmle-training-workerpool1-ab-0:2222",
                                      "cmle-training-workerpool1-ab-1:2222"]}
    return json.dumps({"cluster": pools, "environment": "cloud",
                       "task": {"type": task_type, "index": index, "trial": ""},
                       "job": {"worker_pool_specs": []}})


def test_vertex_primary_replica_is_the_chief_and_workerpool1_the_workers():
    primary = ClusterConfig.from_env({"CLUSTER_SPEC": vertex("workerpool0", 0)})
    second = ClusterConfig.from_env({"CLUSTER_SPEC": vertex("workerpool1", 1)})
    assert primary.source == second.source == "CLUSTER_SPEC"
    assert primary.is_chief and primary.task_type == "chief"
    assert second.rank == 2 and second.task_type == "worker" and second.task_index == 1
    assert second.workers == ["cmle-training-workerpool0-ab-0:2222",
                              "cmle-training-workerpool1-ab-0:2222",
                              "cmle-training-workerpool1-ab-1:2222"]
    # A one-replica job (only workerpool0) is a single worker.
    alone = ClusterConfig.from_env({"CLUSTER_SPEC": vertex(
        "workerpool0", 0, {"workerpool0": ["cmle-training-workerpool0-ab-0:2222"]})})
    assert alone.num_workers == 1 and not alone.is_multi_worker


def test_vertex_reduction_server_pool_is_refused_and_evaluator_pool_left_out():
    pools = {"workerpool0": ["p:2222"], "workerpool1": ["w:2222"], "workerpool2": ["r:2222"]}
    with pytest.raises(ClusterConfigError) as info:
        ClusterConfig.from_json(vertex("workerpool1", 0, pools), origin="CLUSTER_SPEC")
    assert "CLUSTER_SPEC cluster.workerpool2=" in str(info.value)
    assert "Reduction Server" in str(info.value) and "workerPoolSpecs[2]" in str(info.value)
    pools = {"workerpool0": ["p:2222"], "workerpool1": ["w:2222"], "workerpool3": ["e:2222"]}
    worker = ClusterConfig.from_json(vertex("workerpool1", 0, pools), origin="CLUSTER_SPEC")
    assert worker.workers == ["p:2222", "w:2222"]
    with pytest.raises(ClusterConfigError, match="CLUSTER_SPEC task.type='workerpool3'.*evaluator"):
        ClusterConfig.from_json(vertex("workerpool3", 0, pools), origin="CLUSTER_SPEC")
    with pytest.raises(ClusterConfigError, match="cluster.workerpool0.*only one chief"):
        ClusterConfig.from_json(vertex("workerpool0", 0, {"workerpool0": ["a:1", "b:1"]}),
                                origin="CLUSTER_SPEC")


# --- SageMaker --------------------------------------------------------------------------

def test_sagemaker_hosts_are_all_workers_in_sm_hosts_order():
    env = {"SM_HOSTS": '["algo-1", "algo-2", "algo-3"]', "SM_CURRENT_HOST": "algo-2"}
    c = ClusterConfig.from_env(env)
    assert c.source == "SM_HOSTS" and c.rank == 1 and c.task_type == "worker"
    assert c.workers == ["algo-1:20000", "algo-2:20001", "algo-3:20002"]
    c = ClusterConfig.from_env(dict(env, TFDP_PORT_BASE="8890"))
    assert c.workers[0] == "algo-1:8890"
    # SageMaker's multi_worker_mirrored_strategy mode sets TF_CONFIG too: it wins.
    tf_config = {"cluster": {"worker": ["algo-1:8890", "algo-2:8890"]}, "environment": "cloud",
                 "task": {"index": 1, "type": "worker"}}
    c = ClusterConfig.from_env(dict(env, TF_CONFIG=json.dumps(tf_config)))
    assert c.source == "TF_CONFIG" and c.workers == ["algo-1:8890", "algo-2:8890"] and c.rank == 1


@pytest.mark.parametrize("env,field", [
    ({"SM_HOSTS": "algo-1", "SM_CURRENT_HOST": "algo-1"}, "SM_HOSTS (whole value)"),
    ({"SM_HOSTS": "[]", "SM_CURRENT_HOST": "algo-1"}, "SM_HOSTS (whole value)"),
    ({"SM_HOSTS": '["a", "a"]', "SM_CURRENT_HOST": "a"}, "SM_HOSTS (whole value)"),
    ({"SM_HOSTS": '["a", "b"]', "SM_CURRENT_HOST": "c"}, "SM_CURRENT_HOST (whole value)"),
    ({"SM_HOSTS": '["a", "b"]', "SM_CURRENT_HOST": "a", "TFDP_PORT_BASE": "80"}, "TFDP_PORT_BASE"),
])
def test_malformed_sagemaker_environment_names_the_variable(env, field):
    with pytest.raises(ClusterConfigError, match="Fix:") as info:
        ClusterConfig.from_env(env)
    assert str(info.value).startswith(field)


# --- sources, precedence, the log line ---------------------------------------------------

SLURM_2x1 = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1",
             "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "node[9-10]",
             "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "1", "SLURM_LOCALID": "0",
             "SLURMD_NODENAME": "node10"}


def test_the_first_source_present_wins():
    tf_config = cfg({"worker": ["a:1", "b:1"]}, {"type": "worker", "index": 0})
    sm = {"SM_HOSTS": '["x", "y"]', "SM_CURRENT_HOST": "y"}
    spec = vertex("workerpool1", 0)
    assert ClusterConfig.from_env(dict(SLURM_2x1, **sm, CLUSTER_SPEC=spec,
                                       TF_CONFIG=tf_config)).source == "TF_CONFIG"
    assert ClusterConfig.from_env(dict(SLURM_2x1, **sm, CLUSTER_SPEC=spec)).source == "CLUSTER_SPEC"
    assert ClusterConfig.from_env(dict(SLURM_2x1, **sm)).source == "SM_HOSTS"
    assert ClusterConfig.from_env(SLURM_2x1).source == "Slurm"
    assert ClusterConfig.from_env({}).source == "single"


def test_describe_names_source_place_and_notes():
    line = ClusterConfig.from_env({"TF_CONFIG": tfjob("worker", 0)}).describe()
    assert line.startswith("cluster from TF_CONFIG: rank 1 of 3 worker(s) (worker 0 at "
                           "train-worker-0.ns.svc:2222)")
    assert "evaluator (1 task(s)) is not part of training" in line
    assert ClusterConfig.from_env(SLURM_2x1).describe() == (
        f"cluster from Slurm: rank 1 of 2 worker(s) (worker 1 at node10:{20000 + 32 * 7 + 1}); "
        "Slurm job 7 step 0")
    assert ClusterConfig.from_env({}).describe() == "cluster from single: rank 0 of 1 worker(s)"


# --- cluster_resolver -------------------------------------------------------------------

def test_resolver_spec_converts_like_tf_config():
    c = ClusterConfig.from_resolver_spec({"chief": ["c:1"], "worker": {0: "w:1", 1: "v:1"}},
                                         "worker", 1)
    assert c.source == "cluster_resolver" and c.workers == ["c:1", "w:1", "v:1"] and c.rank == 2
    single = ClusterConfig.from_resolver_spec({}, None, None)
    assert single.num_workers == 1 and single.source == "cluster_resolver"


@pytest.mark.parametrize("spec,task_type,task_id,match", [
    ({"worker": {0: "a:1", 2: "b:1"}}, "worker", 0, "cluster_resolver cluster.worker=.*0..n-1"),
    ({"worker": ["a:1"], "ps": ["p:1"]}, "worker", 0, "cluster_resolver cluster.ps=.*Parameter"),
    ({"worker": ["a:1"]}, "ps", 0, "cluster_resolver task.type='ps'"),
    ({"worker": ["a:1"]}, None, None, "cluster_resolver task.type=None.*no task type"),
    ({"trainer": ["a:1"]}, "trainer", 0, "cluster_resolver cluster.trainer=.*unknown task type"),
    ({"worker": ["a:1"]}, "worker", 3, "cluster_resolver task.index=3.*out of range"),
])
def test_unsupported_resolver_layouts_are_clear_errors(spec, task_type, task_id, match):
    with pytest.raises(ClusterConfigError, match=match):
        ClusterConfig.from_resolver_spec(spec, task_type, task_id)


class OwnResolver:
    """A user's resolver, duck typed: no TensorFlow base class."""

    task_type, task_id = "worker", 0

    def cluster_spec(self):
        return {"worker": ["h0:2222", "h1:2222"]}


def test_a_users_own_resolver_and_tensorflows_slurm_resolver_convert(monkeypatch):
    c = ClusterConfig.from_resolver(OwnResolver())
    assert c.workers == ["h0:2222", "h1:2222"] and c.rank == 0
    with pytest.raises(TypeError, match="has no 'cluster_spec'"):
        ClusterConfig.from_resolver(object())
    import tensorflow as tf
    for k, v in SLURM_2x1.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the resolver rewrites it
    resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(gpus_per_node=1,
                                                                   gpus_per_task=1)
    converted = ClusterConfig.from_resolver(resolver)
    # The resolver's own choices carry over: its sorted hosts and its ports.
    assert converted.workers == [w for w in resolver.cluster_spec().as_dict()["worker"]]
    assert converted.rank == resolver.task_id == 1


def test_strategy_takes_a_cluster_resolver():
    import tensorflow as tf
    import keras
    import tfdp
    from helpers import classification_data, initial_weights, mlp, train, assert_weights_close
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": ["localhost:2222"]}), task_type="worker", task_id=0)
    strategy = tfdp.DataParallelStrategy(devices=["/device:CPU:0", "/device:CPU:1"],
                                         cluster_resolver=resolver)
    assert strategy.cluster.source == "cluster_resolver" and strategy.cluster.num_workers == 1
    x, y = classification_data(n=64)
    w0 = initial_weights(mlp)
    def opt():
        return keras.optimizers.SGD(0.1)
    got, _ = train(strategy, mlp, opt, x, y, 16, epochs=1, weights=w0)
    want, _ = train(None, mlp, opt, x, y, 16, epochs=1, weights=w0)
    assert_weights_close(got.get_weights(), want.get_weights())
    with pytest.raises(ValueError, match="cluster= and cluster_resolver= were both given"):
        tfdp.DataParallelStrategy(cluster=tfdp.ClusterConfig(), cluster_resolver=resolver)
    ps = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": ["a:1"], "ps": ["p:1"]}), task_type="worker", task_id=0)
    with pytest.raises(ClusterConfigError, match="ParameterServerStrategy"):
        tfdp.DataParallelStrategy(cluster_resolver=ps)


# --- the package: no import circle, no TensorFlow --------------------------------------

CLUSTER_DIR = os.path.dirname(slurm.__file__)
CLUSTER_MODULES = sorted(f"tfdp.cluster.{name[:-3]}".replace(".__init__", "")
                         for name in os.listdir(CLUSTER_DIR) if name.endswith(".py"))
# tfdp/__init__.py imports tfdp.cluster, so a plain import loads the package before the module;
# with the parent packages stubbed (their __path__ only), the module named really loads first,
# and a module importing one that imports it back fails on the half-initialized name.
STUB_PARENTS = (
    "import importlib.util, os, sys, types\n"
    "root = os.path.dirname(importlib.util.find_spec('tfdp').origin)\n"
    "for name, path in {parents}:\n"
    "    sys.modules[name] = types.ModuleType(name)\n"
    "    sys.modules[name].__path__ = [path]\n")


@pytest.mark.parametrize("module", CLUSTER_MODULES)
def test_each_cluster_module_imports_first_without_tensorflow(module):
    assert len(CLUSTER_MODULES) >= 9, CLUSTER_MODULES
    parents = "(('tfdp', root),)" if module == "tfdp.cluster" else \
        "(('tfdp', root), ('tfdp.cluster', os.path.join(root, 'cluster')))"
    check = (f"import {module}\nimport sys\n"
             "assert 'tensorflow' not in sys.modules, sorted(sys.modules)\n")
    for prelude in ("", STUB_PARENTS.format(parents=parents)):
        subprocess.run([sys.executable, "-c", prelude + check], timeout=60, check=True)


# --- Slurm (pure: the real Slurm runs are in test_slurm.py) ------------------------------

@pytest.mark.parametrize("text,hosts", [
    ("n[1-2]", ["n1", "n2"]),
    ("node[9-10]", ["node9", "node10"]),  # list order, not sorted ("node10" < "node9")
    ("a[01-03,7],b5", ["a01", "a02", "a03", "a7", "b5"]),
    ("a[08-11]", ["a08", "a09", "a10", "a11"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("x[1-2],y,gpu-[3-4]-ib", ["x1", "x2", "y", "gpu-3-ib", "gpu-4-ib"]),
    ("host.example.org", ["host.example.org"]),
])
def test_hostlist_expands_in_slurm_order_with_padding(text, hosts):
    assert slurm.expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["", "n[1-2", "n1-2]", "n[2-1]", "n[1-x]", "n[]", "a,,b", "n[[1]]"])
def test_malformed_hostlist_names_the_variable(text):
    with pytest.raises(ClusterConfigError, match=r"^Slurm SLURM_JOB_NODELIST=.*Fix:"):
        slurm.expand_hostlist(text, "SLURM_JOB_NODELIST")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["n", "gpu-", "a1b", ""]),
                          st.lists(st.tuples(st.integers(0, 120), st.integers(0, 3),
                                             st.integers(1, 3)), min_size=1, max_size=3)),
                min_size=1, max_size=3))
def test_fuzz_hostlist_round_trip(groups):
    """Builds a compressed list and the names it stands for; expansion must give the names."""
    parts, expected = [], []
    for prefix, ranges in groups:
        if not prefix and len(ranges) == 1 and ranges[0][1] == 0:
            prefix = "h"  # a bare number is a host name too, but keep names readable
        specs = []
        for lo, length, width in ranges:
            hi = lo + length
            specs.append(f"{lo:0{width}d}" + (f"-{hi:0{width}d}" if length else ""))
            expected.extend(f"{prefix}{n:0{width}d}" for n in range(lo, hi + 1))
        parts.append(f"{prefix}[{','.join(specs)}]")
    assert slurm.expand_hostlist(",".join(parts)) == expected


def test_broken_hostlists_raise_cluster_config_errors():
    for text in ["[", "]", "a[1-", "a[-1]", "a[1--2]", "a[1,]", ",", "a[1]b[", "a]b["]:
        with pytest.raises(ClusterConfigError):
            slurm.expand_hostlist(text)


def test_tasks_per_node_and_task_layouts():
    assert slurm.parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm.parse_tasks_per_node("4") == [4]
    for bad in ["", "2(x0)", "0", "2(3)", "x"]:
        with pytest.raises(ClusterConfigError, match="SLURM_STEP_TASKS_PER_NODE"):
            slurm.parse_tasks_per_node(bad)
    assert slurm.task_layout([2, 1]) == [(0, 0), (0, 1), (1, 0)]
    assert slurm.task_layout([2, 1], "cyclic") == [(0, 0), (1, 0), (0, 1)]
    assert slurm.task_layout([3, 2], "plane", 2) == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2)]
    with pytest.raises(ClusterConfigError, match="SLURM_DISTRIBUTION='arbitrary'"):
        slurm.task_layout([1, 1], "arbitrary")


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(1, 40), min_size=1, max_size=6),
       method=st.sampled_from(["block", "cyclic", "plane"]), plane=st.integers(1, 5),
       job=st.integers(1, 10**7), step=st.integers(0, 50))
def test_ports_never_collide_on_a_host(counts, method, plane, job, step):
    layout = slurm.task_layout(counts, method, plane)
    assert sorted(layout) == [(n, local) for n, c in enumerate(counts) for local in range(c)]
    if max(counts) > slurm.PORTS_PER_STEP and sum(counts) > slurm.PORTS_PER_STEP:
        with pytest.raises(ClusterConfigError, match="more than 32 tasks of one step on a node"):
            slurm.worker_ports(layout, job, step, {})
        return
    ports = slurm.worker_ports(layout, job, step, {})
    assert all(20000 <= p < 32768 for p in ports)  # below Linux's ephemeral range
    assert len(set(zip([n for n, _ in layout], ports))) == len(ports)  # distinct per node
    if len(ports) <= slurm.PORTS_PER_STEP:
        assert len(set(ports)) == len(ports)  # distinct even where nodes share one host
    # Another step of the same job, and the next job, never take these ports.
    for other_job, other_step in ((job, step + 1), (job, step + 396), (job + 1, step)):
        other = slurm.worker_ports(layout, other_job, other_step, {})
        assert not set(ports) & set(other)


def test_port_base_override_and_the_documented_collision():
    layout = slurm.task_layout([1, 1])
    assert slurm.worker_ports(layout, 7, 0, {"TFDP_PORT_BASE": "31000"}) == [31000, 31001]
    # The one collision the docstring owns up to: job ids 397 apart, same step.
    assert slurm.worker_ports(layout, 7, 0, {}) == slurm.worker_ports(layout, 7 + 397, 0, {})
    for bad in ["abc", "80", "65530"]:
        with pytest.raises(ClusterConfigError, match="TFDP_PORT_BASE"):
            slurm.worker_ports(layout, 7, 0, {"TFDP_PORT_BASE": bad})


@pytest.mark.parametrize("visible,step_gpus,tasks,local,expected", [
    (None, None, 4, 1, None),              # no GPUs
    ("0,1,2,3", "0,1,2,3", 1, 0, None),    # one task per node: all it sees
    ("0", "4,5,6,7", 4, 2, None),          # --gpus-per-task=1: Slurm bound one per task
    ("0,1", "4,5,6,7", 2, 1, None),        # --gpu-bind: a share each
    ("0,1,2,3", "4,5,6,7", 4, 2, (2,)),    # all tasks see the node's 4: task 2 takes the third
    ("GPU-a,GPU-b,GPU-c,GPU-d", "0,1,2,3", 2, 1, (2, 3)),  # UUIDs: positions, not ids
    ("0,1,2,3", None, 4, 2, None),         # nothing proves they are shared: all it sees
    ("NoDevFiles", "0", 2, 0, None),
])
def test_task_gpus_uses_what_slurm_made_visible(visible, step_gpus, tasks, local, expected):
    assert slurm.task_gpus(visible, step_gpus, tasks, local) == expected


def test_gpus_that_do_not_split_evenly_are_an_error():
    with pytest.raises(ClusterConfigError, match="SLURM_STEP_GPUS.*3 tasks.*same 4 GPU"):
        slurm.task_gpus("0,1,2,3", "0,1,2,3", 3, 0)
    with pytest.raises(ClusterConfigError, match="cannot share a GPU"):
        slurm.task_gpus("0,1", "0,1", 4, 0)


def test_slurm_step_gives_every_task_its_place_and_gpus():
    env = dict(SLURM_2x1, SLURM_STEP_NODELIST="g[01-02]", SLURMD_NODENAME="g01",
               SLURM_STEP_TASKS_PER_NODE="2(x2)", SLURM_STEP_NUM_TASKS="4", SLURM_PROCID="1",
               SLURM_NODEID="0", SLURM_LOCALID="1", CUDA_VISIBLE_DEVICES="0,1,2,3",
               SLURM_STEP_GPUS="0,1,2,3")
    c = ClusterConfig.from_env(env)
    assert [w.split(":")[0] for w in c.workers] == ["g01", "g01", "g02", "g02"]
    assert (c.rank, c.task_type, c.task_gpus) == (1, "worker", (2, 3))
    assert "GPUs at positions [2, 3]" in c.describe()


@pytest.mark.parametrize("change,variable", [
    ({"SLURM_STEP_NODELIST": "n[1-"}, "SLURM_STEP_NODELIST"),
    ({"SLURM_STEP_TASKS_PER_NODE": "1(x3)"}, "SLURM_STEP_TASKS_PER_NODE"),  # 3 counts, 2 nodes
    ({"SLURM_STEP_TASKS_PER_NODE": "2,1"}, "SLURM_STEP_TASKS_PER_NODE"),  # 3 tasks, not 2
    ({"SLURM_PROCID": "x"}, "SLURM_PROCID"),
    ({"SLURM_PROCID": "2"}, "SLURM_PROCID"),
    ({"SLURM_JOB_ID": None}, "SLURM_JOB_ID"),
    ({"SLURM_STEP_NUM_TASKS": "two"}, "SLURM_STEP_NUM_TASKS"),
    ({"SLURMD_NODENAME": "node9"}, "SLURM_DISTRIBUTION"),  # Slurm placed it elsewhere
    ({"SLURM_DISTRIBUTION": "arbitrary"}, "SLURM_DISTRIBUTION"),
])
def test_malformed_slurm_environment_names_the_variable(change, variable):
    env = {k: v for k, v in dict(SLURM_2x1, **change).items() if v is not None}
    with pytest.raises(ClusterConfigError, match="Fix:") as info:
        ClusterConfig.from_env(env)
    assert str(info.value).startswith(f"Slurm {variable}=")


def test_one_task_steps_batch_scripts_and_no_slurm_stay_single_worker():
    one = dict(SLURM_2x1, SLURM_STEP_NUM_TASKS="1", SLURM_PROCID="0")
    assert ClusterConfig.from_env(one) == ClusterConfig.single_worker()
    batch = {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "4", "SLURM_PROCID": "0",
             "SLURM_JOB_NODELIST": "n[1-2]"}
    c = ClusterConfig.from_env(batch)
    assert c.num_workers == 1 and c.source == "single"
    assert "not an srun task" in c.notes[0] and "srun python" in c.notes[0]
    assert ClusterConfig.from_env({"SLURM_JOB_ID": "9", "SLURM_NTASKS": "1"}).notes == ()


# --- exit codes for schedulers ----------------------------------------------------------

def test_eviction_exit_code_is_configurable_for_exit_code_restart_policies():
    from tfdp import protocol
    assert protocol.restart_requested_exit_code({}) == protocol.EXIT_RESTART_REQUESTED == 75
    assert protocol.restart_requested_exit_code({"TFDP_EVICT_EXIT_CODE": "200"}) == 200
    for bad in ["0", "256", "x", "-1"]:
        with pytest.raises(ValueError, match="TFDP_EVICT_EXIT_CODE"):
            protocol.restart_requested_exit_code({"TFDP_EVICT_EXIT_CODE": bad})


# --- one real 2-process run per scheduler layout (processes on 127.0.0.1) ----------------

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "cluster_train.py")
RUN_TIMEOUT = 240


def free_ports(n, consecutive=False):
    """n free ports on 127.0.0.1 (consecutive ones for SM_HOSTS' base + rank)."""
    while True:
        socks = []
        try:
            first = socket.socket()
            first.bind(("127.0.0.1", 0))
            socks.append(first)
            for i in range(1, n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", first.getsockname()[1] + i if consecutive else 0))
            return [s.getsockname()[1] for s in socks]
        except OSError:
            continue  # a consecutive port was taken: try another base
        finally:
            for s in socks:
                s.close()


def run_two(tmp_path, layouts):
    """Starts one worker per environment in ``layouts``; returns their outputs."""
    procs = []
    for layout in layouts:
        env = {k: v for k, v in os.environ.items()
               if k not in ("TF_CONFIG", "CLUSTER_SPEC", "SM_HOSTS") and not k.startswith("SLURM")}
        env.update(layout, TFDP_TEST_OUT=str(tmp_path), TFDP_TEST_EPOCHS="1",
                   TF_CPP_MIN_LOG_LEVEL="2", TFDP_CPU_REPLICAS="1")
        procs.append(subprocess.Popen([sys.executable, WORKER], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=RUN_TIMEOUT)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()  # only the processes this test started, by their handle
                proc.wait()
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, "\n".join(outputs)
    return outputs


def assert_trained_like_one_device(tmp_path, ranks=(0, 1)):
    import keras
    from helpers import classification_data, initial_weights, mlp, train, assert_weights_close
    x, y = classification_data(n=256)
    model, _ = train(None, mlp, lambda: keras.optimizers.Adam(0.01), x, y, 32, epochs=1,
                     weights=initial_weights(mlp))
    for rank in ranks:
        saved = np.load(tmp_path / f"weights-{rank}.npz")
        assert_weights_close([saved[f"arr_{i}"] for i in range(len(saved.files))],
                             model.get_weights())


@pytest.mark.slow
@pytest.mark.multiworker
def test_tfjob_chief_and_worker_train_with_an_evaluator_entry(tmp_path):
    chief, worker, evaluator = (f"127.0.0.1:{p}" for p in free_ports(3))
    cluster = {"chief": [chief], "worker": [worker], "evaluator": [evaluator]}  # never started
    outputs = run_two(tmp_path, [{"TF_CONFIG": tfjob(t, 0, cluster)} for t in ("chief", "worker")])
    assert "rank 0: source=TF_CONFIG workers=2" in outputs[0], outputs[0]
    assert "rank 1: source=TF_CONFIG workers=2" in outputs[1], outputs[1]
    assert_trained_like_one_device(tmp_path)


@pytest.mark.slow
@pytest.mark.multiworker
def test_vertex_cluster_spec_trains(tmp_path):
    pools = {"workerpool0": [f"127.0.0.1:{free_ports(1)[0]}"],
             "workerpool1": [f"127.0.0.1:{free_ports(1)[0]}"]}
    outputs = run_two(tmp_path, [{"CLUSTER_SPEC": vertex(t, 0, pools)}
                                 for t in ("workerpool0", "workerpool1")])
    assert "rank 0: source=CLUSTER_SPEC workers=2" in outputs[0], outputs[0]
    assert "rank 1: source=CLUSTER_SPEC workers=2" in outputs[1], outputs[1]
    assert_trained_like_one_device(tmp_path)


@pytest.mark.slow
@pytest.mark.multiworker
def test_sagemaker_hosts_train(tmp_path):
    base = free_ports(2, consecutive=True)[0]
    hosts = ["127.0.0.1", "localhost"]  # two names for this machine, as algo-1, algo-2
    outputs = run_two(tmp_path, [{"SM_HOSTS": json.dumps(hosts), "SM_CURRENT_HOST": h,
                                  "TFDP_PORT_BASE": str(base)} for h in hosts])
    assert f"rank 0: source=SM_HOSTS workers=2 replicas=2 address=127.0.0.1:{base}" in outputs[0]
    assert f"rank 1: source=SM_HOSTS workers=2 replicas=2 address=localhost:{base + 1}" in outputs[1]
    assert_trained_like_one_device(tmp_path)


# --- several workers on one host: which GPUs each takes (tfdp.cluster.gpus) ------------------

def test_workers_of_one_host_split_its_gpus_when_nobody_chose():
    from tfdp.cluster import gpus
    workers = ["a:1", "a:2", "b:1", "a:3"]
    assert [gpus.local_position(workers, r) for r in range(4)] == [(0, 3), (1, 3), (0, 1), (2, 3)]
    assert [gpus.shared_host_gpus(workers, r, 3, {}) for r in range(4)] == [(0,), (1,), None, (2,)]
    assert [gpus.shared_host_gpus(["h:1", "h:2"], r, 8, {}) for r in range(2)] == [
        (0, 1, 2, 3), (4, 5, 6, 7)]
    assert [gpus.shared_host_gpus(["h:1", "h:2"], r, 1, {}) for r in range(2)] == [(0,), (0,)]
    # Whoever set CUDA_VISIBLE_DEVICES chose already; no GPU or one worker: nothing to split.
    assert gpus.shared_host_gpus(["h:1", "h:2"], 1, 2, {"CUDA_VISIBLE_DEVICES": "1"}) is None
    assert gpus.shared_host_gpus(["h:1", "h:2"], 1, 0, {}) is None
    assert gpus.shared_host_gpus(["h:1"], 0, 4, {}) is None
    # IPv6 and bracketed hosts are one host each.
    assert gpus.local_position(["[::1]:1", "[::1]:2"], 1) == (1, 2)


def test_one_rule_for_a_workers_host():
    # Local ranks (Horovod's environment, tfdp-run --verbose) and GPU splits use one rule:
    # before, GPU splits took a bare host for "" and Horovod's ranks kept IPv6 brackets.
    from tfdp.cluster import gpus, placement
    from tfdp.launcher import horovodrun
    assert [placement.host_of(a) for a in ("a:1", "a", "[::1]:7", "[::1]", "10.0.0.1:9")] == [
        "a", "a", "::1", "::1", "10.0.0.1"]
    mixed = ["a", "a:2", "[::1]:1", "[::1]", "b:1"]
    want = [(0, 2), (1, 2), (0, 2), (1, 2), (0, 1)]
    assert [gpus.local_position(mixed, r) for r in range(5)] == want
    assert horovodrun.local_ranks(mixed) == want
    assert [(p.local_rank, p.local_size) for p in
            (placement.placement_of(mixed, r) for r in range(5))] == want


def test_the_strategy_takes_its_share_of_the_hosts_gpus(monkeypatch):
    from tfdp.strategy import devices

    cluster = ClusterConfig.from_json(json.dumps({
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 1}}))
    monkeypatch.setattr(devices.tf.config, "list_physical_devices",
                        lambda kind=None: [f"/physical_device:GPU:{i}" for i in range(2)])
    monkeypatch.setattr(devices, "task_gpu_devices", lambda positions: list(positions))
    assert devices.shared_host_gpu_devices(cluster, environ={}) == [1]
    # Guard: with the variable set (Slurm, a device plugin, the user), every GPU it sees.
    assert devices.shared_host_gpu_devices(cluster, environ={"CUDA_VISIBLE_DEVICES": "0,1"}) is None
    assert devices.shared_host_gpu_devices(ClusterConfig.single_worker(), environ={}) is None
