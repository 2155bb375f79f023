"""Run by test_rank_death.py: train the tiny Llama on 2 CPU processes until one rank dies in the middle of step 3.

``rank_death_script.py LAUNCHER VICTIM SIGNAL OUT_DIR PEER_TIMEOUT``: ``LAUNCHER`` is ``fabric`` (Fabric's own
launcher: this script started once, it starts the second process) or ``torchrun``; rank ``VICTIM`` sends itself
``SIGNAL`` (``SIGKILL``: it dies; ``SIGSTOP``: it freezes with its sockets open, as a hung or unreachable host
looks) after its forward pass, so the others are inside backward's collectives. Every rank writes its PID to
``OUT_DIR/pid<rank>``; the victim writes the time it signals itself to ``OUT_DIR/signalled``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for parity

from modelpar import ModelParallelStrategy
from modelpar.plans import parallelize_llama
from parity import global_batches, lm_loss, reference_model


def main(launcher: str, victim: int, signal_name: str, out: Path, peer_timeout: float) -> None:
    torch.set_num_threads(1)
    # The collective timeout stays long, as in a real job: only the watchdog may end the survivors quickly.
    strategy = ModelParallelStrategy(parallelize_llama, timeout=timedelta(minutes=30), peer_timeout=peer_timeout)
    if launcher == "fabric":
        from lightning_fabric import Fabric

        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
        fabric.launch()
    else:
        strategy.setup_environment()
    rank = int(torch.distributed.get_rank())
    (out / f"pid{rank}").write_text(str(os.getpid()))
    model = strategy.setup_module(reference_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step, (x, y) in enumerate(global_batches(6), start=1):
        loss = lm_loss(model(x), y)  # tensor parallelism over both ranks: every rank sees the whole batch
        if step == 3 and rank == victim:
            (out / "signalled").write_text(repr(time.time()))
            os.kill(os.getpid(), getattr(signal, signal_name))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"rank {rank} finished all steps", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), float(sys.argv[5]))
