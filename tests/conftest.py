"""Test setup: 8 virtual CPU devices, fixed before TensorFlow initialises (as TF's own
distribute tests do with set_logical_devices_to_at_least), so multi-replica tests run anywhere."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("WORKBENCH_RUNS_DIR", os.path.join(os.path.dirname(__file__), "..", "runs", "tests"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import workbench as wb  # noqa: E402

wb.configure_devices(cpus=8)

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


@pytest.fixture
def data():
    return toy_data()
