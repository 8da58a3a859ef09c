"""ZeRO-3's partition rule and settings as pure functions (tfdp/strategy/zero3/partition.py,
config.py): shapes, sizes and replica counts in, a decision out. No TensorFlow variable."""

import pytest

from tfdp.strategy.zero3 import config as config_lib
from tfdp.strategy.zero3 import partition
from tfdp.strategy.zero3.config import DEFAULT_SHARD_MIN_ELEMENTS, Zero3Config
from tfdp.strategy.zero3.partition import Kind, Partition


# --- which variables shard ----------------------------------------------------------------------

def test_the_first_step_mirrors_on_read_and_non_trainable_variables_unevaluated():
    assert partition.may_shard(on_read=False, trainable=True, follows_parameter=False)
    assert partition.may_shard(on_read=False, trainable=None, follows_parameter=False)
    assert not partition.may_shard(on_read=False, trainable=False, follows_parameter=False)
    assert not partition.may_shard(on_read=True, trainable=True, follows_parameter=False)
    # Optimizer state is not trainable, and follows its sharded parameter.
    assert partition.may_shard(on_read=False, trainable=False, follows_parameter=True)
    assert not partition.may_shard(on_read=True, trainable=False, follows_parameter=True)


def test_a_parameter_shards_from_the_threshold_on():
    def decide(shape, **kw):
        return partition.kind_of(shape=shape, floating=True, **kw)

    assert decide((128, 128), min_elements=DEFAULT_SHARD_MIN_ELEMENTS) is Kind.PARAMETER
    assert decide((128, 127), min_elements=DEFAULT_SHARD_MIN_ELEMENTS) is None
    assert decide((10,), min_elements=10) is Kind.PARAMETER
    assert decide((9,), min_elements=10) is None
    # 0 shards every float variable with an element; a scalar has one, an empty one none.
    assert decide((), min_elements=0) is Kind.PARAMETER
    assert decide((0, 4), min_elements=0) is None


def test_integer_and_undefined_shapes_stay_mirrored():
    assert partition.kind_of(shape=(1000,), floating=False, min_elements=0) is None
    assert partition.kind_of(shape=(None, 1000), floating=True, min_elements=0) is None
    assert partition.kind_of(shape=None, floating=True, min_elements=0) is None


def test_state_follows_its_parameter_whatever_its_size():
    assert partition.kind_of(shape=(3,), floating=True, min_elements=10**6,
                             parameter_shape=(3,), parameter_name="b") is Kind.STATE
    with pytest.raises(ValueError, match=r"state of shape \(3,\) for the sharded parameter "
                                         r"dense/kernel of shape \(3, 4\).*elementwise"):
        partition.kind_of(shape=(3,), floating=True, min_elements=0, parameter_shape=(3, 4),
                          parameter_name="dense/kernel")
    # Integer or unknown-shaped state is mirrored before its shape is compared.
    assert partition.kind_of(shape=(3,), floating=False, min_elements=0,
                             parameter_shape=(3, 4)) is None


def test_a_layout_map_overrides_the_size_threshold():
    assert partition.size_threshold(16384) == 16384
    assert partition.size_threshold(16384, layout_shards=True) == 0
    assert partition.size_threshold(16384, layout_shards=False) is None


# --- which elements each replica holds ----------------------------------------------------------

def test_a_partition_cuts_padded_equal_slices_in_replica_order():
    layout = Partition(num_elements=10, num_shards=4, first_shard=2, local_shards=2)
    assert (layout.shard_size, layout.pad) == (3, 2)
    assert [layout.bounds(i) for i in range(2)] == [(6, 9), (9, 12)]
    assert not layout.holds_every_slice
    assert Partition(10, 4, 0, 4).holds_every_slice
    # Every element has exactly one owner, the one whose bounds hold it.
    whole = Partition(10, 4, 0, 4)
    for element in range(10):
        owner = partition.owner_of(element, 10, 4)
        start, stop = whole.bounds(owner)
        assert start <= element < stop


def test_a_partition_checks_its_replicas():
    with pytest.raises(ValueError, match="num_shards"):
        Partition(10, 0)
    with pytest.raises(ValueError, match="not among"):
        Partition(10, 4, first_shard=3, local_shards=2)


# --- the settings ---------------------------------------------------------------------------------

def test_the_settings_are_checked_once_and_frozen():
    off = Zero3Config()
    assert not off.enabled and not off.gathers_per_unit
    assert off.shard_min_elements == DEFAULT_SHARD_MIN_ELEMENTS
    on = Zero3Config(shard_parameters=True, unit_layers="Block")
    assert on.enabled and on.gathers_per_unit and on.unit_layers == ("Block",)
    assert not Zero3Config(shard_parameters=True, reshard_after_forward=False).gathers_per_unit
    with pytest.raises(Exception):
        on.shard_parameters = False  # frozen


@pytest.mark.parametrize("arguments, fragment", [
    (dict(shard_parameters="yes"), "shard_parameters='yes' must be True or False"),
    (dict(shard_min_elements=-1), "shard_min_elements=-1 must be an integer >= 0"),
    (dict(shard_min_elements=True), "shard_min_elements=True"),
    (dict(shard_min_elements=1.5), "shard_min_elements=1.5"),
    (dict(reshard_after_forward=None), "reshard_after_forward=None must be True or False"),
    (dict(checkpoint_activations="yes"), "checkpoint_activations='yes' must be True or False"),
    (dict(unit_layers=(3,)), "unit_layers: 3 is neither a Keras layer class"),
    (dict(unit_layers=(int,)), "is neither a Keras layer class"),
])
def test_a_bad_setting_names_itself(arguments, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(".", r"\.")):
        Zero3Config(**arguments)


def test_config_of_any_other_strategy_is_disabled():
    assert config_lib.config_of(None) is config_lib.DISABLED
    assert config_lib.config_of(object()) is config_lib.DISABLED
