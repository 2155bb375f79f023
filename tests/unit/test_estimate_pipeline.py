"""``estimate_memory`` under pipeline parallelism, in one process on the meta device: each rank counts its stages'
parameters as the cut gives them, the schedules keep the micro-batches torch's schedules keep, the worst rank is
reported, and bad settings are refused with the strategy's errors.

The tiny Llama (fp32): 4 blocks of 656 elements, embedding and output layer 128 each, final norm 8; the cut (blocks
balanced by cost, the embedding with the first stage, the norm and output layer with the last) is 2 + 2 at 2 stages.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from modelpar import MemoryEstimate, MeshSizeError, estimate_memory
from modelpar._errors import PipelineSplitError
from modelpar.memory import search_layouts
from modelpar.memory._schedule import in_flight, schedule_ops
from modelpar.models import Llama, LlamaConfig
from modelpar.pipeline import cut_model
from modelpar.plans import LLAMA_PLAN

CFG = LlamaConfig(vocab_size=16, dim=8, n_layers=4, n_heads=2, n_kv_heads=2, ffn_hidden=16, max_seq_len=8)
SEQ = 8


def tiny(cfg: LlamaConfig = CFG) -> Llama:
    with torch.device("meta"):
        return Llama(cfg)


def estimate(pp: int = 2, dp: int = 1, **kwargs) -> MemoryEstimate:
    return estimate_memory(tiny(), plan=LLAMA_PLAN, data_parallel_size=dp, pipeline_parallel_size=pp, **kwargs)


def stage_elements(model: Llama, names: tuple[str, ...]) -> int:
    return sum(p.numel() for n in names for p in model.get_submodule(n).parameters())


@pytest.mark.parametrize(
    ("pp", "schedule", "dp"), [(2, "1F1B", 1), (2, "1F1B", 2), (4, "GPipe", 1), (2, "Interleaved1F1B", 2)]
)
def test_each_rank_counts_the_parameters_of_its_stages_as_the_cut_gives_them(pp, schedule, dp):
    e = estimate(pp, dp, pipeline_schedule=schedule)
    assert e.pipeline is not None
    model = tiny()
    cut = cut_model(model, len(e.pipeline.stage_modules))
    assert cut.stages == e.pipeline.stage_modules
    per_rank = len(cut.stages) // pp
    for usage in e.pipeline.ranks:
        assert usage.stages == tuple(usage.rank + k * pp for k in range(per_rank))  # round-robin for looped schedules
        elements = sum(stage_elements(model, cut.stages[s]) for s in usage.stages)
        assert usage.parameters == usage.gradients == 4 * elements // dp  # every dim 0 is even: no padding
        assert usage.optimizer_states == 2 * usage.parameters  # AdamW: two fp32 states
    # the ranks hold the whole model between them, each parameter once
    assert sum(u.parameters for u in e.pipeline.ranks) * dp == 4 * sum(p.numel() for p in model.parameters())
    worst = e.pipeline.worst_rank
    assert (e.parameters, e.gradients, e.optimizer_states) == (
        worst.parameters,
        worst.gradients,
        worst.optimizer_states,
    )


def test_the_embedding_and_output_layer_go_with_the_first_and_last_stage():
    e = estimate(2)
    assert e.pipeline is not None
    assert e.pipeline.stage_modules == (
        ("tok_embeddings", "layers.0", "layers.1"),
        ("layers.2", "layers.3", "norm", "output"),
    )
    assert e.buffers == 2 * 8 * 2 * 4  # RoPE cos and sin [8, 2] fp32: on every stage


def test_1f1b_keeps_p_minus_s_micro_batches_where_gpipe_keeps_all():
    for rank in range(4):
        ops = schedule_ops("1F1B", rank=rank, pipeline_parallel_size=4, per_rank=1, microbatches=8)
        assert in_flight(ops, 1) == (min(8, 4 - rank),)
        ops = schedule_ops("GPipe", rank=rank, pipeline_parallel_size=4, per_rank=1, microbatches=8)
        assert in_flight(ops, 1) == (8,)
        ops = schedule_ops("LoopedBFS", rank=rank, pipeline_parallel_size=4, per_rank=2, microbatches=8)
        assert in_flight(ops, 2) == (8, 8)
    one, gpipe = (
        estimate(2, seq_len=SEQ, micro_batch_size=4, pipeline_microbatches=4, pipeline_schedule=s)
        for s in ("1F1B", "GPipe")
    )
    assert one.pipeline is not None and gpipe.pipeline is not None
    assert [u.in_flight for u in one.pipeline.ranks] == [(2,), (1,)]
    assert [u.in_flight for u in gpipe.pipeline.ranks] == [(4,), (4,)]
    # the first stage keeps activations only: 2 of 4 micro-batches' worth
    assert 2 * one.pipeline.ranks[0].most_activations == gpipe.pipeline.ranks[0].most_activations


def _torch_interleaved_ops(schedules, p: int, v: int, m: int, rank: int) -> list[tuple[int, bool]]:
    """Rank ``rank``'s (local stage, forward?) ops as ``ScheduleInterleaved1F1B._calculate_single_rank_operations``
    builds them, from torch's own ``_get_warmup_ops`` and ``_get_1f1b_rank_ops``."""
    per_round = m // max(1, m // p)
    warmup = schedules._get_warmup_ops(rank, v, per_round, p, m, multiply_factor=2)

    def fwd(step: int) -> int:
        return ((step // per_round) % v) * p + rank

    def bwd(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * p + rank

    actions = schedules._get_1f1b_rank_ops(v, p, warmup, v * m - warmup, warmup, rank, fwd, bwd)
    forward = schedules._ComputationType.FORWARD
    return [((a.stage_index - rank) // p, a.computation_type == forward) for a in actions if a]


def test_interleaved_1f1b_runs_its_micro_batches_in_torchs_order():
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(schedules, "_get_1f1b_rank_ops"):
        pytest.skip("this torch has no _get_1f1b_rank_ops to compare with")
    for p, v, m in [(2, 2, 4), (2, 3, 8), (4, 2, 8), (4, 2, 12), (3, 2, 8), (4, 3, 16)]:
        for rank in range(p):
            ours = schedule_ops("Interleaved1F1B", rank=rank, pipeline_parallel_size=p, per_rank=v, microbatches=m)
            assert ours == _torch_interleaved_ops(schedules, p, v, m, rank), (p, v, m, rank)


def test_looped_bfs_runs_its_micro_batches_in_torchs_order():
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    forward = schedules._ComputationType.FORWARD
    p, v, m = 2, 2, 4
    for rank in range(p):
        fake = SimpleNamespace(_stages=[None] * v, pp_group_size=p, _n_microbatches=m)
        actions = schedules.ScheduleLoopedBFS._calculate_single_rank_operations(fake, rank)
        torch_ops = [((a.stage_index - rank) // p, a.computation_type == forward) for a in actions if a]
        assert schedule_ops("LoopedBFS", rank=rank, pipeline_parallel_size=p, per_rank=v, microbatches=m) == torch_ops


def test_stage_activations_add_up_to_the_whole_model_at_micro_batch_size():
    # fp32 under GPipe: every stage keeps all M micro-batches; a stage's output (kept for its backward) is the next
    # stage's received input, which its first norm keeps itself and the receive buffers count: they cancel.
    m = 2
    e = estimate(2, seq_len=SEQ, micro_batch_size=2 * m, pipeline_microbatches=m, pipeline_schedule="GPipe")
    whole = estimate_memory(tiny(), plan=LLAMA_PLAN, data_parallel_size=1, seq_len=SEQ, micro_batch_size=2)
    assert e.pipeline is not None
    assert sum(u.most_activations for u in e.pipeline.ranks) == m * whole.stored_activations


def test_the_worst_rank_is_the_one_with_the_highest_peak_and_the_table_names_it():
    for schedule, worst in (("1F1B", 0), ("GPipe", 1)):  # GPipe: the last stage holds every micro-batch and logits
        e = estimate(2, seq_len=SEQ, micro_batch_size=8, pipeline_microbatches=8, pipeline_schedule=schedule)
        assert e.pipeline is not None
        assert e.pipeline.worst == worst == max(range(2), key=lambda r: e.pipeline.peaks[r])
        assert e.peak == e.pipeline.peaks[worst]
        text = str(e)
        stages = "tok_embeddings, layers.0, layers.1" if worst == 0 else "layers.2, layers.3, norm, output"
        assert f"pipeline: 2 ranks, {schedule}, 8 micro-batches of 1; worst: pipeline rank {worst} of 2" in text
        assert f"stage {worst} ({stages}): at most {8 if schedule == 'GPipe' else 2} in flight" in text
        assert f"Peak per rank (device): pipeline rank {worst}," in text


def test_backwards_without_gradient_sync_hold_the_stages_unsharded_gradients_and_receive_buffers():
    e = estimate(2, 2, seq_len=SEQ, micro_batch_size=4, pipeline_microbatches=4)
    assert e.pipeline is not None
    parts = dict(e.pipeline.ranks[0].other_parts)
    assert parts["stage 0 unsharded gradients"] == 2 * e.pipeline.ranks[0].gradients  # whole, where dp=2 shards
    assert parts["p2p receive buffers"] == 4 * 1 * SEQ * 8 * 4  # 4 gradient buffers of a micro-batch's hidden state
    parts = dict(e.pipeline.ranks[1].other_parts)
    assert parts["p2p receive buffers"] == 4 * 1 * SEQ * 8 * 4  # 4 hidden-state buffers


def test_without_a_pipeline_the_estimate_is_unchanged():
    plain = estimate_memory(tiny(), plan=LLAMA_PLAN, data_parallel_size=2, seq_len=SEQ, micro_batch_size=2)
    one = estimate(1, 2, seq_len=SEQ, micro_batch_size=2, pipeline_schedule="GPipe", pipeline_microbatches=2)
    assert one == plain and one.pipeline is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"pp": 0}, MeshSizeError, r"`pipeline_parallel_size=0` is not a valid size"),
        ({"pipeline_schedule": "Bogus"}, ValueError, r"`pipeline_schedule='Bogus'` is not a schedule"),
        ({"pipeline_schedule": "ZBVZeroBubble"}, NotImplementedError, r"is not offered: its backward split"),
        ({"pipeline_microbatches": 1}, ValueError, r"`pipeline_microbatches=1` is fewer than the 2 pipeline stages"),
        ({"pipeline_stages_per_rank": 2}, ValueError, r"runs one stage per rank"),
        ({"pp": 8}, PipelineSplitError, r"8 pipeline stages .* has only 4 blocks"),
        (
            {"seq_len": SEQ, "micro_batch_size": 6, "pipeline_microbatches": 4},
            ValueError,
            r"micro_batch_size=6\).*`pipeline_microbatches=4` equal micro-batches",
        ),
        (
            {"pp": 2, "pipeline_schedule": "Interleaved1F1B", "pipeline_microbatches": 5},
            ValueError,
            r"does not split into the rounds `'Interleaved1F1B'` runs",
        ),
    ],
)
def test_bad_pipeline_settings_are_refused_with_the_strategys_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        estimate(**kwargs)


def test_the_search_tries_pipeline_sizes_that_the_blocks_and_the_batch_allow():
    model = tiny()
    fits, _ = search_layouts(model, LLAMA_PLAN, world_size=8, gpu_memory=2**30, seq_len=SEQ, micro_batch_size=4)
    assert {f.pipeline_parallel for f in fits} == {1, 2, 4}  # 8 stages: more than 4 blocks; 4 micro-batches: 1 each
    assert all(f.estimate.pipeline is not None for f in fits if f.pipeline_parallel > 1)
    fits, _ = search_layouts(model, LLAMA_PLAN, world_size=8, gpu_memory=2**30, seq_len=SEQ, micro_batch_size=1)
    assert {f.pipeline_parallel for f in fits} == {1}  # one sample cannot be split into micro-batches
