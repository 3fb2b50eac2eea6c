"""The default job written by hand, as a user new to JAX would: scikit-learn's digits,
64 → Dense 128 relu → Dropout 0.2 → Dense 10, Adam 1e-3, batch 64, 1,500 steps,
a reshuffle every epoch, an evaluation every 500 steps; flax.linen + optax, one
`jax.jit` step with the state donated. No checkpoints, metrics files or TensorBoard: the
engine's default job does all of those too, so this is the floor it is measured against
(benchmarks/process_wall.py runs both as whole processes)."""

import time

START = time.time()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

STEPS, BATCH, EVAL_EVERY = 1500, 64, 500


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.Dense(128)(x.reshape(len(x), -1)))
        x = nn.Dropout(0.2, deterministic=not train)(x)
        return nn.Dense(10)(x)


def main():
    digits = load_digits()
    x, y = (digits.images / 16.0).astype(np.float32), digits.target
    order = np.random.default_rng(0).permutation(len(x))
    n_eval = round(0.2 * len(x))
    x_eval, y_eval, x_train, y_train = x[order[:n_eval]], y[order[:n_eval]], x[order[n_eval:]], y[order[n_eval:]]
    model, tx = MLP(), optax.adam(1e-3)
    params = model.init(jax.random.key(0), x_train[:1], train=False)["params"]
    opt_state = tx.init(params)

    def loss_fn(params, xb, yb, key):
        logits = model.apply({"params": params}, xb, train=True, rngs={"dropout": key})
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    @jax.jit
    def evaluate(params, xb, yb):
        logits = model.apply({"params": params}, xb, train=False)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean(), jnp.mean(logits.argmax(-1) == yb)

    def step(params, opt_state, xb, yb, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb, key)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(step, donate_argnums=(0, 1))
    per_epoch = len(x_train) // BATCH
    key = jax.random.key(1)
    for s in range(STEPS):
        epoch, i = divmod(s, per_epoch)
        if i == 0:
            perm = np.random.default_rng([0, epoch]).permutation(len(x_train))
        rows = perm[i * BATCH : (i + 1) * BATCH]
        params, opt_state, loss = step(params, opt_state, x_train[rows], y_train[rows], jax.random.fold_in(key, s))
        if (s + 1) % EVAL_EVERY == 0:
            eval_loss, accuracy = evaluate(params, x_eval, y_eval)
            print(
                f"step {s + 1}: loss {float(loss):.4f} eval loss {float(eval_loss):.4f} accuracy {float(accuracy):.4f}",
                flush=True,
            )
    print(f"done in {time.time() - START:.1f} s")


if __name__ == "__main__":
    main()
