"""The three mistakes of the "errors-readable" check (and a fourth that TensorFlow finds only
while the step runs), as a researcher types them in `%%replicate` cells (mirrored x2), and
what the first line of each error must name."""

HEADER = "%%replicate --backend mirrored --replicas 2 --steps 5 --no-live\n"

# (a) A model built for 32 features, fed digits' 64.
WRONG_FEATURES = """import tensorflow as tf, keras
from sklearn.datasets import load_digits
X, Y = load_digits(return_X_y=True)
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)])
opt = repl.wrap_optimizer(keras.optimizers.Adam(1e-3))
def input_fn(ctx):
    return tf.data.Dataset.from_tensor_slices((X.astype("float32"), Y)).repeat().batch(64)
def step_fn(x, y):
    with tf.GradientTape() as tape:
        logits = model(x, training=True)
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return {"loss": loss}
"""

# (b) input_fn returning a Python list.
LIST_INPUT = """import tensorflow as tf
w = tf.Variable(1.0)
def input_fn(ctx):
    return [tf.ones([8, 2]), tf.ones([8])]
def step_fn(x, y):
    return {"loss": tf.reduce_mean(x) * w}
"""

# (c) A misspelt name inside step_fn.
MISSPELT_NAME = """import tensorflow as tf
w = tf.Variable(1.0)
def input_fn(ctx):
    return tf.data.Dataset.from_tensor_slices((tf.ones([64, 2]), tf.ones([64]))).repeat().batch(8)
def step_fn(x, y):
    loss = tf.reduce_mean(x) * w
    w.assign_sub(learning_rat * loss)
    return {"loss": loss}
"""

# (d) Labels outside the model's classes: TensorFlow finds it while the compiled step runs.
LABEL_OUT_OF_RANGE = """import tensorflow as tf, keras
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(10)])
opt = repl.wrap_optimizer(keras.optimizers.SGD(0.1))
def input_fn(ctx):
    return tf.data.Dataset.from_tensor_slices((tf.ones([64, 4]), tf.fill([64], 12))).repeat().batch(8)
def step_fn(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return {"loss": loss}
"""

# name -> (cell body, a regex the error message's first line matches, a line of the cell the
# shown traceback points at, or None when the mistake is found before step_fn runs)
CASES = {
    "wrong_features": (WRONG_FEATURES, r"incompatible|expected axis -1", "logits = model(x, training=True)"),
    "list_input": (LIST_INPUT, r"input_fn", None),
    "misspelt_name": (MISSPELT_NAME, r"learning_rat", "w.assign_sub(learning_rat * loss)"),
    "label_out_of_range": (
        LABEL_OUT_OF_RANGE,
        r"Received a label value of 12 which is outside the valid range of \[0, 10\)",
        "loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))",
    ),
}
