"""The Keras mixed-precision guide's custom training loop, ported line by line to PyTorch.

Seed ``002`` (the TensorFlow "Mixed precision" guide) trains a Dense 784->units->units->10 MLP
with a float32 softmax under the ``mixed_float16`` policy, wrapping RMSprop in
``LossScaleOptimizer`` and calling ``get_scaled_loss`` / ``get_unscaled_gradients`` /
``apply_gradients``. Each Keras line is kept as a comment above its PyTorch twin.

Nothing is downloaded: the data are MNIST-shaped synthetic digits (784 features, 10 classes)
unless ``--mnist1d`` is given (MNIST-1D, generated locally, 40 features).

    python examples/keras_custom_loop.py                 # mixed_float16, as in the guide
    python examples/keras_custom_loop.py --policy mixed_bfloat16   # faster on CPUs with AMX
"""

from __future__ import annotations

import argparse
import copy
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.compat.keras import LossScaleOptimizer


def synthetic_digits(
    n_train: int = 24576, n_test: int = 4096, features: int = 784, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Ten noisy prototypes in [0, 255], scaled to [0, 1] like ``x_train / 255``."""
    g = torch.Generator().manual_seed(seed)
    protos = torch.rand(10, features, generator=g) * 255

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, 10, (n,), generator=g)
        x = (protos[y] + 180 * torch.randn(n, features, generator=g)).clamp(0, 255)
        return x.float() / 255, y

    return (*make(n_train), *make(n_test))


def build_model(features: int) -> nn.Module:
    # inputs = keras.Input(shape=(784,), name='digits')
    # num_units = 4096 on a GPU, 64 on a CPU "so the model finishes in a reasonable time"
    num_units = 4096 if torch.cuda.is_available() else 64
    model = nn.Sequential(
        OrderedDict(
            dense_1=nn.Linear(features, num_units),
            relu_1=nn.ReLU(),  # Dense(units, 'relu')
            dense_2=nn.Linear(num_units, num_units),
            relu_2=nn.ReLU(),  # Dense(units, 'relu')
            dense_logits=nn.Linear(num_units, 10),  # Dense(10)
            predictions=nn.Softmax(dim=-1),
        )
    )  # Activation('softmax', dtype='float32') ...
    mixprec.set_policy(model.predictions, "float32")  # ... that dtype='float32'
    return model


def loss_object(y: torch.Tensor, predictions: torch.Tensor) -> torch.Tensor:
    """``tf.keras.losses.SparseCategoricalCrossentropy()`` on probabilities (Keras clips them)."""
    eps = 1e-7
    return F.nll_loss(torch.log(predictions.clamp(eps, 1 - eps)), y)


def run(
    epochs: int = 5,
    batch_size: int = 8192,
    policy: str = "mixed_float16",
    data: tuple[torch.Tensor, ...] | None = None,
    seed: int = 0,
    verbose: bool = True,
) -> dict[str, list[float]]:
    torch.manual_seed(seed)
    x_train, y_train, x_test, y_test = data if data is not None else synthetic_digits()
    # mixed_precision.set_global_policy('mixed_float16')
    mixprec.set_global_policy(policy)
    model = build_model(x_train.shape[1])
    params = [p for p in model.parameters() if p.requires_grad]  # model.trainable_variables
    # optimizer = keras.optimizers.RMSprop()
    optimizer = torch.optim.RMSprop(params, lr=1e-3, alpha=0.9, eps=1e-7)
    # optimizer = mixed_precision.LossScaleOptimizer(optimizer)
    optimizer = LossScaleOptimizer(optimizer)
    # initial_weights = model.get_weights()
    initial_weights = copy.deepcopy(model.state_dict())

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # with tf.GradientTape() as tape:
        with mixprec.autocast():  # layers follow the global policy
            predictions = model(x)  # predictions = model(x)
            loss = loss_object(y, predictions)  # loss = loss_object(y, predictions)
            scaled_loss = optimizer.get_scaled_loss(loss)
        # scaled_gradients = tape.gradient(scaled_loss, model.trainable_variables)
        scaled_gradients = torch.autograd.grad(scaled_loss, params)
        gradients = optimizer.get_unscaled_gradients(scaled_gradients)
        # optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        optimizer.apply_gradients(zip(gradients, params))
        return loss

    @torch.no_grad()
    def test_step(x: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast():  # model(x, training=False)
            return model(x)

    # model.set_weights(initial_weights)
    model.load_state_dict(initial_weights)
    history: dict[str, list[float]] = {"loss": [], "test_accuracy": [], "loss_scale": []}
    g = torch.Generator().manual_seed(seed)
    try:
        for epoch in range(epochs):
            losses = []  # tf.keras.metrics.Mean()
            correct = 0  # SparseCategoricalAccuracy
            order = torch.randperm(len(x_train), generator=g)  # .shuffle(10000).batch(8192)
            for idx in order.split(batch_size):
                loss = train_step(x_train[idx], y_train[idx])
                losses.append(float(loss))
            for x, y in zip(x_test.split(batch_size), y_test.split(batch_size)):
                predictions = test_step(x)
                correct += int((predictions.argmax(-1) == y).sum())
            history["loss"].append(sum(losses) / len(losses))
            history["test_accuracy"].append(correct / len(x_test))
            history["loss_scale"].append(optimizer.loss_scale)
            if verbose:
                print(
                    f"Epoch {epoch}: loss={history['loss'][-1]}, test accuracy="
                    f"{history['test_accuracy'][-1]}, loss scale={optimizer.loss_scale}"
                )
    finally:
        mixprec.set_global_policy(None)
    history["skipped_steps"] = [optimizer.skipped_steps]
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--policy", default="mixed_float16")
    parser.add_argument("--mnist1d", action="store_true", help="train on MNIST-1D instead")
    args = parser.parse_args()
    data = None
    if args.mnist1d:
        from mixprec.bench.workloads import load_mnist1d

        d = load_mnist1d()
        data = (d["x"], d["y"], d["x_test"], d["y_test"])
    run(args.epochs, policy=args.policy, data=data, batch_size=512 if args.mnist1d else 8192)


if __name__ == "__main__":
    main()
