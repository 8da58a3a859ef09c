"""tfdp/strategy/source_pipeline.py: the datasets a tfdp strategy distributes run without
tf.data's autotune model unless their options set it (destroying an autotuned iterator can
wait up to 60 s; the module docstring has the evidence). The strategy cases capture what
TensorFlow's own distribution receives, by wrapping the parent class's public methods."""

import pytest
import tensorflow as tf

import tfdp
from tfdp.strategy import source_pipeline
from helpers import cpu_devices


def _options(enabled):
    options = tf.data.Options()
    options.autotune.enabled = enabled
    return options


def _source(enabled=None):
    ds = tf.data.Dataset.range(64).map(lambda x: x * 2, num_parallel_calls=tf.data.AUTOTUNE)
    return ds if enabled is None else ds.with_options(_options(enabled))


@pytest.mark.parametrize("option, user_decides", [(None, False), (True, True), (False, True)])
def test_only_an_unset_option_is_decided_by_tfdp(option, user_decides):
    assert source_pipeline.autotune_set_by_user(option) is user_decides


@pytest.mark.parametrize("option, want", [(None, False), (True, True), (False, False)])
def test_the_source_keeps_a_set_option_and_loses_an_unset_one(option, want):
    ds = source_pipeline.without_autotune_model(_source(option))
    assert ds.options().autotune.enabled is want
    assert list(ds.as_numpy_iterator()) == list(range(0, 128, 2))  # the same elements
    not_a_dataset = [1, 2]
    assert source_pipeline.without_autotune_model(not_a_dataset) is not_a_dataset


@pytest.fixture
def received(monkeypatch):
    """The datasets TensorFlow's MultiWorkerMirroredStrategy receives from tfdp's."""
    got = []
    parent = tf.distribute.MultiWorkerMirroredStrategy

    def distribute_dataset(self, dataset, options=None, _original=parent.experimental_distribute_dataset):
        got.append(dataset)
        return _original(self, dataset, options)

    def from_function(self, dataset_fn, options=None,
                      _original=parent.distribute_datasets_from_function):
        def recording(context):
            got.append(dataset_fn(context))
            return got[-1]
        return _original(self, recording, options)

    monkeypatch.setattr(parent, "experimental_distribute_dataset", distribute_dataset)
    monkeypatch.setattr(parent, "distribute_datasets_from_function", from_function)
    return got


@pytest.mark.parametrize("option, want", [(None, False), (True, True)])
def test_the_strategy_distributes_sources_without_the_model_unless_asked(received, option, want):
    strategy = tfdp.DataParallelStrategy(devices=cpu_devices(2))
    strategy.experimental_distribute_dataset(_source(option).batch(4))
    strategy.distribute_datasets_from_function(lambda ctx: _source(option).batch(2))
    assert [ds.options().autotune.enabled for ds in received] == [want, want]


def test_tfdp_data_pipelines_and_fit_run_without_the_model(received):
    import keras
    import numpy as np
    strategy = tfdp.DataParallelStrategy(devices=cpu_devices(2))
    x = np.zeros((32, 3), "float32")
    train = tfdp.data.distribute(strategy, tf.data.Dataset.from_tensor_slices((x, x[:, 0])), 8)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    model.fit(train, epochs=1, verbose=0)
    model.fit(tf.data.Dataset.from_tensor_slices((x, x[:, 0])).batch(8), epochs=1, verbose=0)
    assert received and all(ds.options().autotune.enabled is False for ds in received)
