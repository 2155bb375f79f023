"""Context parallelism: each sample's sequence split over the ranks of the ``"context_parallel"`` mesh axis.

Load-balanced causal layout (``shard_sequence``, ``load_balanced_positions``), attention over sequence shards by
all-gathering keys and values (``context_parallel_attention``), batch sharding with global positions and shifted
labels (``shard_batch``), the global token-mean loss (``cross_entropy``) and Hugging Face models
(``use_context_parallel_attention``). See docs/long-context.md.
"""

from modelpar.context._attention import ContextParallelAttention, context_parallel_attention
from modelpar.context._batch import shard_batch, shift_labels_for_causal_lm
from modelpar.context._hf import use_context_parallel_attention
from modelpar.context._layout import load_balanced_positions, shard_sequence, unshard_sequence
from modelpar.context._loss import cross_entropy

__all__ = [
    "ContextParallelAttention",
    "context_parallel_attention",
    "cross_entropy",
    "load_balanced_positions",
    "shard_batch",
    "shard_sequence",
    "shift_labels_for_causal_lm",
    "unshard_sequence",
    "use_context_parallel_attention",
]
