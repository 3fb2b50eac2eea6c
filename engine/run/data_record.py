"""What a resumed run proves of its data (data.name=chat and preferences): each checkpoint's meta
keeps the sha256 of the train and eval arrays as rendered and tokenized, and of the files they came
from (data.path, data.eval_path, the tokenizer, the chat template); a run that resumes from its own
checkpoint compares its data with them and refuses (UsageError, exit 2) data that is not what it
trained on, naming the file or the template that changed.

A chat template may call strftime_now() (Llama 3's write "Today Date: ..." into the system
header): its time is fixed at the run's first start and recorded in WORKDIR/template_time.json,
and every later start of the run (a resume, a restart, the evaluator) renders with the recorded
time, so that a run resumed on another day trains on the text it started with.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Optional

import numpy as np

from engine.config.dpo_objective import REF_LOGPS
from engine.data import Dataset, load_dataset
from engine.data.chat_data import MODEL_TEXT_SOURCES
from engine.errors import UsageError
from engine.lm.template_clock import TIME_FORMAT, fixed_template_time
from engine.runtime.processes import current
from engine.runtime.rundir import sha256_file, write_atomic

META = "data_record"  # the checkpoint meta's record of the data (`record`)
TEMPLATE_TIME = "template_time.json"  # in the workdir: {"time": the local time strftime_now() gives}
CHAT_TEMPLATE = "chat template"  # the record's key of the template files' sha256
TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja")  # where a model directory keeps its template


def load_rendered(cfg, data) -> Dataset:
    """load_dataset(data) (`data`: the run's data section, its tokenizer resolved) with a chat
    template's strftime_now() at the run's recorded first start, or now where there is none yet
    (DataInfo.template_time says which: the chief records it, `checked_record`)."""
    if data.name not in MODEL_TEXT_SOURCES:
        return load_dataset(data)
    when = recorded_time(Path(cfg.workdir).expanduser()) or time.strftime(TIME_FORMAT)
    if current().count > 1:  # (a fresh start: each clock could read another day) the chief's time
        sent = np.frombuffer(when.encode().ljust(32)[:32], np.uint8)  # (one shape on every process)
        when = bytes(current().broadcast(sent)).decode().strip()
    with fixed_template_time(time.strptime(when, TIME_FORMAT)):
        dataset = load_dataset(data)
    return dataclasses.replace(dataset, info=dataclasses.replace(dataset.info, template_time=when))


def recorded_time(workdir: Path) -> str:
    """The time template_time.json records ("" where there is none); UsageError where it does not read."""
    path = workdir / TEMPLATE_TIME
    if not path.is_file():
        return ""
    try:
        when = json.loads(path.read_text(encoding="utf-8"))["time"]
        time.strptime(when, TIME_FORMAT)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise UsageError(
            f"{path} does not read as the time the run's chat template renders with ({type(e).__name__}: {e}); "
            f'restore it from a copy of the workdir, or write {{"time": "YYYY-MM-DDTHH:MM:SS"}} (the run\'s start)'
        ) from None
    return str(when)


def _arrays_digest(split: dict) -> str:
    """sha256 of a split's arrays (names, shapes, dtypes and bytes; not the reference's values)."""
    h = hashlib.sha256()
    for name in sorted(split):
        if name != REF_LOGPS:
            array = np.ascontiguousarray(split[name])
            h.update(f"{name}:{array.shape}:{array.dtype}".encode())
            h.update(array.tobytes())
    return h.hexdigest()


def record(data, dataset: Dataset) -> dict:
    """The record of a chat or preferences run's data (`data`: its section, the tokenizer resolved)
    for its checkpoints' meta; {} for other data."""
    if data.name not in MODEL_TEXT_SOURCES or not isinstance(dataset.train, dict):
        return {}
    tokenizer = Path(dataset.info.tokenizer)
    paths = {"data.path": str(Path(data.path).expanduser()), "data.tokenizer": str(tokenizer)}
    if data.eval_path:
        paths["data.eval_path"] = str(Path(data.eval_path).expanduser())
    templates = [tokenizer.parent / name for name in TEMPLATE_FILES if (tokenizer.parent / name).is_file()]
    digests = {key: sha256_file(Path(path)) for key, path in paths.items()}
    digests[CHAT_TEMPLATE] = hashlib.sha256(b"".join(sha256_file(path).encode() for path in templates)).hexdigest()
    reads_time = any(b"strftime_now" in path.read_bytes() for path in templates)
    return {
        META: {
            "train": _arrays_digest(dataset.train),
            "eval": _arrays_digest(dataset.eval),
            "files": digests,
            "paths": paths,
            "template": [str(path) for path in templates],
            "template_time": dataset.info.template_time,
            "reads_time": reads_time,
        }
    }


def check(recorded: dict, now: dict, step: int) -> None:
    """UsageError when the data now (`now`: record's) is not what the checkpoint at `step` recorded."""
    was, got = recorded.get(META), now.get(META)
    if not isinstance(was, dict) or not got:
        return  # (a checkpoint from before the record, or data without one)
    changed = [split for split in ("train", "eval") if was.get(split) != got[split]]
    if not changed:
        return
    files = was["files"] if isinstance(was.get("files"), dict) else {}
    edited = [key for key, digest in got["files"].items() if key in files and files[key] != digest]
    template = f"the chat template ({', '.join(got['template']) or 'none'})"
    if edited:
        key = edited[0]
        named = template if key == CHAT_TEMPLATE else f"{key}={got['paths'][key]}"
        why = f"{named} is not the one it trained on (edited, reordered or replaced since: its sha256 differs)"
    elif got["reads_time"]:
        why = (
            f"{template} reads the date or time (strftime_now): it rendered {was.get('template_time') or 'another'} "
            f"when the run started and {got['template_time']} now (the workdir's {TEMPLATE_TIME} records the run's)"
        )
    else:
        why = "the rendering or the tokenizing of the same files changed"
    raise UsageError(
        f"the {' and '.join(changed)} data as rendered and tokenized differs from what this run trained on (its "
        f"checkpoint at step {step} records their sha256): {why}; resume with the data it started with, or train "
        "on this data from its start in a new --workdir"
    )


def checked_record(cfg, data, dataset: Dataset, meta: dict, own: bool, chief: bool) -> dict:
    """The data's record for the checkpoints' meta, checked against the run's own checkpoint (`own`:
    `meta` is this run's, not checkpoint.restore_from's); the chief records the template's time."""
    now = record(data, dataset)
    if own:
        check(meta, now, int(meta.get("step", 0)))
    workdir = Path(cfg.workdir).expanduser()
    if now and chief and not (workdir / TEMPLATE_TIME).is_file():
        write_atomic(workdir / TEMPLATE_TIME, json.dumps({"time": dataset.info.template_time}) + "\n")
    return now


def own_meta(cfg, meta: dict, own_steps: bool) -> Optional[dict]:
    """`meta` where it is the workdir's own checkpoint's (a resume), None where it is none or
    checkpoint.restore_from's (`own_steps`: the workdir has checkpoints of its own)."""
    if not meta:
        return None
    if cfg.checkpoint.restore_from and not own_steps and meta.get("tier") != "local":
        return None
    return meta
