"""Offline conversion (folder <-> file), inspection and the ``modelpar`` command line, on real checkpoints.

No process group and no mocks: checkpoints are written by ``save_state`` in this process, converted, and
compared tensor by tensor with the model and optimizer that wrote them.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from modelpar._cli import main
from modelpar.checkpoint import CheckpointNotFoundError, CorruptCheckpointError, load_state, save_state
from modelpar.checkpoint._convert import convert_to_distributed, convert_to_file
from modelpar.checkpoint._inspect import describe_checkpoint
from modelpar.models import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16)


def trained(seed: int = 0) -> tuple[Llama, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = Llama(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        tokens = torch.randint(0, CONFIG.vocab_size, (2, 8))
        model(tokens).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Llama, torch.optim.AdamW]:
    model, optimizer = trained()
    folder = tmp_path_factory.mktemp("source") / "ckpt"
    save_state(folder, {"model": model, "optimizer": optimizer, "step": 3, "note": "hello"}, full=False)
    return folder, model, optimizer


def assert_optimizer_state_equal(saved: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    names = {p: n for n, p in model.named_parameters()}
    assert len(saved["state"]) == len(optimizer.state) > 0
    for param, state in optimizer.state.items():
        for moment in ("exp_avg", "exp_avg_sq", "step"):
            expected, got = state[moment], saved["state"][names[param]][moment]
            assert got.dtype == expected.dtype and torch.equal(got, expected), (names[param], moment)
    group = dict(saved["param_groups"][0])
    assert group.pop("params") == list(names.values())
    assert group == {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}


def test_folder_converts_to_a_file_with_every_weight_moment_and_metadata_exactly(source, tmp_path):
    folder, model, optimizer = source
    convert_to_file(folder, tmp_path / "full.pt", progress=False)
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert list(full) == ["model", "optimizer", "step", "note"] and full["step"] == 3 and full["note"] == "hello"
    expected = model.state_dict()
    assert list(full["model"]) == list(expected)
    for name, tensor in expected.items():
        assert full["model"][name].dtype == tensor.dtype and torch.equal(full["model"][name], tensor), name
    assert_optimizer_state_equal(full["optimizer"], model, optimizer)
    fresh = Llama(CONFIG)
    fresh.load_state_dict(full["model"])
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), expected.values(), strict=True))


def test_file_converts_back_to_a_folder_that_load_state_restores_exactly(source, tmp_path):
    folder, model, optimizer = source
    convert_to_file(folder, tmp_path / "full.pt", progress=False)
    convert_to_distributed(tmp_path / "full.pt", tmp_path / "again", progress=False)
    fresh, fresh_optimizer = trained(seed=1)
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0, "note": ""}
    load_state(tmp_path / "again", state)
    assert state["step"] == 3 and state["note"] == "hello"
    for (name, got), expected in zip(fresh.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(got, expected), name
    assert_optimizer_state_equal(_keyed_by_name(fresh, fresh_optimizer), model, optimizer)


def _keyed_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer``'s state in the by-name layout of checkpoints, to compare with the source optimizer."""
    names = [n for n, _ in model.named_parameters()]
    plain = optimizer.state_dict()
    return {
        "state": {names[i]: s for i, s in plain["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in plain["param_groups"]],
    }


def test_model_only_keeps_every_model_and_drops_optimizer_and_metadata(tmp_path):
    model, optimizer = trained()
    ema = Llama(CONFIG)
    save_state(tmp_path / "ckpt", {"model": model, "ema": ema, "optimizer": optimizer, "step": 3}, full=False)
    convert_to_file(tmp_path / "ckpt", tmp_path / "weights.pt", model_only=True, progress=False)
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert list(weights) == ["model", "ema"]
    for key, module in (("model", model), ("ema", ema)):
        fresh = Llama(CONFIG)
        fresh.load_state_dict(weights[key])
        assert all(
            torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), module.state_dict().values(), strict=True)
        )


@pytest.fixture(scope="module")
def tiny_moments(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Llama, Llama, torch.optim.AdamW]:
    """Two models and an Adam whose ``exp_avg_sq`` holds values float16 flushes to 0 (and bfloat16 rounds).

    Under names that say nothing ("net", "shadow", "adam"): what is a model and what an optimizer is read
    from the checkpoint's structure.
    """
    model, optimizer = trained()
    shadow = Llama(CONFIG)
    for state in optimizer.state.values():
        state["exp_avg_sq"].view(-1)[::2] = 3e-9  # float16's smallest subnormal is 6e-8
        state["exp_avg"].view(-1)[::3] = 1.2345678e-9
    folder = tmp_path_factory.mktemp("tiny") / "ckpt"
    save_state(folder, {"net": model, "shadow": shadow, "adam": optimizer, "step": 2}, full=False)
    return folder, model, shadow, optimizer


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_dtype_casts_the_model_weights_and_keeps_optimizer_state_bit_identical(tiny_moments, tmp_path, dtype):
    folder, model, shadow, optimizer = tiny_moments
    assert any(bool((s["exp_avg_sq"].to(torch.float16) == 0).any()) for s in optimizer.state.values())
    convert_to_file(folder, tmp_path / "cast.pt", dtype=dtype, progress=False)
    full = torch.load(tmp_path / "cast.pt", weights_only=True)
    assert list(full) == ["net", "shadow", "adam", "step"] and full["step"] == 2
    for key, module in (("net", model), ("shadow", shadow)):
        for name, tensor in module.state_dict().items():
            assert full[key][name].dtype == dtype and torch.equal(full[key][name], tensor.to(dtype)), (key, name)
    assert_optimizer_state_equal(full["adam"], model, optimizer)  # same dtype, equal values, step counters too


def test_cli_dtype_keeps_optimizer_state_and_the_converted_file_resumes_it_exactly(tiny_moments, tmp_path):
    # In process: each interpreter start costs seconds.
    folder, model, _, optimizer = tiny_moments
    assert main(["convert", str(folder), str(tmp_path / "fp16.pt"), "--dtype", "fp16", "--no-progress"]) == 0
    full = torch.load(tmp_path / "fp16.pt", weights_only=True)
    assert full["net"]["output.weight"].dtype == torch.float16
    assert_optimizer_state_equal(full["adam"], model, optimizer)
    # and back to a folder: the optimizer state is still exact there
    convert_to_distributed(tmp_path / "fp16.pt", tmp_path / "again", progress=False)
    fresh, fresh_optimizer = trained(seed=1)
    state = {"net": fresh, "shadow": Llama(CONFIG), "adam": fresh_optimizer, "step": 0}
    load_state(tmp_path / "again", state)
    assert_optimizer_state_equal(_keyed_by_name(fresh, fresh_optimizer), model, optimizer)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor.to(torch.float16).float()), name


def test_dtype_on_a_checkpoint_without_models_is_explained(tmp_path):
    model, optimizer = trained()
    save_state(tmp_path / "opt_only", {"optimizer": optimizer}, full=False, known_modules=[model])
    with pytest.raises(
        ValueError,
        match=r"holds no model state dict for `dtype=torch\.float16` to cast \(optimizer state and other entries keep"
        r" their dtypes\); it has: 'optimizer' \(optimizer\)\. Convert without `dtype`\.",
    ):
        convert_to_file(tmp_path / "opt_only", tmp_path / "w.pt", dtype=torch.float16)
    assert not (tmp_path / "w.pt").exists()


def test_describe_lists_format_keys_shapes_dtypes_sizes_and_metadata(source, tmp_path):
    folder, _, _ = source
    convert_to_file(folder, tmp_path / "full.pt", progress=False)
    for path, fmt in ((folder, "distributed"), (tmp_path / "full.pt", "full")):
        text = describe_checkpoint(path)
        assert text.startswith(f"format: {fmt}")
        assert "model.tok_embeddings.weight" in text and "[64, 32]" in text and "float32" in text
        assert "8.0 KiB" in text  # 64 x 32 x 4 bytes
        assert "optimizer.state.norm.weight.exp_avg_sq" in text
        assert "total: 84 tensors, 266.0 KiB" in text  # 21 weights + 21 x (exp_avg, exp_avg_sq, step)
        assert text.endswith("metadata: step, note")


def test_errors_name_the_path_what_it_is_and_the_fix(source, tmp_path):
    folder, _, _ = source
    convert_to_file(folder, tmp_path / "full.pt", progress=False)
    with pytest.raises(CheckpointNotFoundError, match=r"No checkpoint at '.*nope': the path does not exist"):
        convert_to_file(tmp_path / "nope", tmp_path / "out.pt")
    with pytest.raises(
        ValueError,
        match=r"'.*full\.pt' is a full checkpoint \(one file\), but `convert_to_file`.*use `convert_to_distributed` \(`modelpar convert SRC DST --to distributed`\)",
    ):
        convert_to_file(tmp_path / "full.pt", tmp_path / "out.pt")
    with pytest.raises(
        ValueError,
        match=r"'.*ckpt' is a distributed checkpoint \(a folder\), but `convert_to_distributed`.*use `convert_to_file`",
    ):
        convert_to_distributed(folder, tmp_path / "out")
    with pytest.raises(
        FileExistsError, match=r"destination '.*full\.pt' already exists\. Pass `overwrite=True` \(`--overwrite`"
    ):
        convert_to_file(folder, tmp_path / "full.pt")
    with pytest.raises(ValueError, match=r"destination '.*ckpt' is the source checkpoint itself"):
        convert_to_file(folder, folder, overwrite=True)
    with pytest.raises(
        TypeError, match=r"`dtype=torch\.int8` is not a floating-point torch dtype\. Pass e\.g\. `torch\.bfloat16`"
    ):
        convert_to_file(folder, tmp_path / "out.pt", dtype=torch.int8)
    (tmp_path / "plain").mkdir()
    with pytest.raises(
        IsADirectoryError, match=r"Refusing to replace '.*plain': it is a folder that is not a checkpoint"
    ):
        convert_to_file(folder, tmp_path / "plain", overwrite=True)
    with pytest.raises(
        ValueError, match=r"The folder '.*plain' does not point to a valid checkpoint: it has no '\.metadata'"
    ):
        convert_to_file(tmp_path / "plain", tmp_path / "out.pt")
    torch.save({"step": 3}, tmp_path / "meta_only.pt")
    with pytest.raises(
        ValueError, match=r"'.*meta_only\.pt' holds no model or optimizer state dict \(its top-level entries: 'step'\)"
    ):
        convert_to_distributed(tmp_path / "meta_only.pt", tmp_path / "out")
    (tmp_path / "text.pt").write_text("not a checkpoint")
    with pytest.raises(
        CorruptCheckpointError,
        match=r"The checkpoint file '.*text\.pt' cannot be read: it is truncated, corrupt, or not a checkpoint",
    ):
        convert_to_distributed(tmp_path / "text.pt", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.pt").exists()


def test_model_only_on_a_checkpoint_without_models_is_explained(tmp_path):
    model, optimizer = trained()
    folder = tmp_path / "opt_only"
    save_state(folder, {"optimizer": optimizer, "step": 1}, full=False, known_modules=[model])
    with pytest.raises(
        ValueError, match=r"holds no model state dict to keep with `model_only=True`; it has: 'optimizer' \(optimizer\)"
    ):
        convert_to_file(folder, tmp_path / "w.pt", model_only=True)


def test_overwrite_replaces_an_existing_file_or_checkpoint_folder(source, tmp_path):
    folder, _, _ = source
    (tmp_path / "full.pt").write_bytes(b"old")
    convert_to_file(folder, tmp_path / "full.pt", model_only=True, overwrite=True, progress=False)
    assert list(torch.load(tmp_path / "full.pt", weights_only=True)) == ["model"]
    convert_to_distributed(tmp_path / "full.pt", tmp_path / "dist", progress=False)
    convert_to_file(folder, tmp_path / "full.pt", overwrite=True, progress=False)
    convert_to_distributed(tmp_path / "full.pt", tmp_path / "dist", overwrite=True, progress=False)
    assert "optimizer.state.norm.weight.exp_avg" in describe_checkpoint(tmp_path / "dist")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dist", "full.pt"]  # no staging leftovers


def test_a_failed_conversion_leaves_no_destination_and_no_staging_entry(source, tmp_path):
    folder, _, _ = source
    broken = tmp_path / "broken"
    broken.mkdir()
    for entry in folder.iterdir():
        data = entry.read_bytes()
        (broken / entry.name).write_bytes(data[: len(data) // 2] if entry.suffix == ".distcp" else data)
    with pytest.raises(
        CorruptCheckpointError, match=r"from the checkpoint '.*broken' failed: it is truncated or corrupt"
    ):
        convert_to_file(broken, tmp_path / "out.pt", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]


def test_progress_is_a_single_summary_line_when_stderr_is_not_a_terminal(source, tmp_path, capsys):
    folder, _, _ = source
    convert_to_file(folder, tmp_path / "full.pt")
    convert_to_distributed(tmp_path / "full.pt", tmp_path / "dist")
    out, err = capsys.readouterr()
    assert out == "" and "\r" not in err
    lines = err.splitlines()
    assert len(lines) == 2, err
    for line, dst in zip(lines, ("full.pt", "dist"), strict=True):
        assert re.fullmatch(rf"converted 84 tensors \(266\.0 KiB\) into '.*{dst}' in \d+\.\d s", line), line


def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "modelpar", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_cli_converts_a_folder_to_bf16_weights_and_inspects_them(source, tmp_path):
    folder, model, _ = source
    converted = run_cli("convert", folder, tmp_path / "w.pt", "--model-only", "--dtype", "bf16")
    assert converted.returncode == 0, converted.stderr
    assert converted.stdout == ""
    assert re.fullmatch(
        r"converted 21 tensors \(44\.3 KiB\) into '.*w\.pt' in \d+\.\d s", converted.stderr.splitlines()[-1]
    )
    weights = torch.load(tmp_path / "w.pt", weights_only=True)
    assert torch.equal(weights["model"]["output.weight"], model.output.weight.detach().to(torch.bfloat16))
    inspected = run_cli("inspect", tmp_path / "w.pt")
    assert inspected.returncode == 0, inspected.stderr
    assert inspected.stdout.startswith("format: full") and "model.output.weight" in inspected.stdout
    assert "[64, 32]  bfloat16" in inspected.stdout and "metadata: (none)" in inspected.stdout


def test_cli_reports_errors_in_one_line_with_exit_code_2(tmp_path, capsys):
    # In process: `python -m modelpar` is `raise SystemExit(main())`, and each interpreter start costs seconds.
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "out.pt")]) == 2
    assert (
        capsys.readouterr().err == f"error: No checkpoint at {str(tmp_path / 'missing')!r}: the path does not exist.\n"
    )
    assert main(["inspect", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(
        f"error: The folder {str(tmp_path)!r} does not point to a valid checkpoint"
    )
    torch.save({"model": {"w": torch.ones(2)}}, tmp_path / "w.pt")
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(tmp_path / "w.pt"), str(tmp_path / "d"), "--dtype", "bf16"])
    assert exit_info.value.code == 2
    assert "--model-only and --dtype apply when converting to a file (--to file) only" in capsys.readouterr().err


WITHOUT_LIGHTNING = textwrap.dedent(
    """
    import sys

    class NoLightning:  # an import of Lightning fails here, so a module that needs it shows up as an error
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("lightning", "lightning_fabric", "pytorch_lightning"):
                raise ImportError(f"{name} imported")

    sys.meta_path.insert(0, NoLightning())
    import modelpar
    from modelpar._cli import main

    folder, out = sys.argv[1:]
    codes = [main(["inspect", folder]), main(["convert", folder, out])]
    # Only the estimate needs the packages behind its choices (torch._dynamo through float8: seconds of start-up).
    print(sorted(name for name in ("modelpar.float8", "modelpar.plans", "torch._dynamo") if name in sys.modules))
    # What `import modelpar` reached before its names became lazy is still reached, without Lightning.
    # Every public name but the strategy (a Lightning strategy), and every subpackage but the strategy's.
    reached = [getattr(modelpar, name) for name in modelpar.__all__ if name != "ModelParallelStrategy"]
    reached += [modelpar.checkpoint.save_state, modelpar.memory.estimate_memory, modelpar.plans.ParallelPlan,
                modelpar.models.Llama, modelpar.pipeline.OFFERED_SCHEDULES, modelpar.float8.RECIPES, modelpar.moe,
                modelpar.legacy, modelpar.context]
    print(*codes, main(["estimate", "--llama", "{}", "--dp", "2"]))
    """
)


def test_the_command_line_checkpoints_and_the_estimate_run_without_importing_lightning(source, tmp_path):
    # Lightning's package import costs ~2.5 s of CPU (Fabric, torchmetrics, transformers): only a run should pay it.
    command = [sys.executable, "-c", WITHOUT_LIGHTNING, str(source[0]), str(tmp_path / "full.pt")]
    child = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.splitlines()[-1] == "0 0 0", child.stdout[-3000:] + child.stderr[-3000:]
    assert "[]" in child.stdout.splitlines(), child.stdout[-3000:]  # inspect and convert: no estimate packages


MEMORY_CHILD = textwrap.dedent(
    """
    import re, sys
    from modelpar.checkpoint._convert import convert_to_file

    def peak():
        with open("/proc/self/status") as status:
            return int(re.search(r"VmHWM:\\s+(\\d+) kB", status.read()).group(1)) * 1024

    baseline = peak()
    convert_to_file(sys.argv[1], sys.argv[2], progress=False)
    print(baseline, peak())
    """
)


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads peak memory from /proc (Linux)")
def test_consolidating_200_mb_stays_far_below_the_checkpoint_size_in_peak_memory(tmp_path):
    weights = nn.ParameterDict({f"w{i}": nn.Parameter(torch.full((2500, 2500), float(i))) for i in range(8)})
    size = sum(p.numel() * p.element_size() for p in weights.parameters())  # 8 x 25 MB
    save_state(tmp_path / "big", {"model": weights}, full=False)
    del weights
    command = [sys.executable, "-c", MEMORY_CHILD, str(tmp_path / "big"), str(tmp_path / "big.pt")]
    child = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert child.returncode == 0, child.stderr
    baseline, peak = map(int, child.stdout.split())
    growth = peak - baseline
    print(f"checkpoint {size / 2**20:.0f} MiB: baseline {baseline / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB")
    assert growth < 0.6 * size, f"peak memory grew by {growth / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB checkpoint"
    consolidated = torch.load(tmp_path / "big.pt", mmap=True, weights_only=True)
    assert [float(t[0, 0]) for t in consolidated["model"].values()] == [float(i) for i in range(8)]
    assert all(bool((t == t[0, 0]).all()) for t in consolidated["model"].values())
