"""Models and optimizers of the ZeRO-3 tests (tests/test_zero3.py and the worker script
tests/workers/mw_zero3_worker.py that both of its workers run): the kinds of model users
bring (a Dense stack, a Conv stack with synchronized BatchNorm, a block with tied embedding
weights, a model with a frozen layer) and the optimizers and clipping paths whose
arithmetic spans whole tensors."""

import keras
import tensorflow as tf

import tfdp


def dense_stack():
    """Uneven widths: slices are padded (8*40, 40, 40*30, 30 (pad), 30*3 (pad), 3 (pad))."""
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(40, activation="tanh"),
                             keras.layers.Dense(30, activation="tanh"), keras.layers.Dense(3)])


def conv_batchnorm():
    """No bias before BatchNorm (which cancels it: Adam would amplify its rounding noise)."""
    return keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, use_bias=False),
        keras.layers.BatchNormalization(synchronized=True), keras.layers.Activation("relu"),
        keras.layers.Conv2D(8, 3), keras.layers.Flatten(), keras.layers.Dense(2)])


@keras.saving.register_keras_serializable(package="tfdp_tests")
class TiedEmbedding(keras.layers.Layer):
    """One table used twice: a lookup of token ids and the output projection (KerasHub's
    ReversibleEmbedding pattern), so the gradient of the table sums two paths."""

    def __init__(self, vocab=20, dim=8, classes=3, **kwargs):
        super().__init__(**kwargs)
        self.vocab, self.dim, self.classes = vocab, dim, classes

    def build(self, input_shape):
        self.table = self.add_weight(shape=(self.vocab, self.dim), name="table",
                                     initializer="glorot_uniform")

    def call(self, ids):
        pooled = tf.reduce_mean(tf.gather(self.table, ids), axis=1)
        return tf.matmul(pooled, self.table, transpose_b=True)[:, :self.classes]

    def get_config(self):
        return dict(super().get_config(), vocab=self.vocab, dim=self.dim, classes=self.classes)


def tied_embedding():
    return keras.Sequential([keras.Input((4,), dtype="int32"), TiedEmbedding(),
                             keras.layers.Dense(3)])


def frozen_layer():
    """The first Dense frozen (LoRA's base weights, fine-tuning a head)."""
    model = dense_stack()
    model.layers[0].trainable = False
    return model


MODELS = {"dense": dense_stack, "conv_bn": conv_batchnorm, "tied": tied_embedding,
          "frozen": frozen_layer}

OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.3),
    "adamw_clipnorm": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05, clipnorm=0.05),
    "lamb": lambda: tfdp.optimizers.LAMB(0.02, weight_decay=1e-2, global_clipnorm=1.0),
    "lars": lambda: tfdp.optimizers.LARS(2.0, weight_decay=1e-3),
    "adam_accumulation": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.3,
                                                       gradient_accumulation_steps=2),
    "adamw_ema": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05, use_ema=True,
                                                ema_momentum=0.9),
}


def compile_for(model, optimizer, **kwargs):
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **kwargs)
