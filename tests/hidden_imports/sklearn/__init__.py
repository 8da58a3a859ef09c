"""scikit-learn, hidden from Keras's wrappers (``keras.src.wrappers``), real for everyone else
(the examples use it): see tests/hidden_imports/_keras_optional.py."""

import _keras_optional

_keras_optional.stand_in(__name__, "wrappers")
