"""Count the tensor-parallel styles the installed transformers' plans use, and what modelpar makes of each.

For every registered model type (``CONFIG_MAPPING``) the default config is built (``AutoConfig.for_model``;
those that fail are counted and named) and its ``base_model_tp_plan`` and ``base_model_ep_plan`` read; the
model classes' ``_tp_plan`` (the heads) are read from the modeling sources' text, so no model is imported.
Prints, per style, how many configs (or classes) use it, which model types, and modelpar's outcome
(``modelpar.hf._styles``: mapped to what, or refused why). No downloads; a few seconds.

    python scripts/hf_tp_styles.py [--markdown]
"""

from __future__ import annotations

import argparse
import ast
import logging
import re
import warnings
from collections import defaultdict
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table (docs/huggingface.md)")
    args = parser.parse_args()

    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from modelpar.hf._styles import HF_REFUSED, HF_STYLES

    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")

    uses: dict[tuple[str, str], set[str]] = defaultdict(set)  # (plan, style) -> model types
    failed: list[str] = []
    for model_type in CONFIG_MAPPING_NAMES:
        try:
            config = AutoConfig.for_model(model_type)
        except Exception as err:  # a default config that does not build is counted, not fatal
            failed.append(f"{model_type} ({type(err).__name__})")
            continue
        for plan in ("base_model_tp_plan", "base_model_ep_plan"):
            for style in (getattr(config, plan, None) or {}).values():
                uses[(plan, style)].add(model_type)
    models = Path(transformers.__file__).parent / "models"
    for source in sorted(models.glob("*/modeling_*.py")):
        for match in re.finditer(r"^\s+_tp_plan = (\{.*\})\s*$", source.read_text(), re.MULTILINE):
            for style in ast.literal_eval(match.group(1)).values():
                uses[("_tp_plan", style)].add(source.parent.name)

    def outcome(plan: str, style: str) -> str:
        if plan == "base_model_ep_plan" and style == "ep_dispatch_experts":
            return "read by plan_for: the experts modules its `experts` names (split over the expert axis)"
        if plan == "base_model_ep_plan":
            return "not read: modelpar splits the experts module whole (its parameters follow)"
        if style in HF_STYLES:
            return f"mapped: {HF_STYLES[style]}"
        if style in HF_REFUSED:
            headline = re.split(r":|, since| \(", HF_REFUSED[style])[0]
            return f"refused: {headline}"
        return "unknown style: ValueError"

    total = len(CONFIG_MAPPING_NAMES) - len(failed)
    order = ("base_model_tp_plan", "_tp_plan", "base_model_ep_plan")
    rows = sorted(uses.items(), key=lambda item: (order.index(item[0][0]), -len(item[1]), item[0][1]))
    print(f"transformers {transformers.__version__}: {total} configs read, {len(failed)} failed: {', '.join(failed)}")
    if args.markdown:
        print("\n| plan | style | configs | model types | modelpar |\n| --- | --- | --- | --- | --- |")
    for (plan, style), types in rows:
        shown = sorted(types)
        families = ", ".join(shown[:6]) + (f", ... ({len(shown) - 6} more)" if len(shown) > 6 else "")
        if args.markdown:
            print(f"| `{plan}` | `{style}` | {len(types)} | {families} | {outcome(plan, style)} |")
        else:
            print(f"{plan:20} {style:32} {len(types):4}  {outcome(plan, style)}\n{'':58}{families}")


if __name__ == "__main__":
    main()
