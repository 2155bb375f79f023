"""Hugging Face pretrained folders in one process: load, export, offline export of a checkpoint, the CLI.

Every result is compared with what transformers itself does: ``from_pretrained`` of the same folder (weights,
buffers, logits, exactly), and ``from_pretrained`` of what we write.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import modelpar.hf
from hf_tiny import tiny_config
from modelpar import CheckpointKeyError, CheckpointShapeError
from modelpar._cli import main
from modelpar.checkpoint import save_state
from modelpar.hf import export_checkpoint, load_pretrained, save_pretrained


def pretrained(folder: Path, *, tied: bool = False, dtype: torch.dtype = torch.float32, shard: str = "5GB") -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(tie_word_embeddings=tied)).to(dtype)
    model.save_pretrained(folder, max_shard_size=shard)
    return folder


def fresh(**overrides: object) -> torch.nn.Module:
    torch.manual_seed(123)  # other values than the folder's, so a tensor left unloaded shows
    return AutoModelForCausalLM.from_config(tiny_config(**overrides))


def in_bf16(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in bfloat16 as transformers builds it (``model.to`` would also round the float32 ``inv_freq``)."""
    copy = AutoModelForCausalLM.from_config(model.config, dtype=torch.bfloat16)
    copy.load_state_dict(model.state_dict())
    return copy


def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(5))


def assert_same_model(got: torch.nn.Module, want: torch.nn.Module) -> None:
    got_state, want_state = got.state_dict(), want.state_dict()
    assert list(got_state) == list(want_state)
    for name, value in want_state.items():
        assert got_state[name].dtype == value.dtype, name
        assert torch.equal(got_state[name], value), name
    for (name, buffer), (_, want_buffer) in zip(got.named_buffers(), want.named_buffers(), strict=True):
        assert torch.equal(buffer, want_buffer), name
    with torch.no_grad():
        assert torch.equal(got(tokens()).logits, want(tokens()).logits)


def test_the_public_surface_is_load_save_export_plan_the_refusal_error_and_the_router_loss():
    assert modelpar.hf.__all__ == [
        "RefusedStyleError",
        "load_pretrained",
        "save_pretrained",
        "export_checkpoint",
        "plan_for",
        "router_aux_loss",
        "with_global_router_loss",
    ]


def test_importing_without_transformers_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "modelpar.hf" or m.startswith("modelpar.hf.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"needs transformers.*pip install 'modelpar\[hf\]'"):
        importlib.import_module("modelpar.hf")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("shard", ["5GB", "20KB"], ids=["single-file", "sharded-with-index"])
@pytest.mark.parametrize("file_dtype", [torch.float32, torch.bfloat16], ids=["fp32-file", "bf16-file"])
def test_loading_into_a_plain_model_equals_from_pretrained_exactly(tmp_path, tied, shard, file_dtype):
    folder = pretrained(tmp_path / "pretrained", tied=tied, dtype=file_dtype, shard=shard)
    assert (folder / "model.safetensors.index.json").is_file() == (shard != "5GB")
    model = fresh(tie_word_embeddings=tied)
    load_pretrained(model, folder)
    want = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert_same_model(model, want)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_loading_a_base_models_folder_into_a_model_with_a_head_and_back(tmp_path):
    folder = pretrained(tmp_path / "pretrained", tied=True)
    full = AutoModelForCausalLM.from_pretrained(folder)
    base = full.model.__class__(tiny_config())  # LlamaModel: names without the "model." prefix
    load_pretrained(base, folder)
    for name, value in base.state_dict().items():
        assert torch.equal(value, full.state_dict()[f"model.{name}"]), name
    base.save_pretrained(tmp_path / "base")
    model = fresh(tie_word_embeddings=True)
    load_pretrained(model, tmp_path / "base")
    assert_same_model(model, full)


def test_key_and_shape_mismatches_raise_before_anything_is_modified(tmp_path):
    folder = pretrained(tmp_path / "pretrained")
    model = fresh(num_hidden_layers=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        CheckpointKeyError, match=r"9 missing \(e\.g\. \['model\.layers\.2\..*0 unexpected.*strict=False"
    ):
        load_pretrained(model, folder)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    load_pretrained(model, folder, strict=False)  # the two layers the folder has
    want = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert torch.equal(
        model.state_dict()["model.layers.1.mlp.up_proj.weight"], want["model.layers.1.mlp.up_proj.weight"]
    )
    assert torch.equal(
        model.state_dict()["model.layers.2.mlp.up_proj.weight"], before["model.layers.2.mlp.up_proj.weight"]
    )

    model = fresh(vocab_size=256)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        CheckpointShapeError,
        match=r"'model.embed_tokens.weight'.*the checkpoint has \(128, 32\), the model expects \(256, 32\)",
    ):
        load_pretrained(model, folder)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    with pytest.raises(
        CheckpointKeyError,
        match=r"separate tensors for \['model.embed_tokens.weight', 'lm_head.weight'\], which the model ties.*tie_word_embeddings=False",
    ):
        load_pretrained(fresh(tie_word_embeddings=True), folder)


def test_dtype_is_checked_against_the_models_weights(tmp_path):
    folder = pretrained(tmp_path / "pretrained", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"`dtype=torch.bfloat16` was given, but the model holds .* in torch.float32"):
        load_pretrained(fresh(), folder, dtype=torch.bfloat16)
    model = in_bf16(fresh())
    load_pretrained(model, folder, dtype=torch.bfloat16)
    assert_same_model(model, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16))


def test_missing_folders_and_bin_weights_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="No pretrained model folder at"):
        load_pretrained(fresh(), tmp_path / "absent")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"PyTorch `.bin` weights.*save_pretrained"):
        load_pretrained(fresh(), tmp_path / "bin")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_an_export_loads_with_from_pretrained_with_identical_logits(tmp_path, tied):
    model = AutoModelForCausalLM.from_pretrained(pretrained(tmp_path / "pretrained", tied=tied))
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)  # "trained": differs from the folder it came from
    save_pretrained(model, tmp_path / "export")
    names = sorted(p.name for p in (tmp_path / "export").iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors"]
    with safe_open(tmp_path / "export" / "model.safetensors", framework="pt") as file:
        assert ("lm_head.weight" in set(file.keys())) == (not tied)  # tied weights written once, as HF does
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    assert_same_model(back, model)
    assert json.loads((tmp_path / "export" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_an_export_in_bf16_casts_the_weights_and_says_so_in_the_config(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(pretrained(tmp_path / "pretrained"))
    save_pretrained(model, tmp_path / "export", dtype=torch.bfloat16)
    saved = load_file(tmp_path / "export" / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "export" / "config.json").read_text())["dtype"] == "bfloat16"
    want = in_bf16(model).state_dict()
    assert all(torch.equal(saved[k], want[k]) for k in saved)


def test_a_small_max_shard_size_writes_several_files_and_an_index(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(pretrained(tmp_path / "pretrained"))
    save_pretrained(model, tmp_path / "export", max_shard_size="30KB")
    files = sorted((tmp_path / "export").glob("model-*.safetensors"))
    assert len(files) > 2 and files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())
    state = model.state_dict()
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in state.values())
    for file in files:  # each file is valid safetensors, at most the limit unless one tensor is larger
        tensors = load_file(file)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= 30_000 or len(tensors) == 1
        assert all(index["weight_map"][k] == file.name for k in tensors)
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "export"), model)
    reloaded = fresh()
    load_pretrained(reloaded, tmp_path / "export")
    assert_same_model(reloaded, model)


def test_an_export_replaces_an_earlier_one_keeping_the_tokenizer_and_refuses_other_folders(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(pretrained(tmp_path / "pretrained"))
    save_pretrained(model, tmp_path / "export", max_shard_size="30KB")
    (tmp_path / "export" / "tokenizer.json").write_text("{}")
    save_pretrained(model, tmp_path / "export")
    names = sorted(p.name for p in (tmp_path / "export").iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export")]  # no staging leftovers
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(IsADirectoryError, match="no pretrained model"):
        save_pretrained(model, tmp_path / "notes")
    with pytest.raises(ValueError, match=r"`max_shard_size='5 apples'` is not a size"):
        save_pretrained(model, tmp_path / "other", max_shard_size="5 apples")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_distributed_checkpoint_exports_offline_to_what_from_pretrained_loads(tmp_path, tied):
    folder = pretrained(tmp_path / "pretrained", tied=tied)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.model.norm.weight.add_(0.25)
    save_state(tmp_path / "ckpt", {"model": model, "step": 3}, full=False)
    export_checkpoint(tmp_path / "ckpt", tmp_path / "export", config=folder, max_shard_size="40KB", progress=False)
    assert (tmp_path / "export" / "model.safetensors.index.json").is_file()
    assert (tmp_path / "export" / "generation_config.json").is_file()
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "export"), model)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "export", config=folder)
    export_checkpoint(tmp_path / "ckpt", tmp_path / "export", config=model.config, dtype=torch.bfloat16, overwrite=True)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype="auto")
    assert back.dtype == torch.bfloat16
    assert_same_model(back, in_bf16(model))


def test_offline_export_checks_the_config_and_the_key(tmp_path):
    folder = pretrained(tmp_path / "pretrained")
    save_state(tmp_path / "ckpt", {"model": AutoModelForCausalLM.from_pretrained(folder)}, full=False)
    with pytest.raises(
        CheckpointKeyError, match=r"9 missing \(e\.g\. \['model\.layers\.2.*Pass the config of the model"
    ):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "export", config=tiny_config(num_hidden_layers=3))
    with pytest.raises(CheckpointShapeError, match=r"the checkpoint has \(128, 32\), the model expects \(256, 32\)"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "export", config=tiny_config(vocab_size=256))
    with pytest.raises(ValueError, match=r"no model state dict under 'state_dict'; its entries are \['model'\]"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "export", config=folder, key="state_dict")
    with pytest.raises(FileNotFoundError, match=r"No 'config\.json'"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "export", config=tmp_path)
    assert not (tmp_path / "export").exists()


def test_the_cli_converts_a_distributed_checkpoint_to_a_pretrained_folder(tmp_path, capsys):
    folder = pretrained(tmp_path / "pretrained", tied=True)
    model = AutoModelForCausalLM.from_pretrained(folder)
    save_state(tmp_path / "ckpt", {"model": model}, full=False)
    args = ["convert", str(tmp_path / "ckpt"), str(tmp_path / "export"), "--to", "hf", "--config", str(folder)]
    assert main([*args, "--dtype", "bf16", "--max-shard-size", "20KB"]) == 0
    assert "converted" in capsys.readouterr().err
    assert_same_model(
        AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32), in_bf16(model).float()
    )
    assert main(args) == 2
    assert "already holds a pretrained model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(args[:5])
    assert "--to hf needs --config" in capsys.readouterr().err


def test_exports_to_a_url_upload_what_from_pretrained_loads_config_last(tmp_path, s3_server):
    """Both exports (offline from a checkpoint at a URL, and of a live model) to ``s3://``: downloaded, they load."""
    url = s3_server.new_bucket()
    folder = pretrained(tmp_path / "pretrained", tied=True)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.model.norm.weight.add_(0.25)
    save_state(f"{url}/ckpt", {"model": model}, full=False)
    export_checkpoint(f"{url}/ckpt", f"{url}/offline", config=folder, max_shard_size="40KB", progress=False)
    save_pretrained(model, f"{url}/live")
    fs = s3_server.filesystem()
    for name in ("offline", "live"):
        fs.get(f"{url[5:]}/{name}/", str(tmp_path / name) + "/", recursive=True)
        assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / name), model)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_checkpoint(f"{url}/ckpt", f"{url}/offline", config=folder)
