"""Optimizer state keyed by parameter position <-> keyed by parameter name, without any FSDP object.

``optimizer.state_dict()`` keys state by position (0, 1, ... across parameter groups, in order): that is what
DDP and single-device Lightning checkpoints hold and what ``optimizer.load_state_dict`` expects. Sharded
checkpoints key by parameter name, which survives re-sharding and re-wrapping. The mapping between the two
comes from the live optimizer's groups and the module's parameter names, so it is right with several groups
and with frozen parameters (which are not in the optimizer and take no position). Names are the stable ones
(:mod:`modelpar.checkpoint._names`), so plain, FSDP1 (``use_orig_params=True``), FSDP2/TP, compiled and
activation-checkpointed models all key alike; no FSDP1 object is needed.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer

from modelpar.checkpoint._names import named_parameters_clean

__all__ = ["optimizer_state_to_names", "optimizer_state_to_positions"]


def _names_in_order(module: nn.Module, optimizer: Optimizer) -> list[list[str]]:
    names = {id(p): n for n, p in named_parameters_clean(module).items()}
    groups = []
    for group in optimizer.param_groups:
        unknown = [p for p in group["params"] if id(p) not in names]
        if unknown:
            raise ValueError(
                f"The optimizer holds {len(unknown)} parameter(s) that are not parameters of the given module, so"
                " their names are unknown. Re-key with the module the optimizer was created for."
            )
        groups.append([names[id(p)] for p in group["params"]])
    return groups


def _check_groups(osd: dict[str, Any], live: list[list[str]]) -> None:
    saved = osd["param_groups"]
    if len(saved) != len(live) or any(len(s["params"]) != len(g) for s, g in zip(saved, live, strict=False)):
        raise ValueError(
            f"The optimizer state has parameter groups of sizes {[len(g['params']) for g in saved]}, the optimizer"
            f" has {[len(g) for g in live]}. Create the optimizer with the same groups as when it was saved."
        )


def optimizer_state_to_names(osd: dict[str, Any], module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """A position-keyed optimizer state re-keyed by parameter name (returned as is if already by name)."""
    keys = [*osd.get("state", {}), *(p for g in osd["param_groups"] for p in g["params"])]
    if not any(isinstance(k, int) for k in keys):
        return osd
    live = _names_in_order(module, optimizer)
    _check_groups(osd, live)
    position_to_name: dict[Any, str] = {}
    groups = []
    for saved, names in zip(osd["param_groups"], live, strict=True):
        position_to_name.update(zip(saved["params"], names, strict=True))
        groups.append({**saved, "params": names})
    return {"state": {position_to_name[k]: v for k, v in osd["state"].items()}, "param_groups": groups}


def optimizer_state_to_positions(osd: dict[str, Any], module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """A name-keyed optimizer state re-keyed by position, as ``optimizer.state_dict()`` would key it."""
    live = _names_in_order(module, optimizer)
    _check_groups(osd, live)
    name_to_position: dict[str, int] = {}
    groups = []
    position = 0
    for saved, names in zip(osd["param_groups"], live, strict=True):
        positions = list(range(position, position + len(names)))
        position += len(names)
        name_to_position.update(zip(names, positions, strict=True))
        groups.append({**saved, "params": positions})
    state = {name_to_position[k]: v for k, v in osd["state"].items() if k in name_to_position}
    return {"state": state, "param_groups": groups}
