"""The recommender configuration shared by tests/test_recommender.py and its worker script:
tools/dlrm.py's model with a 5,000 x 8 table, small MLPs, and its synthetic clicks."""

import dlrm

ROWS, DIM, GLOBAL_BATCH, EXAMPLES = 5_000, 8, 64, 512
# Rounds of 4 x 2,048 elements: the table goes in many rounds, most of them broadcasts from
# its owner (the small tables and the MLP end in the first rounds).
SMALL_ROUNDS_BUCKET_BYTES = 4 * 4 * 2048


def data():
    return dlrm.synthetic_clicks(ROWS, EXAMPLES, seed=3)


def build():
    return dlrm.build_dlrm(ROWS, dim=DIM, bottom=(16,), top=(16,), seed=5)
