"""A DLRM-style recommender in plain Keras, and synthetic click data for it (no download).

Shared by tools/bench_recommender.py and the recommender tests; flag-free.

The model (Naumov et al., "Deep Learning Recommendation Model for Personalization and
Recommendation Systems", 2019): each categorical feature looks up its own ``Embedding``
table (the first is the large one, ``rows`` rows; the others are small), the dense features
go through a bottom MLP to the embedding width, the pairwise dot products of all those
vectors (the upper triangle) join the bottom MLP's output, and a top MLP gives the click
probability. The ids are per example (one id per feature per example), which is the lookup
recommenders have: one device's gradient of a table has one row per example.

The data: ids drawn from a power law over the rows (a few items are popular, most are rare,
as in click logs), dense features from a normal distribution, and the click from a hidden
logistic model of both, so the model has a signal to learn (validation AUC well above 0.5).
"""

from __future__ import annotations

import numpy as np

NUM_DENSE = 13           # Criteo's 13 integer features
SMALL_TABLE_ROWS = (1_000, 100)   # the other categorical features: small tables


def table_rows(rows: int) -> list[int]:
    """The rows of each table: the large one first, then the small ones."""
    return [int(rows), *SMALL_TABLE_ROWS]


def build_dlrm(rows: int, dim: int = 64, bottom=(64,), top=(64, 32), seed: int = 0):
    """The DLRM-style model: inputs ``{"dense": [b, 13] float32, "ids": [b, T] int32}``,
    output the click probability ``[b, 1]``. Weights are seeded (``seed``), so two builds
    start from the same weights."""
    import keras

    tables = table_rows(rows)
    dense_in = keras.Input((NUM_DENSE,), name="dense")
    ids_in = keras.Input((len(tables),), dtype="int32", name="ids")
    x = dense_in
    for k, units in enumerate((*bottom, dim)):
        x = keras.layers.Dense(units, activation="relu", name=f"bottom_{k}",
                               kernel_initializer=keras.initializers.GlorotUniform(seed + k))(x)
    vectors = [x]
    for t, n in enumerate(tables):
        column = keras.layers.Lambda(lambda v, t=t: v[:, t], name=f"id_{t}")(ids_in)
        vectors.append(keras.layers.Embedding(
            n, dim, name=f"table_{t}",
            embeddings_initializer=keras.initializers.RandomUniform(-0.05, 0.05, seed=seed + 10 + t)
        )(column))
    interaction = DotInteraction(name="interaction")(vectors)
    x = keras.layers.Concatenate(name="top_in")([vectors[0], interaction])
    for k, units in enumerate(top):
        x = keras.layers.Dense(units, activation="relu", name=f"top_{k}",
                               kernel_initializer=keras.initializers.GlorotUniform(seed + 20 + k))(x)
    out = keras.layers.Dense(1, activation="sigmoid", name="click",
                             kernel_initializer=keras.initializers.GlorotUniform(seed + 30))(x)
    return keras.Model({"dense": dense_in, "ids": ids_in}, out, name="dlrm")


def _dot_interaction_class():
    import keras

    class DotInteraction(keras.layers.Layer):
        """The pairwise dot products of F feature vectors ``[b, d]``: ``[b, F(F-1)/2]``."""

        def call(self, vectors):
            stacked = keras.ops.stack(vectors, axis=1)                      # [b, F, d]
            dots = keras.ops.matmul(stacked, keras.ops.transpose(stacked, (0, 2, 1)))
            f = len(vectors)
            rows, cols = np.triu_indices(f, k=1)
            flat = keras.ops.reshape(dots, (-1, f * f))
            return keras.ops.take(flat, rows * f + cols, axis=1)

        def compute_output_shape(self, shapes):
            f = len(shapes)
            return (shapes[0][0], f * (f - 1) // 2)

    return DotInteraction


def DotInteraction(**kwargs):  # a layer constructor
    return _dot_interaction_class()(**kwargs)


def synthetic_clicks(rows: int, examples: int, seed: int = 0, alpha: float = 1.1):
    """``(features, clicks)`` as numpy arrays: features ``{"dense", "ids"}``, clicks ``[n, 1]``
    float32 in {0, 1}. Ids follow a power law (exponent ``alpha``) over each table's rows."""
    rng = np.random.default_rng(seed)
    tables = table_rows(rows)
    dense = rng.normal(size=(examples, NUM_DENSE)).astype(np.float32)
    ids = np.stack([np.minimum(rng.zipf(alpha, size=examples) - 1, n - 1) for n in tables],
                   axis=1).astype(np.int32)
    # The hidden model: a weight per dense feature and an affinity per (hashed) id bucket.
    w_dense = rng.normal(size=NUM_DENSE).astype(np.float32)
    affinity = [rng.normal(size=min(n, 4096)).astype(np.float32) for n in tables]
    logit = dense @ w_dense * 0.5
    for t, a in enumerate(affinity):
        logit += a[ids[:, t] % len(a)]
    clicks = (rng.random(examples) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return {"dense": dense, "ids": ids}, clicks[:, None]
