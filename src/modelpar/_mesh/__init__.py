"""Processes, process groups and the device mesh: the layer everything parallel stands on.

What the strategy's ranks are and how they talk: the mesh layout and its axes (:mod:`.layout`) from sizes checked
one by one (:mod:`.sizes`), the default
process group and the launcher's environment (:mod:`.process_group`), one group per mesh axis (:mod:`.groups`),
collectives on the right device (:mod:`.collective`), and the peer watchdog that ends a run when a rank dies
(:mod:`.watchdog`, :mod:`.peers`). May import torch, Lightning and :mod:`modelpar._errors` only: no other part of
modelpar.
"""
