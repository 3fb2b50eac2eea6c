"""data.name=chat (issue 45, item 1): conversations rendered with the model's chat template as
transformers renders them, tokenized with its tokenizer, packed, and a loss mask that covers
exactly the rendered spans data.loss_on names; overflow and bad data."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import chat_data as chat_data_helpers
from support.chat_data import LLAMA, RECORDS, chat_data

from engine.parallel.sharding import unbox
from engine.run.step import make_loss_fn
from models import REGISTRY
from models.family import NextToken
from models.llama import LlamaConfig

model_dir = chat_data_helpers.model_dir  # the fixture


def test_the_sft_loss_is_the_masked_mean_over_the_assistant_tokens(tmp_path, model_dir):
    data = chat_data(tmp_path, model_dir, RECORDS, seq_len=48)
    batch = {name: jnp.asarray(array) for name, array in data.train.items()}
    module = REGISTRY["llama"].build(LlamaConfig(**LLAMA), data.info, jnp.float32, jnp.float32)
    inputs, targets = batch["tokens"][:, :-1].astype(jnp.int32), batch["tokens"][:, 1:].astype(jnp.int32)
    params = unbox(module.init(jax.random.key(0), inputs, train=False))["params"]
    documents = {"positions": batch["positions"][:, :-1], "segment_ids": batch["segments"][:, :-1]}
    logits = module.apply({"params": params}, inputs, train=False, **documents)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    trained = batch["loss_mask"][:, 1:]  # the assistant's tokens, as targets
    by_hand = float(jnp.sum(nll * trained) / jnp.sum(trained))

    def loss(task):
        return float(make_loss_fn(module, task)(params, {}, batch, None, False)[0])

    unchanged = loss(NextToken())
    assert unchanged == pytest.approx(by_hand, rel=1e-5)
    segments = np.asarray(batch["segments"])
    prompt = np.argwhere((np.asarray(trained) == 0) & (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0))
    answer = np.argwhere(np.asarray(trained) == 1)
    for (row, column), same in ((prompt[len(prompt) // 2], True), (answer[len(answer) // 2], False)):

        class Changed(NextToken):  # one target other than the data's: nothing else changes
            def model_inputs(self, batch):
                inputs, targets, extra = super().model_inputs(batch)
                targets = targets.at[row, column].set((targets[row, column] + 1) % data.info.vocab_size)
                return inputs, targets, {**extra, "targets": targets}

        assert (loss(Changed()) == unchanged) == same
