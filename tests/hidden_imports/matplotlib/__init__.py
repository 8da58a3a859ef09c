"""matplotlib, hidden from Keras's image gallery (``keras.src.visualization``), real for everyone
else (the tools' plots): see tests/hidden_imports/_keras_optional.py."""

import _keras_optional

_keras_optional.stand_in(__name__, "visualization")
