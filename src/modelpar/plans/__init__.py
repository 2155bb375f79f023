"""Ready-made ``parallelize_fn``s, one module per model family; pass one to ``ModelParallelStrategy``."""

from modelpar.plans.llama import LlamaParallelConfig, llama_tp_plan, parallelize_llama

__all__ = ["LlamaParallelConfig", "llama_tp_plan", "parallelize_llama"]
