"""pandas, hidden from Keras's array data adapters (``keras.src.trainers.data_adapters``), real
for everyone else: see tests/hidden_imports/_keras_optional.py."""

import _keras_optional

_keras_optional.stand_in(__name__, "trainers/data_adapters")
