"""The ``Checkpointer``: atomic saves, optional asynchronous writing, and loads that wait for both.

One instance per strategy (held by the shared core), so Fabric, the Trainer and standalone scripts get the
same guarantees:

* a checkpoint appears at its path only when complete (see :mod:`modelpar.checkpoint._commit`);
* with ``async_save=True``, ``save`` returns once the state is staged (every tensor copied once to CPU
  memory, everything else deep-copied: see :mod:`modelpar.checkpoint._staging`) and the writing goes on in
  a background thread over a
  dedicated gloo process group, so it never interleaves with the training's own collectives; the next
  ``save``, any ``load`` and ``wait()`` wait for it, and ``close()`` also releases the staging memory;
* a failure on one rank (preparing, writing, committing, in the background too) raises on every rank, at
  once or at the next ``wait()``, instead of leaving the others in a collective until the timeout (see
  :mod:`modelpar.checkpoint._agree`); so does a path that the processes do not all see alike.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.optim import Optimizer

from modelpar.checkpoint import _io
from modelpar.checkpoint._agree import agree, gather, node_leader, not_shared_error, run_agreed
from modelpar.checkpoint._commit import (
    Trash,
    commit,
    commit_among,
    new_token,
    remove_stale,
    reuse_as_staging,
    staging_path,
)
from modelpar.checkpoint._dcp_read import root_cause, single_process
from modelpar.checkpoint._format import DCP_METADATA, USER_METADATA, foreign_entries, replaceable_folder
from modelpar.checkpoint._overwrite import local_writer, open_over
from modelpar.checkpoint._remote import (
    Location,
    RemotePath,
    commit_prefix,
    dcp_writer,
    prepare_prefix,
    to_location,
    upload_file,
)
from modelpar.checkpoint._staging import Staging, live_storages, private_tensors
from modelpar.checkpoint._state import FilterFns, split_state

__all__ = ["Checkpointer"]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _sees(entry: Path) -> bool:
    """Whether ``entry`` exists here; asked again briefly, for a file system slow to show a new name."""
    for _ in range(5):
        if entry.exists():
            return True
        time.sleep(0.1)
    return False


def _refuse_other_folders(path: Location, *, full: bool) -> None:
    """Refuse to save over a folder (or a URL prefix) of the user's files where the save would replace it: in the
    full format (a file cannot sit where a folder is), and at a URL. A local distributed checkpoint is written
    among the user's files instead, keeping them, as Lightning's strategy does (:func:`_local_folder_of_users`).
    """
    if path.is_dir() and not path.is_symlink() and not replaceable_folder(path):
        if not full and isinstance(path, Path):
            return
        names: list[str] = sorted(entry.name for entry in path.iterdir())
        shown = ", ".join(map(repr, names[:3]))
        raise IsADirectoryError(
            f"Refusing to save to {str(path)!r}: the path exists and is a directory that is not a checkpoint (it"
            f" holds {shown} ..., but no {DCP_METADATA!r} or {USER_METADATA!r}), and saving would replace it,"
            " deleting what is in it. Choose a path inside it, an empty folder, or a new path."
        )


def _local_folder_of_users(path: Location) -> bool:
    """Whether ``path`` is a local folder holding files no checkpoint writes: a distributed save keeps them."""
    return isinstance(path, Path) and path.is_dir() and not path.is_symlink() and bool(foreign_entries(path))


class Checkpointer:
    """Saves and loads checkpoints for one run; collective: every rank calls the same methods in order."""

    def __init__(
        self,
        *,
        async_save: bool = False,
        timeout: timedelta | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.async_save = async_save
        self.timeout = timeout  # of the background-save group (the strategy passes its own); None: torch's default
        self.storage_options = dict(storage_options or {})  # for checkpoints at URLs: passed on to fsspec
        self._pending: Future[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._async_group: Any = None
        self._staging: Staging | None = None
        self._outstanding: str | None = None  # what a background save does, until ``wait``: the same on every rank
        self._trash = Trash()  # rank 0: previous checkpoints, deleted after their commit in the background
        self._spare: Path | None = None  # rank 0: the checkpoint the last save replaced, set aside (see _prepare)
        self.staged_bytes = 0  # this rank's bytes copied by the last asynchronous save's staging

    # -- saving ------------------------------------------------------------------------------------------
    def location(self, path: str | Path | RemotePath) -> Location:
        """``path`` as a local path, or as a URL (``s3://`` ...) with this checkpointer's ``storage_options``."""
        return to_location(path, self.storage_options)

    def save(
        self,
        path: str | Path | RemotePath,
        state: Mapping[str, Any],
        *,
        full: bool,
        filter: FilterFns | None = None,
        known_modules: Sequence[nn.Module] = (),
    ) -> None:
        """Save models, optimizers and metadata in ``state`` to ``path`` in the distributed or full format."""
        self.wait()
        split = split_state(state, known_modules)
        if not split.modules and not split.optimizers:
            raise ValueError(
                "Could not find a distributed model in the provided checkpoint state: it contains no model and no"
                " optimizer. Pass them in like"
                " `save(path, {'model': model, 'optimizer': optimizer, ...})`, set up through the strategy first."
            )
        tensors, metadata = _io.gather_state(split, full=full, filters=filter)
        optimizers = [optimizer for optimizer, _ in split.optimizers.values()]
        modules = [*split.modules.values(), *known_modules]
        self.write(path, tensors, metadata, full=full, live_modules=modules, live_optimizers=optimizers)

    def write(
        self,
        path: str | Path | RemotePath,
        tensors: dict[str, Any],
        metadata: dict[str, Any],
        *,
        full: bool,
        live_modules: Sequence[nn.Module] = (),
        live_optimizers: Sequence[Optimizer] = (),
    ) -> None:
        """Write already-gathered state: ``tensors`` (state dicts) and ``metadata`` (anything picklable).

        Distributed: ``tensors`` are this rank's sharded state dicts, written with DCP; ``metadata`` goes to
        ``meta.pt``. Full: rank 0 writes ``{**tensors, **metadata}`` to one file. Atomic either way, and
        asynchronous when the checkpointer is: then the state is a snapshot when this returns. Distributed:
        every tensor is copied once (take the shards on their device, not offloaded first). Full: ``tensors``
        are the full state dicts gathered to the CPU, fresh copies already, written as they are, except the
        tensors that share memory with ``live_modules`` or ``live_optimizers`` (the models and optimizers the
        state comes from: list them all), which are copied; ``metadata`` is copied whole.
        """
        self.wait()
        path = self.location(path)
        leader = _rank() == 0
        where = repr(str(path))

        def prepare() -> str:
            if isinstance(path, RemotePath):
                _refuse_other_folders(path, full=full)
                token = new_token()
                if not full:
                    prepare_prefix(path, token)
                    buffer = io.BytesIO()
                    torch.save(metadata, buffer)
                    (path / USER_METADATA).write_bytes(buffer.getvalue())
                return token
            token = self._prepare(path, full=full)
            if not full:  # ``meta.pt`` goes in with the staging folder: one agreement (collective) for both
                torch.save(metadata, staging_path(path, token) / USER_METADATA)
            return token

        token = run_agreed(f"Preparing the save to {where}", prepare, here=leader)[0]
        if isinstance(path, Path):
            staged = staging_path(path, token)
            self._check_shared(path, staged, token)
        if full:
            payload: dict[str, Any] = {}
            if leader:
                payload = {**tensors, **metadata}
                if self.async_save:  # the training goes on while the file is written: write a snapshot
                    private = private_tensors(tensors, live_storages(live_modules, live_optimizers))
                    stager = Staging()  # copies not kept: what it copies is small (``step`` counters ...)
                    payload = stager.stage(payload, private=private)
                    self.staged_bytes = stager.staged_bytes

            def write_file() -> None:
                if isinstance(path, RemotePath):  # one object: visible once its upload completes
                    upload_file(path, lambda file: torch.save(payload, file))
                    return
                with open_over(staged) as file:  # the previous checkpoint set aside, written over in place
                    torch.save(payload, file)
                commit(path, staged, token, discard=self._set_aside)

            self._run(f"Writing the checkpoint {where}", write_file, leader)
            return

        what = f"Committing the checkpoint {where}"
        writer: Any
        if isinstance(path, RemotePath):
            writer = dcp_writer(path)
        else:
            # Each rank's writer fsyncs the shard files it wrote, right after writing each (``sync_files``),
            # before DCP's closing gather of the ranks' results: so every shard is durable before rank 0 writes
            # ``.metadata`` and commits, and rank 0 fsyncs only the metadata and the folders (``shards_synced``).
            writer = local_writer(staged, sync_files=True, overwrite=True)

        def commit_synced() -> None:
            if isinstance(path, RemotePath):
                commit_prefix(path, token)
            elif _local_folder_of_users(path):
                commit_among(path, staged, shards_synced=True)
            else:
                commit(path, staged, token, shards_synced=True, discard=self._set_aside)

        if not self.async_save:
            # Without a process group (``save_state`` in a plain script) DCP warns that it assumes one process:
            # here that is the documented use, as in ``convert`` and every load.
            with single_process() if not dist.is_initialized() else contextlib.nullcontext():
                dcp.save(tensors, storage_writer=writer)  # DCP raises a failure on any rank on every rank itself
            run_agreed(what, commit_synced, here=leader)
            return
        # DCP stages (copies) the tensors with our stager before returning; only the writing goes on in the
        # background. ``meta.pt`` is written above, so it is a snapshot too.
        written: Any = dcp.async_save(
            tensors, storage_writer=writer, process_group=self._group(), async_stager=self._stager()
        )
        self.staged_bytes = self._stager().staged_bytes

        def finish() -> None:
            written.result()  # on rank 0 this returns after every rank's shards are durable and .metadata written
            if leader:
                commit_synced()

        self._run(f"Writing the checkpoint {where}", finish, True)

    def _prepare(self, path: Path, *, full: bool) -> str:
        """Rank 0: a token for the staging name, after checking that ``path`` may be replaced.

        The staging entry is created here (empty), so that every process can check that it sees it.
        """
        _refuse_other_folders(path, full=full)
        token = new_token()
        path.parent.mkdir(parents=True, exist_ok=True)
        spare, self._spare = self._spare, None
        remove_stale(path, busy=[*self._trash.busy(), *([spare] if spare else [])])
        if spare is not None and not reuse_as_staging(spare, path, token, folder=not full):
            self._trash.discard(spare)  # of another path, or of the other format
        elif spare is not None:
            return token  # saving again to the same path: written over, as Lightning does, not deleted
        staged = staging_path(path, token)
        if full:
            staged.touch()
        else:
            staged.mkdir()
        return token

    def _set_aside(self, previous: Path) -> None:
        """Rank 0, at a commit: keep the checkpoint replaced for the next save to write over (see ``_prepare``).

        Checkpoints are often saved again and again to one path (``last.ckpt``); the next save's files then
        replace the old ones in place, and nothing is deleted. A spare still kept by then is deleted, in the
        background, as is the last one at :meth:`close`.
        """
        spare, self._spare = self._spare, previous
        if spare is not None:
            self._trash.discard(spare)

    def _check_shared(self, path: Path, staged: Path, token: str) -> None:
        """Every process must see rank 0's staging entry; each node removes its own stale leftovers."""
        if _rank() != 0 and node_leader():  # rank 0 did in ``_prepare``; node-local disks fill up otherwise
            with contextlib.suppress(OSError):  # a race with another node on a shared folder: not this save's
                remove_stale(path, keep_token=token)
        views = gather(_sees(staged))
        if not all(seen for seen, _ in views):
            shown = [("the save in progress" if seen else "no save in progress", host) for seen, host in views]
            raise not_shared_error(path, shown, "save to")

    def _run(self, what: str, job: Callable[[], None], here: bool) -> None:
        """Run ``job`` where ``here``, now (then agree on the outcome) or in the background (see :meth:`wait`)."""
        if not self.async_save:
            run_agreed(what, job, here=here)
            return
        if here:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="modelpar-ckpt")
            self._pending = self._executor.submit(job)
        self._outstanding = what  # on every rank, so every rank exchanges the outcome in ``wait``

    def _stager(self) -> Staging:
        """One stager for the run (distributed format): it keeps its CPU copies and refills them on the next save.

        Re-allocating (and, from a GPU, pinning) the staging memory on every save costs page faults on the
        training's critical path; reusing it leaves a plain memcpy. :meth:`close` releases it.
        """
        if self._staging is None:
            self._staging = Staging()
        return self._staging

    def _group(self) -> Any:
        """A gloo group for background writes: never shares a communicator with the training's collectives."""
        if self._async_group is None and dist.is_initialized():
            self._async_group = dist.new_group(backend="gloo", timeout=self.timeout)
        return self._async_group

    def wait(self) -> None:
        """Block until a background save has finished everywhere; its error, on any rank, raises on every rank.

        Collective after an asynchronous save (every rank calls it, as ``save``, ``load`` and ``close`` do): the
        ranks exchange their outcomes, which also waits for rank 0's commit.
        """
        pending, self._pending = self._pending, None
        outstanding, self._outstanding = self._outstanding, None
        error: BaseException | None = None
        if pending is not None:
            try:
                pending.result()
            except BaseException as err:  # DCP raises a CheckpointException, a BaseException
                if not isinstance(root_cause(err), Exception):
                    raise
                error = err
        if outstanding is not None:
            agree(outstanding, error)
        elif error is not None:
            raise error

    def close(self) -> None:
        """At the end of a run: :meth:`wait`, then release the staging memory and the writer thread.

        Also waits until the previous checkpoints that saves replaced are deleted. The checkpointer stays
        usable (a later save allocates anew), e.g. for a second ``trainer.fit``.
        """
        try:
            self.wait()
        finally:
            spare, self._spare = self._spare, None
            if spare is not None:
                self._trash.discard(spare)
            self._trash.wait()
            staging, self._staging = self._staging, None
            executor, self._executor = self._executor, None
            if staging is not None:
                staging.close()
            if executor is not None:
                executor.shutdown(wait=True)

    # -- loading -----------------------------------------------------------------------------------------
    def load(
        self,
        path: str | Path | RemotePath,
        state: dict[str, Any],
        *,
        strict: bool = True,
        weights_only: bool | None = None,
        known_modules: Sequence[nn.Module] = (),
    ) -> dict[str, Any]:
        """Restore ``state`` from ``path`` (models, optimizers and stateful objects in place); return the rest."""
        self.wait()
        split = split_state(state, known_modules)
        return _io.load(self.location(path), split, state, strict=strict, weights_only=weights_only)

    def load_trainer_checkpoint(
        self,
        path: str | Path | RemotePath,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        *,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint in the Lightning Trainer's layout; return everything but the model and optimizers.

        The layout is the one every Lightning strategy writes: the model under ``"state_dict"``, and the
        optimizers as ``"optimizer_0"``, ``"optimizer_1"`` ... in a distributed folder, or as the list
        ``"optimizer_states"`` (keyed by parameter name or by position) in a single file. The model and the
        optimizers are restored in place; loops, schedulers and callbacks are in the returned dict.
        """
        self.wait()
        return _io.load_trainer_layout(
            self.location(path), module, list(optimizers), strict=strict, weights_only=weights_only
        )

    def load_raw(
        self, path: str | Path | RemotePath, module: nn.Module, *, strict: bool = True, weights_only: bool | None = None
    ) -> None:
        """Load weights into ``module`` from a raw state-dict file or a distributed folder."""
        self.wait()
        _io.load_raw_module(self.location(path), module, strict=strict, weights_only=weights_only)
