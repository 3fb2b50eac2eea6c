"""The training loop: wires the built Run to batches, metrics, evaluation and checkpoints."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax

from engine.checkpoint import Checkpointer
from engine.config import Config, save_config, to_yaml
from engine.data import Prefetcher
from engine.distributed import barrier
from engine.errors import UsageError
from engine.evaluator import evaluate
from engine.metrics import MetricWriter
from engine.perf import Goodput, StepTrace, Throughput, Window, summary_text
from engine.preemption import Preempted, PreemptionWatch, end_startup, starting
from engine.rundir import METRICS, WorkdirLock, drop_records_after, storage_errno, storage_error
from engine.setup import Run, build_run, with_config_hparams
from engine.step import TRAIN_METRICS
from engine.watchdog import Watchdog

__all__ = ["fit", "FitResult", "NonFiniteLoss", "Preempted", "initial_state"]


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or Inf (train.nan_policy=stop)."""


@dataclass
class FitResult:
    state: object  # the final TrainState
    losses: dict[int, float] = field(default_factory=dict)  # step → train loss of that step
    eval_metrics: dict[str, float] = field(default_factory=dict)  # the last evaluation
    summary: dict = field(default_factory=dict)  # time, goodput and MFU of this run


def fit(cfg: Config, run: Run | None = None, started: float | None = None) -> FitResult:
    """Trains to cfg.train.steps from the newest checkpoint (or from scratch), logging and evaluating.
    A full, read-only or unwritable workdir is one StorageError (exit 2): the unfinished save is
    removed, the newest complete checkpoint kept, and a re-run resumes from it."""
    try:
        return _fit(cfg, run, started)
    except Exception as e:
        number = storage_errno(e, Path(cfg.workdir))
        if number is None or isinstance(e, UsageError):
            raise
        if jax.process_index() == 0:  # the lock holder: the unfinished save is its own
            for partial in Path(cfg.workdir, "checkpoints").glob("*.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)
        doing = "saving a checkpoint" if "checkpoint" in str(e) else "writing the run's files"
        raise storage_error(Path(cfg.workdir), number, doing) from None


def _fit(cfg: Config, run: Run | None, started: float | None) -> FitResult:
    goodput = Goodput(started or time.time())
    workdir, is_chief, timeout = Path(cfg.workdir), jax.process_index() == 0, cfg.distributed.barrier_timeout
    with contextlib.ExitStack() as closing:  # closed in reverse order, on success or failure
        watchdog = closing.enter_context(contextlib.closing(Watchdog(
            dataclasses.asdict(cfg.watchdog), workdir, jax.process_index())))
        run, checkpointer, state, start, meta = _start(cfg, run, started, goodput, closing, watchdog)
        watchdog.enter("step")
        end_startup()  # from here a signal is noted, and the loop saves and exits
        total, per_call, per_block = cfg.train.steps, run.inputs.steps_per_call, run.inputs.steps_per_block
        writer = closing.enter_context(contextlib.closing(MetricWriter(
            workdir, enabled=is_chief, total_steps=total, start_step=start, progress=cfg.log.progress,
            tensorboard=cfg.log.tensorboard)))
        batches = closing.enter_context(contextlib.closing(Prefetcher(run.train_block, start // per_block,
                                                                      cfg.data.prefetch)))  # blocks of batches
        preemption = closing.enter_context(contextlib.closing(PreemptionWatch()))
        rates = Throughput(run.cost, cfg.train.global_batch_size,
                           cfg.train.global_batch_size * run.model.family.task.tokens_per_example(run.dataset.info),
                           run.mesh.devices.flat[0], cfg.train.compute_dtype, run.compile_cache)
        result, block, last_saved = FitResult(state), None, start or None
        window = Window.resumed(start, meta.get("window"),  # the log window a checkpoint cut in two
                                len(TRAIN_METRICS) + len(run.dataset.info.sources))
        watchdog.watch(window.metrics)
        if run.inputs.resident_bytes and start < total:
            writer.message(_resident_message(run))

        config_text = to_yaml(cfg)  # once: it takes ~0.1 s

        def save(step):
            with _paused(window, goodput, "checkpoint_seconds"), watchdog.phase("save"):
                meta = {"step": step, "data": {"next_step": step, "seed": cfg.seed}, "config": config_text,
                        "window": window.carried()}
                checkpointer.save(step, run.compiled.from_step_layout(state), meta)  # returns once its copy is dispatched

        trace = closing.enter_context(contextlib.closing(StepTrace(cfg.log.profile_steps, start, workdir)))
        for step in range(start, total, per_call):
            if block is None or step % per_block == 0:
                block = next(batches)
            trace.before(step)
            watchdog.beat()
            state, metrics = _dispatch(run, state, block, goodput)  # steps [step, step + per_call)
            window.add(metrics, per_call)
            writer.advance(per_call)
            done = step + per_call
            if trace.after(done, metrics):
                writer.message(trace.message())
            if _due(cfg.log.every_steps, done, total):
                losses = _log_train(window, done, cfg.train.nan_policy, writer, rates, goodput,
                                    run.dataset.info.sources)
                result.losses.update({s: loss for s, loss in losses.items() if s > start})  # this call's steps
                window = Window(done)
                watchdog.watch(window.metrics)
            if _due(cfg.eval.every_steps, done, total):
                with _paused(window, goodput, "eval_seconds"), watchdog.phase("eval"):  # not training throughput
                    result.eval_metrics = _evaluate(run, state, done, writer, cfg.train.nan_policy)
            if _due(cfg.checkpoint.every_steps, done, total):
                save(done)
                last_saved = done
            if preemption.should_stop(step + 1, done):
                if last_saved != done:
                    save(done)
                checkpointer.wait()
                raise Preempted(done, preemption.signum)
        if start >= total:
            writer.message(f"already finished: the newest checkpoint is at step {start} of {total}; to train again "
                           f"from scratch give another --workdir, to train longer raise train.steps")
        with _paused(window, goodput, "checkpoint_seconds"), watchdog.phase("save"):
            checkpointer.wait()  # the last save is complete before the run reports success
        barrier("finished", timeout)
        goodput.steps_run, goodput.data_wait_seconds = total - start, batches.wait_seconds  # waits are in the loop
        if total > start:
            timing = goodput.summary(time.time())
            result.summary = {**timing, **rates.summary(timing["mean_step_seconds"]),
                              **({"profile_dir": str(trace.directory)} if trace.traced else {})}
            writer.write(total, "summary", result.summary)
            writer.message(summary_text(result.summary))
        if preemption.requested and total > start:  # a signal during the final save: it completed, and so did the run
            raise Preempted(total, preemption.signum)
    result.state = state
    return result


def _start(cfg: Config, run: Run | None, started: float | None, goodput: Goodput, closing: contextlib.ExitStack,
           watchdog: Watchdog):
    """Claims the workdir, builds (compiles) the run, restores: (run, checkpointer, state, start
    step, checkpoint meta). A SIGTERM or SIGINT meanwhile ends the process at once (launched from
    the command line: engine.preemption.note_signals); there is nothing new to save."""
    workdir, is_chief, timeout = Path(cfg.workdir), jax.process_index() == 0, cfg.distributed.barrier_timeout
    if is_chief:  # one job per workdir: claimed before compiling and before anything is written
        _claim(workdir, closing)
    starting("loading data and compiling")
    if run is None or started is not None:  # a run built before the clock started was not compiled on it
        run = run or build_run(cfg)
        goodput.compile_seconds = run.compiled.compile_seconds
    if is_chief:
        _write_run_files(cfg, run, workdir)
    checkpointer = closing.enter_context(contextlib.closing(Checkpointer(
        workdir / "checkpoints", cfg.checkpoint.keep, timeout_seconds=timeout, staging=cfg.checkpoint.staging,
        verify=cfg.checkpoint.verify)))
    watchdog.enter("restore")
    starting("restoring")
    state, start, meta = initial_state(run, checkpointer)
    state = run.compiled.to_step_layout(with_config_hparams(state, cfg))
    barrier(f"restored_step_{start}", timeout)  # every process starts from the same checkpoint
    if is_chief:
        goodput.redone_steps = drop_records_after(workdir / METRICS, start)
    return run, checkpointer, state, start, meta


def _write_run_files(cfg: Config, run: Run, workdir: Path) -> None:
    """config.yaml, and the tokenizer the run's text is read back with (sample, export)."""
    save_config(cfg, workdir / "config.yaml")
    if run.dataset.info.tokenizer:
        shutil.copyfile(run.dataset.info.tokenizer, workdir / "tokenizer.json")


def _resident_message(run: Run) -> str:
    return (f"data: the train split ({run.inputs.resident_bytes / 2**20:.1f} MiB) lives on every device "
            f"(data.placement={run.cfg.data.placement}); each step gathers its rows on the device")


def _dispatch(run: Run, state, block, goodput: Goodput):
    """One call of the train step, its host time sampled: dispatch, and any wait for the device."""
    began = time.perf_counter()
    state, metrics = run.compiled.train_step(state, block)
    dispatched = time.perf_counter()
    goodput.dispatch_seconds += dispatched - began
    if run.sync_each_step or goodput.first_step_at is None:
        jax.block_until_ready(metrics)
        goodput.device_wait_seconds += time.perf_counter() - dispatched
        goodput.first_step_at = goodput.first_step_at or time.time()
    return state, metrics


def initial_state(run: Run, checkpointer: Checkpointer):
    """(state, step, meta): the workdir's newest readable checkpoint, else checkpoint.restore_from,
    else fresh (meta: the checkpoint's JSON, {} for a fresh or another run's state)."""
    cfg = run.cfg
    restored = checkpointer.restore(run.abstract_state)
    if restored is None and cfg.checkpoint.restore_from:
        source = Checkpointer(cfg.checkpoint.restore_from, cfg.checkpoint.keep, read_only=True,
                              verify=cfg.checkpoint.verify)
        if cfg.checkpoint.restore_mode == "params":
            params, _ = source.restore_params(run.abstract_state.params)
            return run.init_state().replace(params=params), 0, {}
        restored = source.restore(run.abstract_state)
        if restored is None:
            raise UsageError(f"checkpoint.restore_from={cfg.checkpoint.restore_from} holds no complete checkpoint")
    state, start, meta = (restored.state, restored.step, restored.meta) if restored else (run.init_state(), 0, {})
    if start % run.inputs.steps_per_call:
        per_call = run.inputs.steps_per_call
        raise UsageError(f"the run resumes at step {start}, which is not a multiple of train.steps_per_call="
                         f"{per_call}; set train.steps_per_call to a divisor of {start} (e.g. 1) for this run")
    return state, start, meta


def _claim(workdir: Path, closing: contextlib.ExitStack) -> None:
    """Takes the workdir's lock for the life of `closing`; a workdir created here is removed
    again if the run stops before writing anything into it (a bad config or bad data)."""
    created = not workdir.exists()
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        closing.enter_context(WorkdirLock(workdir))
    except OSError as e:  # a read-only or unwritable place: said before anything is compiled
        if storage_errno(e, workdir) is None:
            raise
        raise storage_error(workdir, storage_errno(e, workdir), "claiming the workdir") from None
    if created:
        unused = lambda: [p.name for p in workdir.iterdir()] == [".lock"] and shutil.rmtree(workdir)  # noqa: E731
        closing.callback(unused)
        starting("starting", cleanup=unused)  # also when a signal ends start-up


def _due(every: int, done: int, total: int) -> bool:
    """Is an every-N-steps action due after step `done`? (0 = only at the end)"""
    return (every and done % every == 0) or done == total


@contextlib.contextmanager
def _paused(window: Window, goodput: Goodput, account: str):
    """Time spent inside is taken out of the window's step time and charged to goodput's `account`."""
    began = time.perf_counter()
    try:
        yield
    finally:
        seconds = time.perf_counter() - began
        window.pause(seconds)
        setattr(goodput, account, getattr(goodput, account) + seconds)


def _log_train(window: Window, done: int, nan_policy: str, writer: MetricWriter, rates: Throughput,
               goodput: Goodput, sources: tuple[str, ...] = ()) -> dict[int, float]:
    """Writes the window's train record (the loop's only regular host sync); its step losses.
    A mixture adds `share_<source>`: each source's share of the window's trained tokens."""
    waited = time.perf_counter()
    host = window.to_host()
    goodput.device_wait_seconds += time.perf_counter() - waited
    _check_finite(host, window.start, nan_policy, writer)
    goodput.loop_seconds += window.seconds()
    count = sum(m["count"] for m in host)
    shares = {}
    if sources and "source_tokens" in host[0]:
        per_source = [sum(m["source_tokens"][k] for m in host) for k in range(len(sources))]
        shares = {f"share_{name}": tokens / max(sum(per_source), 1.0) for name, tokens in zip(sources, per_source)}
    writer.write(done, "train", {
        "loss": sum(m["loss_sum"] for m in host) / count, "accuracy": sum(m["correct"] for m in host) / count,
        "grad_norm": sum(m["grad_norm"] for m in host) / len(host), "learning_rate": host[-1]["learning_rate"],
        **_routing(host, count), **shares, **rates.per_step(window.seconds() / max(window.timed_steps, 1))})
    return {window.start + offset + 1: m["loss_sum"] / m["count"] for offset, m in enumerate(host)}


def _routing(host: list[dict], count: float) -> dict[str, float]:
    """A mixture of experts' window: its load-balancing loss (the objective's term beside the
    loss) and the token-to-expert assignments dropped for want of expert capacity."""
    routed = sum(m["routed"] for m in host)
    if not routed:  # no expert layers
        return {}
    dropped = sum(m["dropped"] for m in host)
    return {"moe_aux_loss": sum(m["aux_loss"] for m in host) / count, "moe_dropped_tokens": dropped,
            "moe_dropped_fraction": dropped / routed}


def _evaluate(run: Run, state, step: int, writer: MetricWriter, nan_policy: str) -> dict[str, float]:
    """Evaluates and logs; a non-finite eval loss is handled as a non-finite train loss is."""
    metrics = evaluate(run, state)
    writer.write(step, "eval", metrics)
    if not math.isfinite(metrics["loss"]):
        text = (f"eval loss is {metrics['loss']} at step {step}; check the eval data for NaN or infinite values, "
                f"or lower optimizer.learning_rate")
        if nan_policy == "stop":
            raise NonFiniteLoss(text)
        writer.message(f"warning: {text}")
    return metrics


def _check_finite(host_window: list[dict], first_step: int, policy: str, writer: MetricWriter) -> None:
    for offset, metrics in enumerate(host_window):
        loss = metrics["loss_sum"] / max(metrics["count"], 1.0)
        if not math.isfinite(loss):
            step = first_step + offset + 1
            text = (f"loss is {loss} at step {step}; lower optimizer.learning_rate, set "
                    f"optimizer.grad_clip_norm, or check the data")
            if policy == "stop":
                raise NonFiniteLoss(text)
            writer.message(f"warning: {text}")
            return
