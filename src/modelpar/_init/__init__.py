"""Meta-device initialization: a sharded model built on the meta device gets each rank's shard of the very model
one process would build from the same seed, bit for bit (:mod:`.materialize`; the guarantee is written there).

Where each tensor lives (:mod:`.placement`), initializers run at full size on sharded tensors (:mod:`.full_size`),
FSDP2's and TP's block arithmetic (:mod:`.blocks`), fused expert tensors drawn in blocks (:mod:`.expert_blocks`),
and the marker that names what no initializer wrote (:mod:`.unwritten`). May import torch, Lightning and
:mod:`modelpar._errors` only.
"""
