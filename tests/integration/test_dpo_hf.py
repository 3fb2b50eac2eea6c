"""The DPO objective against Hugging Face (issue 45): the engine's response log-probabilities of
prompt + completion equal transformers' on the same Llama and pairs, tokenized as TRL's
DPOTrainer tokenizes them, and its loss and metrics equal TRL's own (trl 1.16's
DPOTrainer._compute_loss). Skipped where torch, transformers or trl are not installed."""

import jax
import numpy as np
import pytest
from support.chat_data import SPECIAL, TEMPLATE, write_jsonl, write_model_dir
from support.dpo import eval_sums, per_pair
from support.llama import ours_from_hf_dir

from engine.config.data_sections import data_config
from engine.config.schema import DpoConfig
from engine.data import DataInfo
from engine.data.sources import load_dataset
from engine.objectives.dpo_part import make_dpo_loss_fn
from engine.state.train_state import REFERENCE
from models.family import NextToken

torch = pytest.importorskip("torch")


transformers = pytest.importorskip("transformers")


SYSTEM = {"role": "system", "content": "be brief"}


PAIRS = [  # (prompt, chosen, rejected): conversational, as TRL's DPOTrainer takes them
    ("where is the cat?", "on the mat", "the cat sat"),
    ("hello there", "hi", "how are you today? the cat sat on the mat"),
    ("how are you", "well", "be brief"),
    ("the cat sat", "on the mat, be brief", "hello"),
]


def record(prompt: str, chosen: str, rejected: str, system: bool) -> dict:
    return {
        "prompt": ([SYSTEM] if system else []) + [{"role": "user", "content": prompt}],
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


RECORDS = [record(*pair, system=i % 2 == 0) for i, pair in enumerate(PAIRS)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A model directory (tokenizer and chat template), a random policy and a different random
    reference Llama saved by transformers, and the pairs as the engine's preferences data."""
    root = tmp_path_factory.mktemp("dpo_hf")
    model_dir = write_model_dir(root)
    tokenizer = hf_tokenizer(model_dir)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.2,  # (far from uniform: the log-probabilities differ from pair to pair)
    )
    for seed, name in ((0, "policy"), (1, "reference")):
        torch.manual_seed(seed)
        transformers.LlamaForCausalLM(config).save_pretrained(root / name)
    path = write_jsonl(root / "pairs.jsonl", RECORDS)
    cfg = data_config(name="preferences", path=str(path), eval_path=str(path), tokenizer=str(model_dir), seq_len=48)
    return root, tokenizer, load_dataset(cfg)


def hf_tokenizer(model_dir):
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / "tokenizer.json"), bos_token=SPECIAL[0], eos_token="<|im_end|>"
    )
    tokenizer.chat_template = TEMPLATE
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def trl_tokens(tokenizer, rec: dict, side: str) -> tuple[list[int], list[int]]:
    """(prompt + completion ids, completion mask) as TRL's DPOTrainer tokenizes a conversational
    pair: the prompt rendered with the generation prompt, prompt + response without, the completion
    where they diverge."""

    def ids(messages, **kw):
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompt = ids(rec["prompt"], add_generation_prompt=True)
    full = ids(rec["prompt"] + rec[side])
    common = next((i for i, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
    return full, [0] * common + [1] * (len(full) - common)


def transformers_logps(model_path, tokens: list[int], mask: list[int]) -> float:
    """sum of log_softmax(logits) gathered on the completion's tokens (TRL's sequence log-probability)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].double()
    per_token = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return float((per_token * torch.tensor(mask[1:], dtype=torch.float64)).sum())


def batch_of(data) -> dict:
    """The preferences data's training pairs as one batch."""
    return {name: jax.numpy.asarray(array) for name, array in data.train.items()}


def engine(root, data, **dpo):
    """(the engine's module, the policy's parameters, model state with the reference as a full
    fine-tuning run keeps it, the DPO loss function's jitted eval sums)."""
    info = DataInfo("tokens", 8, 8, vocab_size=data.info.vocab_size, seq_len=data.info.seq_len)
    module, params = ours_from_hf_dir(root / "policy", info)
    _, reference = ours_from_hf_dir(root / "reference", info)
    fn = eval_sums(make_dpo_loss_fn(module, NextToken(), DpoConfig(**dpo)))
    return params, {REFERENCE: reference}, fn


def test_sequence_logps_equal_transformers(models):
    root, tokenizer, data = models
    batch = batch_of(data)
    params, model_state, fn = engine(root, data)
    got = per_pair(fn, params, model_state, batch)
    want = {"chosen": [], "rejected": []}
    for i, rec in enumerate(RECORDS):
        for j, side in enumerate(("chosen", "rejected")):
            tokens, mask = trl_tokens(tokenizer, rec, side)
            # the engine's row is TRL's tokens, its loss mask TRL's completion mask
            assert data.train["tokens"][i, j, : len(tokens)].tolist() == tokens
            assert data.train["segments"][i, j, len(tokens) :].sum() == 0
            assert data.train["loss_mask"][i, j, : len(tokens)].tolist() == mask
            want[side].append(transformers_logps(root / "policy", tokens, mask))
    for side in ("chosen", "rejected"):
        assert np.ptp(want[side]) > 1.0  # (pairs that differ)
        np.testing.assert_allclose(got[f"logps_{side}"], want[side], rtol=1e-5, atol=1e-4)


def trl_step(root, tokenizer, loss: str, beta: float, tmp_path) -> tuple[float, dict]:
    """TRL's DPO loss and logged metrics on the pairs in one batch (policy and reference models)."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    policy, reference = (
        transformers.AutoModelForCausalLM.from_pretrained(root / name, dtype=torch.float32)
        for name in ("policy", "reference")
    )
    args = trl.DPOConfig(
        output_dir=str(tmp_path),
        loss_type=[loss],
        beta=beta,
        report_to="none",
        use_cpu=True,
        bf16=False,  # (TRL's default is bf16 autocast; the engine's check runs in float32)
        max_length=None,
    )
    trainer = trl.DPOTrainer(
        model=policy,
        ref_model=reference,
        args=args,
        train_dataset=datasets.Dataset.from_list(RECORDS),
        processing_class=tokenizer,
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(RECORDS))])
    trainer.model.eval()  # (as the engine's eval step: its metrics are logged under "eval")
    with torch.no_grad():
        value = trainer.compute_loss(trainer.model, batch)
    return float(value), {name: values[-1] for name, values in trainer._metrics["eval"].items()}


@pytest.mark.parametrize("loss, beta", [("sigmoid", 0.1), ("sigmoid", 0.5), ("hinge", 0.3), ("ipo", 0.1)])
def test_loss_and_metrics_equal_trls(models, tmp_path, loss, beta):
    root, tokenizer, data = models
    trl_loss, trl_metrics = trl_step(root, tokenizer, loss, beta, tmp_path)
    params, model_state, fn = engine(root, data, beta=beta, loss=loss)
    sums = jax.device_get(fn(params, model_state, batch_of(data)))
    n = float(sums["count"])
    assert n == len(RECORDS)
    np.testing.assert_allclose(float(sums["loss_sum"]) / n, trl_loss, rtol=1e-4, atol=1e-5)
    if loss == "ipo":  # the loss only: see test_ipo_metrics_are_trls
        return
    check_metrics(sums, trl_metrics)


def check_metrics(sums, trl_metrics):
    n = float(sums["count"])
    ours = {
        "rewards/chosen": sums["rewards_chosen"] / n,
        "rewards/rejected": sums["rewards_rejected"] / n,
        "rewards/margins": (sums["rewards_chosen"] - sums["rewards_rejected"]) / n,
        "rewards/accuracies": sums["correct"] / n,
        "logps/chosen": sums["logps_chosen"] / n,
        "logps/rejected": sums["logps_rejected"] / n,
    }
    assert 0.0 < trl_metrics["rewards/accuracies"] < 1.0  # (pairs on both sides: the accuracy is not trivial)
    for name, value in ours.items():
        np.testing.assert_allclose(float(value), trl_metrics[name], rtol=1e-4, atol=1e-4, err_msg=name)


def test_ipo_metrics_are_trls(models, tmp_path):
    root, tokenizer, data = models
    _, trl_metrics = trl_step(root, tokenizer, "ipo", 0.1, tmp_path)
    params, model_state, fn = engine(root, data, beta=0.1, loss="ipo")
    check_metrics(jax.device_get(fn(params, model_state, batch_of(data))), trl_metrics)
