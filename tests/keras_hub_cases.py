"""KerasHub models of the equivalence tests (tests/test_keras_hub.py and the worker script
tests/workers/mw_keras_hub_worker.py that both of its workers run): tiny task models built
from config (random init, no preset, nothing downloaded), the inputs they take, and one
training routine for one device and every tfdp mode.

- ``gpt2``: GPT-2 causal LM (token + position embeddings, the output projection is the
  token embedding transposed: ReversibleEmbedding's tied weights), dropout 0.1 (the config's
  default), token ids + padding mask, next-token labels weighted by the mask.
- ``bert``: BERT classifier (token, segment and position embeddings, pooled output, dropout
  0.1 in the backbone and before the head), token ids + segment ids + padding mask.
- ``distilbert``: DistilBERT classifier (token and position embeddings, no segments),
  token ids + padding mask.
- ``gemma_lora``: Gemma causal LM (RMSNorm, rotary positions, tied embedding) fine-tuned with
  LoRA: ``backbone.enable_lora(2)`` freezes every backbone weight and adds trainable rank-2
  factors beside the query and value kernels.

Each is trained by ``fit`` with AdamW + ``global_clipnorm`` on one global batch order.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import keras

VOCAB = 96
SEQ = 8
GLOBAL_BATCH = 16
EXAMPLES = 64  # 4 steps per epoch
EPOCHS = 1
# One transformer block each: a second block adds trace time (the suite's bound, README) and no
# distribution path. "NAME:2" builds two (the mixed_bfloat16 bounds were measured with two).
LAYERS = 1
SEED = 7  # keras.utils.set_random_seed before building: the Dropout layers' seeds


def _keras_hub():
    import keras_hub  # imported late: the test module skips when it is not installed
    return keras_hub


def gpt2(layers=LAYERS):
    hub = _keras_hub()
    backbone = hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=layers, num_heads=2,
                                       hidden_dim=32, intermediate_dim=64,
                                       max_sequence_length=SEQ)
    return hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def bert(layers=LAYERS):
    hub = _keras_hub()
    backbone = hub.models.BertBackbone(vocabulary_size=VOCAB, num_layers=layers, num_heads=2,
                                       hidden_dim=32, intermediate_dim=64,
                                       max_sequence_length=SEQ)
    return hub.models.BertTextClassifier(backbone=backbone, num_classes=3, preprocessor=None)


def distilbert(layers=LAYERS):
    hub = _keras_hub()
    backbone = hub.models.DistilBertBackbone(vocabulary_size=VOCAB, num_layers=layers,
                                             num_heads=2, hidden_dim=32, intermediate_dim=64,
                                             max_sequence_length=SEQ)
    return hub.models.DistilBertTextClassifier(backbone=backbone, num_classes=3,
                                               preprocessor=None)


def gemma_lora(layers=LAYERS):
    hub = _keras_hub()
    backbone = hub.models.GemmaBackbone(vocabulary_size=VOCAB, num_layers=layers, num_query_heads=2,
                                        num_key_value_heads=1, hidden_dim=32,
                                        intermediate_dim=64, head_dim=16)
    model = hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    backbone.enable_lora(2)
    return model


MODELS = {"gpt2": gpt2, "bert": bert, "distilbert": distilbert, "gemma_lora": gemma_lora}


def make_model(name):
    """The model ``name``: a key of MODELS, or ``KEY:LAYERS`` for another number of blocks."""
    key, _, layers = name.partition(":")
    return MODELS[key](int(layers or LAYERS))


def data(name, n=EXAMPLES, seed=0):
    """(x, y, sample_weight) numpy arrays in the model's own input format. Sequences end in
    padding of varying length (mask 0), so the padding mask and the weights matter."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(SEQ // 2, SEQ + 1, size=n)
    mask = np.arange(SEQ + 1)[None, :] < lengths[:, None] + 1
    tokens = np.where(mask, rng.integers(1, VOCAB, size=(n, SEQ + 1)), 0).astype("int32")
    if name.partition(":")[0] in ("bert", "distilbert"):
        x = {"token_ids": tokens[:, :SEQ], "padding_mask": mask[:, :SEQ]}
        if name.partition(":")[0] == "bert":
            x["segment_ids"] = ((np.arange(SEQ)[None, :] >= lengths[:, None] // 2)
                                .astype("int32") * mask[:, :SEQ])
        y = (tokens[:, :SEQ].sum(axis=1) % 3).astype("int32")
        return x, y, None
    x = {"token_ids": tokens[:, :SEQ], "padding_mask": mask[:, :SEQ]}
    return x, tokens[:, 1:], mask[:, 1:].astype("float32")


GLOBAL_CLIPNORM = 1.0
# A global_clipnorm that clips every step of BERT and DistilBERT: their global gradient norm is
# 0.13-0.22 on these batches (one device, measured), so at 1.0 nothing is clipped, and
# Keras's clip makes every gradient dense (``v * scale``) whatever the norm: the sparse
# rows' norm then decides nothing.
CLIPPING = 0.05


def optimizer(global_clipnorm=GLOBAL_CLIPNORM):
    return keras.optimizers.AdamW(2e-3, weight_decay=0.01, global_clipnorm=global_clipnorm)


def initial_weights(name):
    keras.utils.set_random_seed(1234)
    return make_model(name).get_weights()


def dataset(name):
    x, y, w = data(name)
    parts = (x, y) if w is None else (x, y, w)
    return tf.data.Dataset.from_tensor_slices(parts)


def build(name, weights, wrap=None, seed=SEED, global_clipnorm=GLOBAL_CLIPNORM,
          jit_compile="auto"):
    """The model with ``weights``, compiled with AdamW + global_clipnorm (wrapped by ``wrap``,
    e.g. tfdp.ShardedOptimizer) and ``jit_compile``; call inside the strategy's scope.
    ``seed`` decides the Dropout layers' seeds (drawn when they are built)."""
    keras.utils.set_random_seed(seed)
    model = make_model(name)
    model.set_weights(weights)
    opt = optimizer(global_clipnorm)
    # the task's own loss and metrics
    model.compile(optimizer=wrap(opt) if wrap else opt, jit_compile=jit_compile)
    return model


def train(name, weights, strategy=None, wrap=None, seed=SEED, global_clipnorm=GLOBAL_CLIPNORM,
          jit_compile="auto"):
    """Trains model ``name`` from ``weights`` for EPOCHS on the GLOBAL_BATCH order and returns
    it. The input is the batched ``tf.data.Dataset`` on every layout: KerasHub's task ``fit``
    takes a dataset or arrays, not a distributed dataset, and tfdp distributes it."""
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        model = build(name, weights, wrap, seed, global_clipnorm, jit_compile)
    model.fit(dataset(name).batch(GLOBAL_BATCH), epochs=EPOCHS, verbose=0, shuffle=False)
    return model


def max_gap(a, b):
    return max(float(np.max(np.abs(np.asarray(u, np.float64) - np.asarray(v, np.float64))))
               for u, v in zip(a, b))


def relative_gap(a, b, start):
    """|a - b| / |b - start| over all weights together (Euclidean): how far ``a`` ends from
    ``b`` against how far training moved ``b``."""
    def norm(parts):
        return float(np.sqrt(sum(np.sum(np.square(p.astype(np.float64))) for p in parts)))
    return (norm([np.asarray(u) - np.asarray(v) for u, v in zip(a, b)])
            / norm([np.asarray(v) - np.asarray(s) for v, s in zip(b, start)]))
