"""What torch alone can do over gloo on the suite's device: the record every skip in the shared-device cases rests on.

The probe runs first in each spawn, before any modelpar code, and imports none (``test_gpu_suite_itself`` reads
this module's imports): it creates the default process group itself, as a user's script would, from the
launcher variables the harness sets (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``; ``gloo``, no
``device_id``), builds a plain 1-D ``init_device_mesh``, and runs each collective the cases need on the device's
tensors, checking the values that come back. Each outcome is recorded with the call it made and, where it
failed, the exception's type and message. A case that needs a call torch could not make here is skipped
with that record (:func:`gpu_common.needs`); anything that fails later, inside modelpar, is the failure it is.

Some calls crash the process instead of raising (torch 2.11 on an H200: ``_functional_collectives.all_gather_tensor``
over gloo on CUDA tensors, which every DTensor ``redistribute`` and ``full_tensor`` to a gathered layout runs, dies
with SIGSEGV, while ``dist.all_gather_into_tensor`` works). A crash would take every result of the cases' spawn
with it, so :func:`probe_crashes` runs each such call in a spawn of its own first (all those spawns at once), from
the test process, and :func:`probe` records its outcome beside the others (it travels in :data:`CRASH_ENV`).

Then :func:`hand_over` destroys the probe's group and points ``MASTER_PORT`` at a fresh port, so the strategy
creates its own group the way it would in a user's run: the probe's choices (no ``device_id``, the timeout)
never stand in for modelpar's.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from harness import free_port, run_distributed, side_by_side

#: ``{name: {"call": the torch call made, "error": None or "ExceptionType: message"}}``, filled by :func:`probe`
#: in each rank; what :func:`gpu_common.needs` consults.
PROBED: dict[str, dict[str, str | None]] = {}

#: Outcomes that only inform (printed, never a reason to skip): building meshes is modelpar's job, and a torch
#: limit there that modelpar works around must not hide the cases that show it does.
INFORMATIONAL = ("init_device_mesh",)


#: Calls that may crash the process rather than raise, each probed in a spawn of its own (:func:`probe_crashes`).
#: A call that raises on one rank can still break the group for every later call (its peer's socket is closed
#: mid-transfer), so such a call counts as a crash too: torch 2.11 on an H200, ``batch_isend_irecv`` of CUDA
#: tensors over gloo, raised ``writev ...: Bad address`` on one rank (gloo's TCP transport was handed a device
#: pointer) and aborted the others, and every later collective of the cases' spawn failed with it.
CRASH_PROBES = {
    "functional_all_gather": "torch.distributed._functional_collectives.all_gather_tensor(float32 {on}) on a"
    " 1-D mesh (what DTensor's redistribute to a gathered layout and full_tensor run)",
    "batch_isend_irecv": "dist.batch_isend_irecv(isend + irecv of float32 {on}, a ring; what"
    " torch.distributed.pipelining's schedules send stage to stage with)",
}
#: The environment variable that carries :func:`probe_crashes`'s outcomes (JSON) into the cases' spawn.
CRASH_ENV = "MODELPAR_GPU_SUITE_CRASH_PROBES"


def probe_crashes(world_sizes: tuple[int, ...], device_type: str) -> dict[int, dict[str, str | None]]:
    """Run each of :data:`CRASH_PROBES` on each of ``world_sizes``, every probe on ranks of its own (torch alone),
    all at once; ``{world_size: {name: None or error}}``.

    Called in the test process before the cases' spawns; each world's outcome goes into :data:`CRASH_ENV` for
    :func:`probe`. The spawns run side by side (their pass or fail does not depend on the others; on a GPU each
    spawn starts fresh interpreters, which one after another add up), on ports reserved together. Prints a
    ``[gpu-suite] time crash probes`` line.
    """
    jobs = [(world, name) for world in world_sizes for name in CRASH_PROBES]
    started = time.time()

    def run(world: int, name: str, port: int) -> tuple[str | None, float]:
        outcome = None
        try:
            run_distributed(_crash_step, world, name, device_type, timeout=180, port=port)
        except AssertionError as failed:  # the ranks failed or crashed: the probe's outcome
            outcome = _crash_message(str(failed))
        return outcome, time.time() - started

    ran = []
    for done in side_by_side([partial(run, world, name) for world, name in jobs]):
        if isinstance(done, BaseException):  # the probe itself broke
            raise done
        ran.append(done)
    each = {f"{name} on {world}": round(s, 1) for (world, name), (_, s) in zip(jobs, ran, strict=True)}
    times = {"seconds": round(time.time() - started, 1), "spawns at once": len(jobs), "each": each}
    print(f"[gpu-suite] time crash probes: {times}")
    found: dict[int, dict[str, str | None]] = {world: {} for world in world_sizes}
    for (world, name), (outcome, _) in zip(jobs, ran, strict=True):
        found[world][name] = outcome
    return found


def _crash_message(report: str) -> str:
    """One line from the harness's report of failed ranks: each rank's own outcome (a signal by name, else the
    exception's last line), the distinct ones joined, a crash first.

    Every rank counts: where one rank's call fails and takes the group down, the others report only "Connection
    closed by peer"; the cause is the first one's (on an H200, ``batch_isend_irecv``: ``writev ...: Bad address``).
    """
    sections = re.split(r"^--- rank (-?\d+) ---$", report, flags=re.MULTILINE)
    by_text: dict[str, list[str]] = {}  # each distinct outcome and its ranks; a crash sorts first
    for rank, body in zip(sections[1::2], sections[2::2], strict=False):
        lines = [line.strip() for line in body.splitlines() if line.strip()]
        exited = [line for line in lines if line.startswith("process exited with code -")]
        if exited:
            code = int(exited[0].split("code ")[1].split()[0])
            names = {-11: "SIGSEGV", -6: "SIGABRT", -7: "SIGBUS", -9: "SIGKILL"}
            text = f"crashed: {names.get(code, f'signal {-code}')} ({exited[0]})"
        else:
            raised = [line for line in lines if not line.startswith(("Traceback", "File ", "^")) and ":" in line]
            text = raised[-1] if raised else lines[-1] if lines else "failed with no report"
        by_text.setdefault(text, []).append(rank)
    if not by_text:
        lines = [line.strip() for line in report.splitlines() if line.strip()]
        return (lines[-1] if lines else "failed with no report")[:300]
    causes = {t: r for t, r in by_text.items() if "Connection closed by peer" not in t} or by_text
    ordered = sorted(causes.items(), key=lambda item: not item[0].startswith("crashed"))
    parts = []
    for text, ranks in ordered:
        named = [r for r in ranks if r != "-1"]  # -1: the harness's own line (a timeout), no rank of its own
        where = f" (rank{'s' if len(named) > 1 else ''} {', '.join(named)})" if named and len(by_text) > 1 else ""
        parts.append(text + ("" if text.startswith("crashed") else where))
    return "; ".join(parts)[:300]


def _crash_step(name: str, device_type: str) -> None:
    """Inside each rank: the default group and a 1-D mesh with torch alone, then the call; raises on a wrong value."""
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        ws, rank = dist.get_world_size(), dist.get_rank()
        device = torch.device(device_type, 0) if device_type == "cuda" else torch.device(device_type)
        if device.type == "cuda":
            # Every rank on GPU 0, as the cases' ranks are (their root device). Left to LOCAL_RANK, the mesh would
            # pick cuda:1 on a one-GPU machine ("invalid device ordinal", not the crash the cases meet).
            torch.cuda.set_device(device)
        mesh = init_device_mesh(device_type, (ws,))
        if name == "functional_all_gather":
            mine = torch.full((4,), float(rank + 1), device=device)
            out = funcol.all_gather_tensor(mine, 0, mesh) * 1  # * 1 waits, as DTensor's use does
            if device.type == "cuda":
                torch.cuda.synchronize()
            _expect(out, torch.arange(1, ws + 1).float().repeat_interleave(4))
        elif name == "batch_isend_irecv":  # each rank sends its block to the next and receives the previous one's
            mine = torch.full((4,), float(rank + 1), device=device)
            got = torch.empty(4, device=device)
            ops = [dist.P2POp(dist.isend, mine, (rank + 1) % ws), dist.P2POp(dist.irecv, got, (rank - 1) % ws)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            if device.type == "cuda":
                torch.cuda.synchronize()
            _expect(got, torch.full((4,), float((rank - 1) % ws + 1)))
        else:
            raise ValueError(f"no crash probe named {name!r}")
    finally:
        dist.destroy_process_group()


def probe(device: torch.device, timeout: timedelta) -> dict[str, dict[str, str | None]]:
    """Create the default group with torch alone and record what it can run on ``device``'s tensors.

    Raises only if a process group exists already: then modelpar (or a case) made it, and the outcomes would
    be about that group's settings, not about torch; the suite must be fixed, not skipped.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "the probe found a process group already made; it must run first in the spawn and make the group with"
            " torch alone, or its outcomes would describe someone else's settings"
        )
    PROBED.clear()
    call = f'torch.distributed.init_process_group("gloo", timeout={timeout}) from the launcher variables'
    _record("init_process_group", call, lambda: dist.init_process_group("gloo", timeout=timeout), device)
    for name, call, run in _steps(device, int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])):
        if PROBED["init_process_group"]["error"] is not None:
            PROBED[name] = {"call": call, "error": "not run: init_process_group failed"}
        else:
            _record(name, call, run, device)
    on = f"a {device.type} tensor"
    for name, error in json.loads(os.environ.get(CRASH_ENV, "{}")).items():  # absent: needs() fails, not skips
        PROBED[name] = {"call": CRASH_PROBES[name].format(on=on) + ", in a spawn of its own", "error": error}
    return dict(PROBED)


def names() -> list[str]:
    """Every outcome :func:`probe` records, in its order."""
    return ["init_process_group", *(name for name, _, _ in _steps(torch.device("cpu"), 2, 0)), *CRASH_PROBES]


def hand_over() -> None:
    """Destroy the probe's group and move ``MASTER_PORT`` to a fresh port agreed by all ranks.

    A fresh port, not the same one again: a rank that re-creates its group sooner than rank 0 could otherwise
    reach the probe's store before rank 0 has closed it.
    """
    if not dist.is_initialized():
        return
    holder = [free_port() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    dist.barrier()
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(holder[0])


def _record(name: str, call: str, run: Callable[[], None], device: torch.device) -> None:
    try:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()  # a kernel's error surfaces here, and belongs to this call
        PROBED[name] = {"call": call, "error": None}
    except Exception as error:  # every outcome is a finding; a collective gloo lacks raises the same on every rank
        message = (str(error).strip().splitlines() or [""])[0][:200]
        PROBED[name] = {"call": call, "error": f"{type(error).__name__}: {message}"}


def _expect(t: torch.Tensor, want: torch.Tensor) -> None:
    """A collective that returns wrong values is as unusable as one that raises."""
    if not torch.equal(t.float().cpu(), want.float().cpu()):
        raise ValueError(f"wrong result: {t.tolist()}, expected {want.tolist()}")


def _steps(device: torch.device, ws: int, rank: int) -> list[tuple[str, str, Callable[[], None]]]:
    """``(name, call, run)`` for each probe; ``run`` raises if the call raised or returned wrong values."""
    total = float(ws * (ws + 1) // 2)  # sum over ranks of rank + 1

    def mine(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((n,), float(rank + 1), device=device, dtype=dtype)

    def all_reduce(dtype: torch.dtype, group: object = None) -> None:
        x = mine(4, dtype)
        dist.all_reduce(x, group=group)  # type: ignore[arg-type]
        _expect(x, torch.full((4,), total))

    def broadcast() -> None:
        x = mine(4)
        dist.broadcast(x, src=0)
        _expect(x, torch.ones(4))

    def all_gather() -> None:
        out = [torch.empty(4, device=device) for _ in range(ws)]
        dist.all_gather(out, mine(4))
        _expect(torch.stack(out), torch.arange(1, ws + 1).float()[:, None].expand(ws, 4))

    def all_gather_into_tensor() -> None:
        out = torch.empty(4 * ws, device=device)
        dist.all_gather_into_tensor(out, mine(4))
        _expect(out, torch.arange(1, ws + 1).float().repeat_interleave(4))

    def reduce_scatter_tensor(dtype: torch.dtype) -> None:
        out = torch.empty(2, device=device, dtype=dtype)
        dist.reduce_scatter_tensor(out, mine(2 * ws, dtype))
        _expect(out, torch.full((2,), total))

    def all_to_all_single() -> None:
        out = torch.empty(ws, device=device)
        dist.all_to_all_single(out, torch.arange(ws, device=device, dtype=torch.float32) + rank * ws)
        _expect(out, torch.arange(ws).float() * ws + rank)

    def new_group_all_reduce() -> None:
        all_reduce(torch.float32, dist.new_group(list(range(ws))))

    def broadcast_object_list() -> None:
        holder: list[object] = ["from rank 0" if rank == 0 else None]
        dist.broadcast_object_list(holder, src=0)
        if holder != ["from rank 0"]:
            raise ValueError(f"wrong result: {holder}")

    def init_device_mesh() -> None:
        from torch.distributed.device_mesh import init_device_mesh as build

        mesh = build(device.type, (ws,), mesh_dim_names=("probe",))
        if mesh.size() != ws:
            raise ValueError(f"a mesh of {mesh.size()} ranks, expected {ws}")

    on = f"a {device.type} tensor"
    return [
        ("init_device_mesh", f'init_device_mesh("{device.type}", ({ws},)) on the default group', init_device_mesh),
        ("all_reduce", f"dist.all_reduce(float32 {on})", lambda: all_reduce(torch.float32)),
        ("bf16_all_reduce", f"dist.all_reduce(bfloat16 {on})", lambda: all_reduce(torch.bfloat16)),
        ("broadcast", f"dist.broadcast(float32 {on})", broadcast),
        ("all_gather", f"dist.all_gather(float32 {on})", all_gather),
        ("all_gather_into_tensor", f"dist.all_gather_into_tensor(float32 {on})", all_gather_into_tensor),
        (
            "reduce_scatter_tensor",
            f"dist.reduce_scatter_tensor(float32 {on})",
            lambda: reduce_scatter_tensor(torch.float32),
        ),
        (
            "bf16_reduce_scatter_tensor",
            f"dist.reduce_scatter_tensor(bfloat16 {on})",
            lambda: reduce_scatter_tensor(torch.bfloat16),
        ),
        ("all_to_all_single", f"dist.all_to_all_single(float32 {on})", all_to_all_single),
        ("new_group_all_reduce", f"dist.all_reduce(float32 {on}) on a dist.new_group", new_group_all_reduce),
        ("broadcast_object_list", "dist.broadcast_object_list([str])", broadcast_object_list),
        ("barrier", "dist.barrier()", dist.barrier),
    ]
