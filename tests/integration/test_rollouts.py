"""GRPO's rollouts (engine/lm/rollouts.py): the decode program compiled once, its recorded
log-probabilities equal to the update pass's with left-padded prompts of different lengths (pad
ids and pad counts change nothing: MaxText #4016), stops, keys, greedy parity with `sample`'s
generator, scanned = unscanned layers (MaxText #4536), LoRA (the base and the adapters read where
they are), and a mesh splitting data, fsdp and tensor."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from contract.adapters import Adaptation
from engine.data import DataInfo
from engine.lm import finetune, rollouts
from engine.parallel.sharding import unbox
from models import REGISTRY, sampling
from models.configs import LlamaConfig
from models.family import NO_OPTIONS, BuildOptions

INFO = DataInfo("tokens", 8, 8, vocab_size=96, seq_len=32)
TINY = dict(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, mlp_dim=48)
PROMPTS = [[5, 9], [1, 2, 3, 4, 5, 6, 7], [40, 41, 42, 43, 44], [3]]  # four lengths, left-padded together
STOPS = (4, 17, 23, 31, 50, 66, 71, 88)  # some rows stop at one, some run to the end (key 3, asserted)
SPEC = rollouts.DecodeSpec(8, 6, temperature=0.7, top_p=0.9, top_k=40, stop_ids=STOPS, pad_id=95)

COMPILES: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: (
        COMPILES.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
    )
)


def modules(cfg=None, options=NO_OPTIONS):
    family, cfg = REGISTRY["llama"], cfg or LlamaConfig(**TINY)
    return (
        family.build(cfg, INFO, jnp.float32, jnp.float32, options),
        family.build(cfg, INFO, jnp.float32, jnp.float32, options, decode=True),
    )


def initial(module, seed=0):
    params = unbox(module.init(jax.random.key(seed), jnp.zeros((1, 16), jnp.int32), train=False))["params"]
    # random norm scales: a mix-up of layers or norms shows
    return jax.tree_util.tree_map_with_path(
        lambda path, p: (
            p * (1 + 0.3 * jax.random.normal(jax.random.key(7), p.shape))
            if "scale" in jax.tree_util.keystr(path)
            else p
        ),
        params,
    )


@pytest.fixture(scope="module")
def llama():
    """(module, decoding module, params, SPEC's decode program for the PROMPTS' rows): one compile
    the tests share (scanned layers, the default)."""
    module, decoder = modules()
    params = initial(module)
    return module, decoder, params, rollouts.build_decode(decoder, SPEC, params, len(PROMPTS))


def prompts(width=SPEC.max_prompt_tokens, pad_id=0, rows=PROMPTS):
    tokens, mask = rollouts.left_pad(rows, width, pad_id)
    return jnp.asarray(tokens), jnp.asarray(mask)


@functools.partial(jax.jit, static_argnums=0)
def update_logprobs(module, params, tokens, mask, rollout):
    return rollouts.completion_logprobs(
        module, params, tokens, mask, rollout.completion_tokens, rollout.completion_mask, SPEC.temperature
    )


def test_recorded_logprobs_equal_the_update_pass_and_the_program_compiles_once(llama):
    module, _, params, decode = llama
    tokens, mask = prompts()
    other = prompts(rows=[[7] * 8, [8, 9], [1, 2, 3], [60, 61]])
    before = len(COMPILES)
    rollout = decode(params, tokens, mask, jax.random.key(3))
    again, elsewhere = decode(params, tokens, mask, jax.random.key(3)), decode(params, *other, jax.random.key(4))
    assert len(COMPILES) == before  # three calls, new prompts and keys: nothing compiled

    got = jax.tree.map(np.asarray, rollout)
    ends = [next((i for i, t in enumerate(row) if t in STOPS), None) for row in got.completion_tokens]
    assert None in ends and any(end is not None and end < 5 for end in ends), got.completion_tokens
    np.testing.assert_array_equal(got.stopped, [end is not None for end in ends])
    for row, end in enumerate(ends):  # the stop token kept and masked in; pads with log-probability 0 after it
        end = SPEC.max_completion_tokens if end is None else end + 1
        assert got.completion_mask[row, :end].all() and not got.completion_mask[row, end:].any()
        assert (got.completion_tokens[row, end:] == 95).all() and (got.logprobs[row, end:] == 0).all()
    np.testing.assert_array_equal(got.completion_tokens, np.asarray(again.completion_tokens))  # same key
    assert (np.asarray(elsewhere.completion_tokens) != got.completion_tokens).any()

    recomputed = np.asarray(update_logprobs(module, params, tokens, mask, rollout))
    np.testing.assert_allclose(got.logprobs, recomputed, rtol=0, atol=1e-5)
    assert (got.logprobs[got.completion_mask] < 0).all()


def test_in_bfloat16_too_the_recorded_logprobs_are_the_update_passs():
    """The heads give float32 logits made as the fused loss makes them (compute-dtype logits were
    6e-3 apart here: the ratio at GRPO's first update would not be 1)."""
    family, cfg = REGISTRY["llama"], LlamaConfig(**TINY, tie_embeddings=True)
    module, decoder = (family.build(cfg, INFO, jnp.bfloat16, jnp.float32, decode=d) for d in (False, True))
    params = jax.tree.map(lambda p: 3 * p if p.shape == (96, 32) else p, initial(module))  # sharper logits
    tokens, mask = prompts()
    rollout = rollouts.build_decode(decoder, SPEC, params, len(PROMPTS))(params, tokens, mask, jax.random.key(6))
    update = np.asarray(update_logprobs(module, params, tokens, mask, rollout))
    np.testing.assert_allclose(np.asarray(rollout.logprobs), update, rtol=0, atol=1e-5)


def test_pad_ids_and_pad_counts_change_nothing(llama):
    module, decoder, params, decode = llama
    key = jax.random.key(5)
    first = decode(params, *prompts(), key)
    first_update = np.asarray(update_logprobs(module, params, *prompts(), first))
    wide = rollouts.DecodeSpec(**{**SPEC.__dict__, "max_prompt_tokens": 11})
    wide_decode = rollouts.build_decode(decoder, wide, params, len(PROMPTS))
    for program, (tokens, mask) in ((decode, prompts(pad_id=13)), (wide_decode, prompts(11, pad_id=61))):
        rollout = program(params, tokens, mask, key)
        np.testing.assert_array_equal(np.asarray(rollout.completion_tokens), np.asarray(first.completion_tokens))
        np.testing.assert_allclose(np.asarray(rollout.logprobs), np.asarray(first.logprobs), rtol=0, atol=1e-5)
        update = np.asarray(update_logprobs(module, params, tokens, mask, rollout))
        np.testing.assert_allclose(update, first_update, rtol=0, atol=1e-5)
    # a prompt alone (no padding at all) scores as it does in the padded batch
    alone = prompts(len(PROMPTS[1]), rows=[PROMPTS[1]])
    alone = update_logprobs(module, params, *alone, jax.tree.map(lambda x: x[1:2], first))
    np.testing.assert_allclose(np.asarray(alone)[0], first_update[1], rtol=0, atol=1e-5)


def test_top_k_1_gives_the_sample_commands_greedy_tokens(llama):
    _, decoder, params, _ = llama
    greedy = sampling.generate(decoder, params, PROMPTS, SPEC.max_completion_tokens, stop_ids=STOPS)
    spec = rollouts.DecodeSpec(**{**SPEC.__dict__, "top_k": 1})
    rollout = rollouts.build_decode(decoder, spec, params, len(PROMPTS))(params, *prompts(), jax.random.key(9))
    drawn = [list(t[m]) for t, m in zip(np.asarray(rollout.completion_tokens), np.asarray(rollout.completion_mask))]
    assert drawn == greedy and len(set(map(len, drawn))) > 1, drawn  # (some stopped, some not)


def stacked(params, layers: int):
    """Unscanned Llama parameters (layer_0, layer_1, …) in nn.scan's layout (layers/block, stacked)."""
    rest = {k: v for k, v in params.items() if not k.startswith("layer_")}
    block = jax.tree.map(lambda *xs: jnp.stack(xs), *(params[f"layer_{i}"] for i in range(layers)))
    return {**rest, "layers": {"block": block}}


def test_scanned_layers_decode_as_unscanned(llama):
    _, _, _, scanned_decode = llama  # (scan_layers: the default)
    module, decoder = modules(LlamaConfig(**TINY, scan_layers=False))
    params = initial(module, seed=1)
    tokens, mask = prompts()
    key = jax.random.key(11)
    plain = rollouts.build_decode(decoder, SPEC, params, len(PROMPTS))(params, tokens, mask, key)
    scanned = scanned_decode(stacked(params, TINY["num_layers"]), tokens, mask, key)
    np.testing.assert_array_equal(np.asarray(scanned.completion_tokens), np.asarray(plain.completion_tokens))
    np.testing.assert_allclose(np.asarray(scanned.logprobs), np.asarray(plain.logprobs), rtol=0, atol=1e-5)


def test_lora_decodes_the_base_with_the_current_adapters(llama):
    _, _, _, plain_decode = llama
    adapt = Adaptation(lora_rank=2, lora_alpha=4.0, lora_targets=("query", "value", "down"))
    adapted, adapted_decoder = modules(options=BuildOptions(adaptation=adapt))
    adapters, frozen = finetune.split(initial(adapted))
    adapters = jax.tree.map(lambda a: a + 0.3 * jax.random.normal(jax.random.key(2), a.shape), adapters)  # B ≠ 0
    both = _merge(frozen, adapters)  # one tree of the two trees' arrays, as the run's model_variables
    tokens, mask = prompts()
    key = jax.random.key(12)
    rollout = rollouts.build_decode(adapted_decoder, SPEC, both, len(PROMPTS))(both, tokens, mask, key)
    weights = finetune.merged(both, REGISTRY["llama"].language_model.projections, adapt.lora_alpha / adapt.lora_rank)
    merged = plain_decode(weights, tokens, mask, key)  # W + (alpha / rank)·A·B, no adapters
    np.testing.assert_array_equal(np.asarray(rollout.completion_tokens), np.asarray(merged.completion_tokens))
    np.testing.assert_allclose(np.asarray(rollout.logprobs), np.asarray(merged.logprobs), rtol=0, atol=1e-5)
    update = np.asarray(update_logprobs(adapted, both, tokens, mask, rollout))
    np.testing.assert_allclose(np.asarray(rollout.logprobs), update, rtol=0, atol=1e-5)
    base = plain_decode(frozen, tokens, mask, key)
    assert (np.asarray(base.completion_tokens) != np.asarray(rollout.completion_tokens)).any()  # the adapters count


def _merge(base, adapters):
    """One flax params tree of the frozen base's and the adapters' leaves (engine/run/step.py model_variables)."""
    from flax.traverse_util import flatten_dict, unflatten_dict

    return unflatten_dict({**flatten_dict(base), **flatten_dict(adapters)})


def test_a_mesh_of_data_fsdp_and_tensor_decodes_as_one_device(llama):
    from engine.parallel.axes import default_rules
    from engine.parallel.mesh import build_mesh
    from engine.parallel.sharding import ActivationLayout, batch_sharding, layouts, tree_shardings

    _, _, params, decode = llama
    tokens, mask = prompts()  # 4 rows: split over data x fsdp
    key = jax.random.key(13)
    alone = decode(params, tokens, mask, key)
    mesh = build_mesh({"data": 2, "fsdp": 2, "tensor": 2}, {}, jax.devices()[:8])
    module, meshed = modules(options=BuildOptions(layout=ActivationLayout(mesh)))
    boxed = jax.eval_shape(lambda: module.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32), train=False))
    shardings = tree_shardings(boxed["params"], layouts(boxed["params"], default_rules(), mesh), mesh)
    split = {axis for s in jax.tree.leaves(shardings) for part in s.spec if part for axis in np.atleast_1d(part)}
    assert {"fsdp", "tensor"} <= split, split  # the parameters split over both
    placed, data = jax.device_put(params, shardings), batch_sharding(mesh)
    program = rollouts.build_decode(meshed, SPEC, placed, len(PROMPTS), data)
    rollout = program(placed, jax.device_put(tokens, data), jax.device_put(mask, data), key)
    assert rollout.completion_tokens.sharding.is_equivalent_to(data, 2)
    np.testing.assert_array_equal(np.asarray(rollout.completion_tokens), np.asarray(alone.completion_tokens))
    np.testing.assert_allclose(np.asarray(rollout.logprobs), np.asarray(alone.logprobs), rtol=0, atol=1e-5)


def test_rollout_keys_are_a_function_of_seed_and_step():
    rng = jax.random.key_data(jax.random.key(0))
    draws = [jax.random.key_data(rollouts.rollout_key(rng, step)) for step in (1, 1, 2)]
    assert (draws[0] == draws[1]).all() and (draws[0] != draws[2]).any()
    dropout = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(rng), 1))
    assert (draws[0] != dropout).any()  # a stream apart from dropout's


@pytest.mark.parametrize(
    "change, message",
    [
        ({"temperature": 0.0}, "temperature=0.0 must be a finite number > 0"),
        ({"temperature": float("inf")}, "temperature=inf must be a finite number > 0"),
        ({"top_p": 0.0}, "top_p=0.0 must be in (0, 1]"),
        ({"max_completion_tokens": 0}, "max_completion_tokens=0 must be >= 1"),
    ],
)
def test_bad_decode_settings_name_the_setting(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        rollouts.DecodeSpec(**{**SPEC.__dict__, **change})
