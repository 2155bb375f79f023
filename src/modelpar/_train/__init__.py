"""The training step: FSDP2's options for each unit (:mod:`.fsdp`), gradient synchronization under accumulation
(:mod:`.grad_sync`) and mesh-aware gradient clipping (:mod:`.clip`).

May import :mod:`modelpar._mesh` and :mod:`modelpar._errors`; nothing above them (no plans, no strategy).
"""
