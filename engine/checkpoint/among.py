"""A run's checkpoints when it trains on some of a job's processes (a sub-mesh sweep's trial:
engine/runtime/processes.py): orbax's options that make the run's chief the primary host and
keep its commits among its own processes, and the handler of its arrays.

Orbax refuses to save an array all of whose shards one process holds once the job has several
processes (it takes it for a pmap-era per-host value that differs between hosts). A trial on
one process's devices holds all of its state that way: it is the whole array, saved like any
other. ArrayHandler.serialize is orbax's less that check (orbax-checkpoint's own code otherwise)."""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import jax
from orbax.checkpoint._src import asyncio_utils
from orbax.checkpoint._src.futures import future
from orbax.checkpoint._src.metadata import array_metadata as array_metadata_lib
from orbax.checkpoint._src.metadata import array_metadata_store as array_metadata_store_lib
from orbax.checkpoint._src.multihost import multihost
from orbax.checkpoint._src.serialization import jax_array_handlers, type_handler_registry, types


class OwnArrayHandler(jax_array_handlers.ArrayHandler):
    """Saves arrays that one process holds whole, in a job of several (a run on its devices alone)."""

    async def serialize(
        self,
        values: Sequence[jax.Array],
        infos: Sequence[types.ParamInfo],
        args: Optional[Sequence[types.SaveArgs]] = None,
    ) -> Sequence[future.Future]:
        args = args or [types.SaveArgs()] * len(values)
        types.check_input_arguments(values, infos, args)
        jax_array_handlers.check_array_values(values, infos)
        self._ext_metadata = dict()
        arrays = []
        for value, info in zip(values, infos):
            if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):  # a random key: its data
                arrays.append(jax.random.key_data(value))
                self._ext_metadata[info.name] = {array_metadata_lib.RANDOM_KEY_IMPL: str(jax.random.key_impl(value))}
            else:
                arrays.append(value)
        futures: list = []
        if self._enable_write_sharding_file:
            futures.append(
                future.CommitFutureAwaitingContractedSignals(
                    asyncio_utils.cancellable(
                        jax_array_handlers._async_serialize_shardings(
                            shardings=[array.sharding for array in arrays], infos=infos, primary_host=self._primary_host
                        ),
                        message="[process=%s] Sharding metadata commit was safely cancelled.",
                        process_index=multihost.process_index(),
                        reraise=False,
                    ),
                    name="serialize_shardings",
                )
            )
        futures.append(
            jax_array_handlers._serialize_arrays(
                arrays=arrays,
                infos=infos,
                args=args,
                dispatcher=self._dispatcher,
                primary_host=self._primary_host,
                replica_id=self._replica_id,
                use_replica_parallel=self._use_replica_parallel,
                min_slice_bytes_for_replica_parallel=self._min_slice_bytes_for_replica_parallel,
                max_replicas_for_replica_parallel=self._max_replicas_for_replica_parallel,
                enable_replica_parallel_separate_folder=self._enable_replica_parallel_separate_folder,
                metadata_key=self._metadata_key,
                ext_metadata=self._ext_metadata,
                array_metadata_store=self._array_metadata_store,
                callback=self._callback,
            )
        )
        return futures


class OwnValidator(array_metadata_store_lib.Validator):
    """Orbax's check of the arrays' metadata at a commit, counting the run's processes, not the job's."""

    def __init__(self, processes: int):
        self.processes = processes

    def _validate_process_count(self, *, ref_process_index: int) -> None:
        if self.processes != 1:
            raise ValueError(
                f"the checkpoint holds array metadata from process {ref_process_index} alone, of the run's "
                f"{self.processes}"
            )


def own_operation_ids(lowest: int) -> None:
    """From now on this process numbers its saves apart from the job's other sub-meshes'
    (`lowest`: the lowest process of this process's sub-meshes: its runs' other processes count alike).

    Orbax keys a save's signals (its step's directories created) in the job's coordination store
    by an operation id that each process counts from 0, the same on every process of a run on all
    of them. Processes saving runs of their own at once (sub-mesh trials within each process)
    would read each other's signals and write before their directories exist; each counts from
    its sub-meshes' own range instead (orbax's OperationIdGenerator)."""
    from orbax.checkpoint._src.futures import synchronization

    generator = synchronization.OperationIdGenerator
    generator._operation_id_counter = itertools.count((lowest + 1) * 10**12)


def among(ids: Sequence[int], name: str) -> tuple:
    """(orbax's MultiprocessingOptions, the PyTree handler's own arguments) for a run on the
    processes `ids` (lowest first) of a larger job; `name` keeps its barriers apart from others'.
    Arrays only: orbax's handlers of numbers and strings write from process 0 alone (a leaf of
    those is refused, by name, instead of left unsaved)."""
    import orbax.checkpoint as ocp

    options = ocp.options.MultiprocessingOptions(
        primary_host=ids[0], active_processes=set(ids), barrier_sync_key_prefix=name
    )
    handler = OwnArrayHandler(primary_host=ids[0], array_metadata_store=array_metadata_store_lib.Store())
    registry = type_handler_registry.create_type_handler_registry((jax.Array, handler))
    return options, {"type_handler_registry": registry, "array_metadata_validator": OwnValidator(len(ids))}
