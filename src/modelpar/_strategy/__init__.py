"""The strategy shared by both front ends: :class:`.core.ParallelCore` holds the mesh, sets the model up (mesh ->
``parallelize_fn``, or without one the strategy's own plan (:mod:`.default_plan`) -> checks -> materialization ->
optimizer) and saves and loads checkpoints; its options are one frozen value (:mod:`.options`); :mod:`.adapter`
is what the Fabric (:mod:`modelpar.fabric`) and Trainer (:mod:`modelpar.trainer`) strategies share around it.
Also: Lightning's two namespaces in one place (:mod:`.lightning`), precision plugins (:mod:`.precision`) and the
checks that a ``parallelize_fn`` did what the strategy asked (:mod:`.applied`).

The top layer below the front ends: may import every other part of modelpar; nothing but the front ends
(``fabric``, ``trainer``, the CLI) imports it.
"""
