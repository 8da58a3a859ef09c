"""The benchmark models, in a flag-free module so several tools can import them."""

from __future__ import annotations


def build_model(name, keras):
    if name == "mlp":  # about 1.05M parameters
        return keras.Sequential([keras.Input((256,)), keras.layers.Dense(1024, activation="relu"),
                                 keras.layers.Dense(512, activation="relu"),
                                 keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
    if name == "mlp20m":  # 20 Dense layers, about 20.5M parameters (issue 43's job)
        return keras.Sequential([keras.Input((1024,))]
                                + [keras.layers.Dense(1024, activation="relu") for _ in range(19)]
                                + [keras.layers.Dense(512)])
    if name == "convnet":
        return keras.Sequential([keras.Input((32, 32, 3)),
                                 keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                                 keras.layers.MaxPooling2D(),
                                 keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
                                 keras.layers.MaxPooling2D(), keras.layers.Flatten(),
                                 keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
    inputs = keras.Input((32, 64))  # one Transformer encoder block, d=64, 4 heads
    h = keras.layers.MultiHeadAttention(4, 16)(inputs, inputs)
    h = keras.layers.LayerNormalization()(inputs + h)
    f = keras.layers.Dense(256, activation="relu")(h)
    h = keras.layers.LayerNormalization()(h + keras.layers.Dense(64)(f))
    outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(inputs, outputs)
