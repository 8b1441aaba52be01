"""Small models and data shared by the tests (a module, not conftest: `python -m pytest` also
collects notebooks/, whose own conftest.py would shadow `from conftest import ...`)."""

import numpy as np

FEATURES, CLASSES = 8, 4


def make_mlp(seed: int = 0):
    """A small MLP with deterministic initial weights (same on every backend)."""
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(CLASSES)]
    )


def toy_data(rows: int = 256, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = (x[:, :CLASSES].argmax(axis=1)).astype("int32")
    return x, y
