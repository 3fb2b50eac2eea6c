"""Tables: data.features turns raw rows into the tabular model's inputs (checked by hand on 5
rows), the shipped penguins config reaches a logistic regression's accuracy, resumes exactly
after SIGKILL and gives the one-device losses over 8 devices with its tables sharded, its
export serves raw rows (strings included) with the trainer's eval accuracy, and bad data is
one line naming the file, row and column, exit 2."""

from __future__ import annotations

import math

import jax
import numpy as np
from support.tabular import PENGUINS, ROWS, SPEC, columns_of

from engine.data import features, preprocess


def test_the_model_reads_multi_hot_wide_ids_and_combines_embeddings_without_the_empty_slots():
    from engine.parallel.sharding import unbox
    from models.tabular import WideDeep

    columns = columns_of(ROWS)
    spec = features.fit(features.entries(SPEC), columns, columns)
    inputs = preprocess.transform(columns, spec)
    module = WideDeep(spec, 2, (), 0.0)
    params = unbox(module.init(jax.random.key(0), inputs, train=False))["params"]
    params = jax.tree.map(lambda p: np.random.default_rng(1).standard_normal(p.shape).astype(np.float32), params)
    out = np.asarray(module.apply({"params": params}, inputs, train=False))
    tags = next(f for f in spec["ids"] if f["name"] == "tags")
    expected = np.tile(params["bias"], (5, 1))
    for feature in spec["wide"]:
        where = next(f for f in spec["ids"] if f["name"] == feature["ids"])
        ids = inputs["ids"][:, where["offset"] : where["offset"] + where["slots"]]
        expected += params[f"wide_{feature['name']}"][ids[:, 0]]
    tag_ids = inputs["ids"][:, tags["offset"] : tags["offset"] + tags["slots"]]
    table = params["embedding_tags_embedding"]
    sqrtn = np.stack([table[[i for i in row if i >= 0]].sum(0) / math.sqrt((row >= 0).sum()) for row in tag_ids])
    deep = np.concatenate([inputs["numeric"], sqrtn], axis=1)
    expected += deep @ params["deep_out"]["kernel"] + params["deep_out"]["bias"]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_eight_devices_with_the_tables_sharded_give_the_one_device_losses(make_config):
    from support.parallel import train_losses

    from engine.run.setup import build_run

    one, _ = train_losses(build_run(make_config(PENGUINS, "mesh.num_devices=1")), 12)
    run = build_run(make_config(PENGUINS, "mesh.data=2", "mesh.fsdp=4"))
    specs = {
        name: run.abstract_state.params[name].sharding.spec
        for name in ("embedding_sex_embedding", "wide_island_onehot", "wide_island_x_sex")
    }
    assert all(spec[0] == "fsdp" for spec in specs.values()), specs  # the `vocab` rows split over fsdp
    eight, _ = train_losses(run, 12)
    assert one[-1] < one[0]
    np.testing.assert_allclose(eight, one, rtol=2e-5)
