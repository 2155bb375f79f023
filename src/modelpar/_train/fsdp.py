"""The strategy's FSDP2 options (mixed precision, CPU offload, resharding) and the one way they reach ``fully_shard``.

A ``parallelize_fn`` (or a LightningModule's ``configure_model``) receives only the device mesh, yet the
strategy owns the FSDP2 policies and knows whether the mesh is HSDP. :func:`fsdp_kwargs` bridges the two:
given the strategy's mesh it returns everything ``fully_shard`` needs (the right mesh and the policies), so
user code and the ready-made plans write ``fully_shard(block, **fsdp_kwargs(device_mesh))`` and never
hand-write precision or offload into every ``parallelize_fn``.

The strategy also records which options were handed out, so that after ``parallelize_fn`` it can tell whether
they reached the model: an explicit option that never did is an error (it would be silently ignored), and a
``"bf16-mixed"`` run whose ``fully_shard`` calls did not take the derived bf16 policy keeps Lightning's
autocast instead, with a warning that says what it costs.

Under the derived bf16 policy the outermost FSDP modules' floating-point outputs are cast to fp32
(:func:`cast_root_outputs`), so logits and losses computed from them keep fp32 precision as under autocast.
That is what FSDP2's ``MixedPrecisionPolicy(output_dtype=torch.float32)`` does, but only on the root:
FSDP2 applies ``output_dtype`` in every unit that has it, so the policy ``fsdp_kwargs`` hands to every unit
cannot carry it without casting each block's output to fp32 and the next block's input back to bf16.

**Fused experts with fewer experts than shard ranks** (8 experts over 32 ranks) are sharded on another dim.
FSDP2 cuts dim 0 into ``ceil(E / ranks)``-row chunks, so there each of the first ``E`` ranks would hold a whole
expert and the others nothing (a Mixtral-sized layer: 84.75 GiB per rank instead of about 22). A 3-D parameter
with fewer rows on dim 0 than shard ranks is sharded on its first later dim that divides evenly (FSDP2 shards
dims above 0 only evenly) through ``fully_shard``'s ``shard_placement_fn`` (:func:`fsdp_shard_dim`). Every other
parameter keeps FSDP2's ``Shard(0)``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor, Shard

from modelpar._mesh.submeshes import fsdp_mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["FSDPOptions", "cast_root_outputs", "fsdp_kwargs", "fsdp_shard_dim", "handed_out", "register_mesh"]

#: The mixed-precision policy ``"bf16-mixed"`` implies: bf16 parameters, all-gathers and compute (half the
#: traffic and no autocast weight copies outside FSDP's resharding), fp32 gradient reduction (accurate sums).
BF16_MIXED_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@dataclass(frozen=True)
class FSDPOptions:
    """The strategy's FSDP2 arguments, resolved against the precision flag and the device.

    ``explicit`` names the strategy arguments the user set, which must reach the model. ``root_output_dtype``
    is the dtype the outermost FSDP modules' outputs are cast to when the policy is in effect (fp32 under the
    derived ``"bf16-mixed"`` policy; ``None``, no cast, for a policy given explicitly, which is used as given).
    """

    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    offload_policy: OffloadPolicy = field(default_factory=OffloadPolicy)
    reshard_after_forward: bool | int | None = None
    explicit: tuple[str, ...] = ()
    root_output_dtype: torch.dtype | None = None

    @classmethod
    def resolve(
        cls,
        *,
        mixed_precision: MixedPrecisionPolicy | None,
        cpu_offload: bool | CPUOffloadPolicy,
        reshard_after_forward: bool | int | None,
        precision: str,
        device: torch.device,
        shard_size: int,
        strategy_name: str,
    ) -> FSDPOptions:
        """Derive the policies; refuse what torch cannot do here with the reason and the fix (before any collective)."""
        explicit = []
        root_output_dtype = None
        if mixed_precision is None:
            mp_policy = BF16_MIXED_POLICY if precision == "bf16-mixed" else MixedPrecisionPolicy()
            root_output_dtype = torch.float32 if precision == "bf16-mixed" else None
        else:
            explicit.append("mixed_precision")
            mp_policy = mixed_precision
        offload: OffloadPolicy = OffloadPolicy()
        if isinstance(cpu_offload, CPUOffloadPolicy):
            offload = cpu_offload
        elif cpu_offload:
            offload = CPUOffloadPolicy(pin_memory=device.type != "cpu")  # pinning needs an accelerator
        if isinstance(offload, CPUOffloadPolicy):
            explicit.append("cpu_offload")
            if offload.pin_memory and not torch.accelerator.is_available():
                raise ValueError(
                    f"`{strategy_name}(cpu_offload=CPUOffloadPolicy(pin_memory=True))` needs an accelerator: pinned"
                    " memory is page-locked host memory for fast copies to a GPU, and this process has none. Pass"
                    " `cpu_offload=True` (the strategy pins only where it can) or `CPUOffloadPolicy(pin_memory=False)`."
                )
        if reshard_after_forward is not None:
            explicit.append("reshard_after_forward")
            _check_reshard(reshard_after_forward, shard_size, strategy_name)
        return cls(mp_policy, offload, reshard_after_forward, tuple(explicit), root_output_dtype)

    @property
    def casts_parameters(self) -> bool:
        """Whether FSDP computes in a lower parameter dtype (then autocast on top would only add copies)."""
        return self.mp_policy.param_dtype is not None

    def kwargs(self) -> dict[str, Any]:
        return {
            "mp_policy": self.mp_policy,
            "offload_policy": self.offload_policy,
            "reshard_after_forward": self.reshard_after_forward,
        }


#: Attribute set on a root FSDP module whose outputs :func:`cast_root_outputs` casts, so it casts them once.
_OUTPUTS_IN_FP32 = "_modelpar_outputs_in_fp32"


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t


def _outputs_to_fp32(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook: every floating-point tensor of ``output`` (nested in tuples, dicts, dataclasses) as fp32."""
    return apply_to_collection(output, torch.Tensor, _to_fp32)


def cast_root_outputs(module: nn.Module) -> None:
    """Cast the forward outputs of ``module``'s outermost FSDP modules to fp32.

    The outermost FSDP modules are FSDP2's roots (``module`` itself when it was sharded last, as it should be).
    The hook is registered after ``fully_shard``'s own, so it runs after FSDP2's post-forward, exactly where
    FSDP2 would apply the root's ``output_dtype``; gradients flow back through the cast. Once per module (a
    plain attribute marks it), and a module-level function, so the module still pickles.
    """
    roots: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        if isinstance(m, FSDPModule):
            roots.append(m)
            return
        for child in m.children():
            visit(child)

    visit(module)
    for root in roots:
        if not getattr(root, _OUTPUTS_IN_FP32, False):
            root.register_forward_hook(_outputs_to_fp32)
            setattr(root, _OUTPUTS_IN_FP32, True)


def _check_reshard(value: object, shard_size: int, strategy_name: str) -> None:
    if isinstance(value, bool):
        return
    valid = [d for d in range(2, shard_size) if shard_size % d == 0]
    if not isinstance(value, int) or value not in valid:
        fix = f"one of {valid}" if valid else "True or False (this shard group has no such divisor)"
        raise ValueError(
            f"`{strategy_name}(reshard_after_forward={value!r})`: an int reshards to that many ranks after forward and"
            f" must divide the shard group ({shard_size} ranks) other than 1 and itself. Pass {fix}."
        )


@dataclass
class _Record:
    options: FSDPOptions
    handed_out: list[FSDPOptions] = field(default_factory=list)


#: Each strategy mesh -> its options and what ``fsdp_kwargs`` handed out since the strategy last looked. Keyed
#: by identity: two strategies with equal layouts but different options must not share an entry.
_records: dict[int, tuple[weakref.ref[DeviceMesh], _Record]] = {}


def register_mesh(mesh: DeviceMesh, options: FSDPOptions) -> None:
    """Tell :func:`fsdp_kwargs` which options belong to ``mesh`` (the strategy does, before ``parallelize_fn``)."""
    key = id(mesh)
    _records[key] = (weakref.ref(mesh, lambda _: _records.pop(key, None)), _Record(options))


def _record(mesh: DeviceMesh) -> _Record | None:
    entry = _records.get(id(mesh))
    return entry[1] if entry is not None and entry[0]() is mesh else None


def handed_out(mesh: DeviceMesh) -> list[FSDPOptions]:
    """The options :func:`fsdp_kwargs` returned for ``mesh`` since the last call; the record starts over."""
    record = _record(mesh)
    if record is None:
        return []
    out, record.handed_out = record.handed_out, []
    return out


def fsdp_kwargs(device_mesh: DeviceMesh, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for ``fully_shard``: the strategy's data-parallel mesh and FSDP2 policies.

    Use it in a ``parallelize_fn`` (or ``configure_model``) with the mesh the strategy gave you::

        for block in model.layers:
            fully_shard(block, **fsdp_kwargs(device_mesh))
        fully_shard(model, **fsdp_kwargs(device_mesh))

    ``mesh`` is the 2-D ``(replicate, shard)`` mesh under HSDP and the ``"data_parallel"`` axis otherwise;
    ``shard_placement_fn`` shards fused experts with fewer experts than shard ranks on another dim
    (:func:`fsdp_shard_dim`);
    ``mp_policy``, ``offload_policy`` and ``reshard_after_forward`` come from the strategy's arguments and
    precision. ``overrides`` replace any of them for this call (``reshard_after_forward=False`` for the
    root, say). A mesh from no strategy gets FSDP2's defaults.
    """
    record = _record(device_mesh)
    options = record.options if record is not None else FSDPOptions()
    kwargs = {"mesh": fsdp_mesh(device_mesh), **options.kwargs(), **overrides}
    kwargs.setdefault("shard_placement_fn", _ShardDim(kwargs["mesh"].size(kwargs["mesh"].ndim - 1)))
    if record is not None:
        record.handed_out.append(
            FSDPOptions(kwargs["mp_policy"], kwargs["offload_policy"], kwargs["reshard_after_forward"])
        )
    return kwargs


def fsdp_shard_dim(shape: tuple[int, ...] | torch.Size, shard_size: int) -> int:
    """The dim FSDP shards a parameter of ``shape`` on over ``shard_size`` ranks (see the module docstring).

    0, except for a 3-D tensor (fused experts ``[E, rows, cols]``) with fewer than ``shard_size`` rows on dim 0
    and a later dim that ``shard_size`` divides: that dim. The memory estimate counts with the same rule.
    """
    if len(shape) != 3 or shape[0] >= shard_size:
        return 0
    return next((dim for dim in (1, 2) if shape[dim] % shard_size == 0), 0)


class _ShardDim:
    """``fully_shard``'s ``shard_placement_fn``: :func:`fsdp_shard_dim` over the mesh's shard ranks."""

    def __init__(self, shard_size: int) -> None:
        self.shard_size = shard_size

    def __call__(self, param: nn.Parameter) -> Shard | None:
        # FSDP2 cuts the local tensor of a DTensor (tensor- or expert-parallel): its rows are what each rank chunks.
        local = param.to_local() if isinstance(param, DTensor) else param
        dim = fsdp_shard_dim(local.shape, self.shard_size)
        return Shard(dim) if dim else None
