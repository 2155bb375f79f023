"""The suite's own rules, in this process (milliseconds, no spawn): skips that cannot lie, and the summary.

The GPU run of 2026-11-26 (issue 25) skipped ten tests as "gloo cannot run all_reduce on CUDA tensors" when
modelpar's mesh build had raised: the probe went through modelpar's set-up, failed, left no record, and every
case read the missing record as a gloo limit. These tests hold the rules that rule that out; the spawned half
(modelpar's set-up made to raise in a rank) is in ``test_gpu_shared_device``.

The float8 part (issue 29) has rules of the same kind: its cases skip, naming what is missing (torchao, or a GPU
with float8 multiplies), before any modelpar code; the benchmark's float8 ``[summary]`` lines read issue 29's goal
and the stated loss tolerance, and reach the summary whole; a comparison that did not run says why there.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import gpu_summary
import pytest
import torch
import torch_probe
from gpu_common import SkipCase, _modelpar_root, check, needs, run_cases

_HERE = Path(__file__).parent


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_probe_imports_no_modelpar_code() -> None:
    for path in (_HERE / "torch_probe.py", _HERE.parent / "harness.py"):
        imported = _imports(path)
        ours = {name for name in imported if name.split(".")[0] in ("modelpar", "gpu_common", "parity")}
        assert not ours, f"{path.name} imports {sorted(ours)}: the probe must run torch alone"


def test_a_case_needing_a_call_the_probe_never_recorded_fails_instead_of_skipping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch_probe, "PROBED", {})
    result = run_cases({"case": lambda: needs("all_reduce")})["case"]
    assert result["ok"] is False, result
    assert "recorded nothing" in result["error"], result["error"]


def test_a_skip_names_the_torch_call_that_failed_and_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    call = "dist.all_reduce(float32 a cuda tensor)"
    monkeypatch.setattr(
        torch_probe,
        "PROBED",
        {"init_process_group": {"call": "init", "error": None}, "all_reduce": {"call": call, "error": "E: no"}},
    )
    result = run_cases({"case": lambda: needs("all_reduce")})["case"]
    assert result["ok"] is None, result
    assert call in result["skip"] and "E: no" in result["skip"], result["skip"]
    with pytest.raises(pytest.skip.Exception, match="E: no"):
        check([{"case": result}], "case")


def test_a_case_cannot_skip_on_what_the_probe_records_for_information_only() -> None:
    result = run_cases({"case": lambda: needs("init_device_mesh")})["case"]
    assert result["ok"] is False and "information only" in result["error"], result


def _skip_while_handling(chained: bool) -> dict[str, Any]:
    try:
        raise ValueError("the mesh build raised")
    except ValueError as error:
        if chained:
            raise SkipCase("looks like a gloo limit") from error
        raise SkipCase("looks like a gloo limit") from None


@pytest.mark.parametrize("chained", [True, False], ids=["from_error", "from_none"])
def test_a_skip_raised_while_handling_an_exception_is_reported_as_that_failure(chained: bool) -> None:
    results = [run_cases({"case": lambda: _skip_while_handling(chained)})]
    assert results[0]["case"]["ok"] is False, results
    with pytest.raises(AssertionError) as reported:
        check(results, "case")
    first = str(reported.value).splitlines()[0]
    assert "while handling ValueError: the mesh build raised" in first, first


def test_a_skip_raised_from_inside_modelpars_code_is_reported_as_a_failure() -> None:
    root = _modelpar_root()
    assert root is not None, "modelpar is not importable here"
    namespace: dict[str, Any] = {"SkipCase": SkipCase}
    # A function whose code says it lives in modelpar, as a plan callback raising inside setup_module would.
    exec(
        compile("def inside():\n    raise SkipCase('from modelpar')\n", os.path.join(root, "_x.py"), "exec"), namespace
    )
    result = run_cases({"case": namespace["inside"]})["case"]
    assert result["ok"] is False and "inside modelpar's code" in result["cause"], result


def test_a_failed_case_reports_its_own_error_on_the_first_line() -> None:
    tb = (
        "Traceback (most recent call last):\n"
        '  File "src/modelpar/_mesh/layout.py", line 379, in build\n'
        "    mesh = init_device_mesh(...)\n"
        "RuntimeError: No device(s) specified\n"
    )
    results = [{"case": {"ok": False, "error": tb}}, {"case": {"ok": False, "error": tb}}]
    with pytest.raises(AssertionError) as reported:
        check(results, "case")
    first = str(reported.value).splitlines()[0]
    assert (
        first == "case case failed on 2 of 2 rank(s): RuntimeError: No device(s) specified (rank 0; tracebacks below)"
    )


_JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.gpu.test_gpu_one_process" name="test_mesh" time="30.5"/>
<testcase classname="tests.gpu.test_gpu_one_process" name="test_hf" time="0.1">
  <skipped type="pytest.skip" message="transformers is not installed">skip</skipped></testcase>
<testcase classname="tests.gpu.test_gpu_shared_device" name="test_training[2]" time="40.0">
  <failure message="AssertionError: case training failed on 2 of 2 rank(s): RuntimeError: boom (rank 0)
--- rank 0 ---">E   AssertionError: case training failed</failure></testcase>
<testcase classname="tests.gpu.test_gpu_shared_device" name="test_clipping[4]" time="12.0">
  <error message="failed on setup with &quot;AssertionError: 1 of 4 ranks failed:">E   AssertionError: 1 of 4 ranks failed:
E   --- rank 2 ---
E   Traceback (most recent call last):
E     File "tests/harness.py", line 52, in _worker
E   OSError: [Errno 98] Address already in use</error></testcase>
<testcase classname="tests.gpu.test_gpu_shared_device" name="test_compile" time="2.0">
  <skipped type="pytest.skip" message="torch alone could not run dist.all_reduce: E: no">s</skipped></testcase>
</testsuite></testsuites>
"""


def _summary(tmp_path: Path, *, junit: bool = True, bench: bool = True, **float8: Any) -> list[str]:
    if junit:
        (tmp_path / "junit.xml").write_text(_JUNIT)
    (tmp_path / "pytest.log").write_text("== 1 failed, 1 passed in 80.1s ==\n")
    (tmp_path / "environment.txt").write_text(
        "== environment (2026-11-26T10:46Z, commit f42665c) ==\nNVIDIA H200, 143771 MiB, 580.159.04\n"
        "torch 2.11.0+cu130, CUDA 13.0, NCCL 2.28.9, 1 GPU(s): NVIDIA H200\nlightning_fabric 2.6.6\n"
        "transformers 5.17.0\nNOTE: torch 2.11.0+cu130 is below modelpar's floor (2.13)\n"
    )
    (tmp_path / "figures.txt").write_text(
        "[gpu-suite] gloo_cuda_collectives: {'torch': '2.11', 'device': 'cuda:0', 'ranks': 2,"
        " 'init_process_group': 'ok', 'all_reduce': 'ok', 'all_to_all_single': 'RuntimeError: nope'}\n"
    )
    if bench:
        (tmp_path / "bench_mfu.txt").write_text(
            "== benchmarks/bench_mfu.py ==\n[rank0]:W1126 noise\nmodelpar: 65900 tokens/s\n\n| variant | tokens/s |\n"
        )
    args = argparse.Namespace(
        exit=1, pytest_exit=1, pytest_seconds=85.0, bench_exit=0 if bench else None, bench_seconds=46.0,
        wall_seconds=140.0, float8_in_bench=None, float8_not_run=None,
    )  # fmt: skip
    vars(args).update(float8)
    return gpu_summary.render(tmp_path, args)


def test_the_summary_counts_each_file_and_names_each_failure_skip_probe_and_benchmark_line(tmp_path: Path) -> None:
    text = "\n".join(_summary(tmp_path))
    assert "environment: NVIDIA H200, 143771 MiB, 580.159.04 | torch 2.11.0+cu130" in text, text
    assert "lightning_fabric 2.6.6, transformers 5.17.0 | 2026-11-26T10:46Z, commit f42665c" in text, text
    assert "NOTE: torch 2.11.0+cu130 is below" in text
    assert "tests/gpu/test_gpu_one_process.py    1 passed, 0 failed, 1 skipped (31 s)" in text, text
    assert "tests/gpu/test_gpu_shared_device.py  0 passed, 2 failed, 1 skipped (54 s)" in text, text
    assert (
        "test_gpu_shared_device.py::test_training[2]: AssertionError: case training failed on 2 of 2 rank(s):" in text
    )
    assert "test_gpu_shared_device.py::test_clipping[4]: failed on setup with" in text, text
    assert "OSError: [Errno 98] Address already in use" in text, text
    assert "test_gpu_one_process.py::test_hf: transformers is not installed" in text, text
    assert "test_gpu_shared_device.py::test_compile: torch alone could not run dist.all_reduce: E: no" in text
    assert "2 ranks on cuda:0, torch 2.11: 2 of 3 ok; all_to_all_single: RuntimeError: nope" in text, text
    assert "  modelpar: 65900 tokens/s\n  | variant | tokens/s |" in text and "noise" not in text, text
    assert "wall time: 2 min 20 s (pytest 85 s, benchmark 46 s)" in text, text
    assert text.splitlines()[-1].startswith("gpu-check: exit 1; results in "), text
    # Wherever the results are, the last line names the folder and its files whole (the others fit in WIDTH).
    deep = tmp_path / ("results-" * 30)
    deep.mkdir()
    last = _summary(deep)[-1]
    assert last.startswith(f"gpu-check: exit 1; results in {deep}/ (") and last.endswith(", summary.txt)"), last
    assert len(last) > gpu_summary.WIDTH, last


ONE = "tests/gpu/test_gpu_one_process.py"


def test_the_two_pytest_sides_merge_into_one_junit_and_a_side_without_results_is_a_failure(tmp_path: Path) -> None:
    """gpu-check.sh runs the one-process file in a pytest of its own beside the other files: one junit.xml for the
    summary, every side's files in it, and a side whose pytest wrote nothing (it crashed) counted as a failure."""
    (tmp_path / "others.xml").write_text(_JUNIT)
    (tmp_path / "none-selected.xml").write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="0"/></testsuites>'
    )
    target = tmp_path / "junit.xml"
    argv = ["--merge-junit", str(target), str(tmp_path / "others.xml"), "tests/gpu/ (the other files)", "1"]
    argv += [str(tmp_path / "none-selected.xml"), "tests/gpu/test_gpu_suite_itself.py", "5"]
    argv += [str(tmp_path / "missing.xml"), "tests/gpu/test_gpu_one_process.py", "3"]
    assert gpu_summary.main(argv) == 0
    outcomes = gpu_summary.read_junit(target)
    shared, one = outcomes.files["tests/gpu/test_gpu_shared_device.py"], outcomes.files[ONE]
    assert (shared.passed, shared.failed, shared.skipped) == (0, 2, 1), outcomes.files
    assert (one.passed, one.failed, one.skipped) == (1, 1, 1), outcomes.files  # _JUNIT's two cases, and the crash
    assert len(outcomes.files) == 2, outcomes.files  # the side that selected nothing adds nothing
    assert (
        "test_gpu_one_process.py::(its pytest)",
        f"pytest of {ONE} wrote no readable junit XML (exit 3; FileNotFoundError): read pytest.log",
    ) in outcomes.failures, outcomes.failures
    with pytest.raises(ValueError):  # a side given without its exit status
        gpu_summary.main(["--merge-junit", str(target), str(tmp_path / "others.xml"), "tests/gpu/"])


def test_the_summary_says_what_is_missing_rather_than_nothing(tmp_path: Path) -> None:
    text = "\n".join(_summary(tmp_path, junit=False, bench=False))
    assert "tests: no readable junit.xml" in text and "== 1 failed, 1 passed in 80.1s ==" in text, text
    assert "benchmark: left out (GPU_CHECK_SKIP_MFU=1)" in text, text
    assert "float8 comparison: left out with the benchmark (GPU_CHECK_SKIP_MFU=1)" in text, text


def test_the_summary_shows_the_benchmarks_table_and_the_float8_comparisons_summary_lines(tmp_path: Path) -> None:
    """One benchmark run holds both (gpu-check.sh runs the float8 variants beside the bf16 ones): the benchmark's
    part shows the table, the float8 part its ``[summary]`` lines, each once."""
    (tmp_path / "bench_mfu.txt").write_text(
        "== benchmarks/bench_mfu.py --float8 tensorwise --variants modelpar,lightning,torch ==\n"
        "Failed to load torchao/_C_mxfp8.so\n| variant | tokens/s |\n| modelpar | 65900 |\n"
        "| float8-tensorwise | 80100 |\nmodelpar / torch by hand: 1.014x\n"
        "[summary] float8 vs bf16 on NVIDIA H200, torch 2.11.0+cu130, torchao 0.18.0\n"
        "[summary]   float8-tensorwise: 80100 tokens/s; 1.215x bf16's tokens/s (goal at least 1.2x: met)\n"
    )
    (tmp_path / "bench_float8.txt").write_text("== can torchao train in float8 here? ==\n")
    text = "\n".join(_summary(tmp_path, bench=False, bench_exit=0, float8_in_bench="tensorwise"))
    benchmark, float8 = text.split("benchmark (")[1].split("float8 comparison")
    assert "  | float8-tensorwise | 80100 |\n  modelpar / torch by hand: 1.014x" in benchmark, text
    assert "[summary]" not in benchmark and "Failed to load" not in benchmark, text
    assert float8.startswith(" (--float8 tensorwise, in the benchmark's runs above):\n"), text
    assert "  [summary]   float8-tensorwise: 80100 tokens/s; 1.215x bf16's tokens/s (goal at least 1.2x: met)" in float8
    assert "| modelpar |" not in float8, text
    assert "wall time: 2 min 20 s (pytest 85 s, benchmark 46 s)" in text, text
    assert "bench_mfu.txt, bench_float8.txt, summary.txt)" in text.splitlines()[-1], text


def test_the_summary_reports_a_float8_comparison_that_did_not_run_with_its_reason(tmp_path: Path) -> None:
    why = "torchao is not installed (float8 needs torchao >= 0.18); bring it with pip install 'modelpar[float8]'"
    text = "\n".join(_summary(tmp_path, float8_not_run=why))
    assert f"float8 comparison: not run: {why}" in text, text
    assert "wall time: 2 min 20 s (pytest 85 s, benchmark 46 s)\n" in text, text  # no float8 seconds: it did not run


def test_the_float8_benchmarks_summary_lines_read_the_goal_and_the_tolerance(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.syspath_prepend(str(_HERE.parent.parent / "benchmarks"))
    import bench_mfu
    from _mfu_variants import RunResult

    args = bench_mfu.parse(["--float8", "tensorwise,rowwise", "--warmup", "1", "--steps", "3", "--no-compile"])
    assert args.variants == "modelpar,float8-tensorwise,float8-rowwise" and args.data == "phrases", args

    def run(variant: str, tps: float, losses: list[float], peak: float) -> RunResult:
        float8 = variant.removeprefix("float8-") if variant.startswith("float8-") else None
        torchao = "0.18.0" if float8 else None
        return RunResult(
            variant, 4, 2048, "NVIDIA H100 80GB HBM3", "2.11.0+cu130", 989.4, tps, peak_gib=peak, losses=losses,
            float8=float8, torchao_version=torchao,
        )  # fmt: skip

    bf16 = [10.4, 9.0, 8.0, 7.0]
    runs = {
        "modelpar": [run("modelpar", 60000.0, bf16, 30.0), run("modelpar", 62000.0, bf16, 30.0)],
        "float8-tensorwise": [run("float8-tensorwise", 75000.0, [10.4, 9.09, 8.0, 7.0], 27.5)] * 2,
        "float8-rowwise": [run("float8-rowwise", 66000.0, [99.0, 9.0, 8.0, float("nan")], 28.0)] * 2,
    }
    bench_mfu.report_float8(args, runs)
    printed = capsys.readouterr().out
    lines = "\n".join(line.strip() for line in printed.splitlines())
    assert "[summary] float8 vs bf16 on NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, torchao 0.18.0, batch" in lines
    assert "float8-tensorwise: 75000 tokens/s (75000-75000), peak 27.5 GiB; 1.230x bf16's tokens/s" in lines, lines
    assert "(goal at least 1.2x: met)\n[summary]     roofline (" in lines, lines  # what it could gain, next
    assert "\n[summary]     loss 9.090 -> 7.000, within 1.00% of bf16's" in lines, lines
    assert "at every timed step (tolerance 2%: within); largest at timed step 1 of 3: 9.090 against 9.000" in lines
    # The warm-up step's 99.0 is left out; a loss that is not finite is never within the tolerance.
    assert "float8-rowwise: 66000 tokens/s" in lines and "(goal at least 1.2x: NOT met)" in lines, lines
    nan = "loss 9.000 -> nan: a loss not finite or missing, its or bf16's (tolerance 2%: OUTSIDE); first at timed step"
    assert nan + " 3 of 3\n" in lines, lines
    # Every curve in full after the summary, bf16's first: a spike at one step tells itself from a drift.
    curves = printed[printed.index("[loss] at each of the 3 timed steps (each variant: the per-step median of") :]
    assert curves.splitlines()[1:4] == [
        "[loss]   modelpar           9.000 8.000 7.000",
        "[loss]   float8-tensorwise  9.090 8.000 7.000",
        "[loss]   float8-rowwise     9.000 8.000 nan",
    ], curves
    assert "modelpar bf16: 61000 tokens/s (60000-62000), peak 30.0 GiB; loss 9.000 -> 7.000" in lines, lines
    # What each recipe can gain on this model on an H100 (the roofline's own test checks its figures).
    roof = "roofline (78% of peak, 92% of bandwidth): 112 float8 layers 1.54x, the step about 1.20x (their bf16"
    assert lines.count(roof) == 2 and "multiplies 64 ms of its 134 ms)" in lines, lines
    (tmp_path / "bench_float8.txt").write_text(printed)
    shown = gpu_summary.bench_lines(tmp_path / "bench_float8.txt")
    assert len(shown) == 8 and all(
        line.startswith("  [summary]") and len(line) <= gpu_summary.WIDTH for line in shown
    ), shown
    # The curves stay out of the summary's view of the table too (its last lines where no line is marked).
    (tmp_path / "bench_mfu.txt").write_text("| modelpar | 61000 |\n" + printed)
    assert gpu_summary.bench_lines(tmp_path / "bench_mfu.txt", marked=False) == ["  | modelpar | 61000 |"]


def test_a_float8_case_skips_naming_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """No torchao, one too old, a GPU without float8 multiplies: each a skip that says so, before modelpar runs."""
    import test_gpu_one_process as one

    from modelpar.float8 import _torchao

    monkeypatch.setattr(_torchao, "installed_torchao", lambda: None)  # as importlib.metadata answers without it
    result = run_cases({"case": one.case_float8_tensorwise_trains_like_bf16})["case"]
    assert result["ok"] is None, result
    assert "which is not installed" in result["skip"] and "modelpar[float8]" in result["skip"], result
    monkeypatch.setattr(_torchao, "installed_torchao", lambda: "0.17.1")
    result = run_cases({"case": one.case_float8_tensorwise_trains_like_bf16})["case"]
    assert result["ok"] is None and "torchao 0.17.1 is installed" in result["skip"], result
    monkeypatch.setattr(_torchao, "installed_torchao", lambda: "0.18.0")
    monkeypatch.setattr(one, "on_cuda", lambda: True)
    monkeypatch.setattr(one, "device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    result = run_cases({"case": one.case_float8_rowwise_trains_like_bf16})["case"]
    assert result["ok"] is None, result
    assert result["skip"].startswith("NVIDIA A100-SXM4-80GB has compute capability 8.0: float8"), result


def test_the_benchmarks_profile_sorts_kernels_by_kind(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bench_mfu.py --profile``: kernel names as an H100/H200 run prints them go to the kind they are (the
    ``nvjet`` and Triton names are the H200's of 2026-11-28), float8 multiplies apart from bf16's (CUTLASS and
    cuBLAS name both), a cast never among the multiplies, and the table shows each kind that took time."""
    monkeypatch.syspath_prepend(str(_HERE.parent.parent / "benchmarks"))
    import bench_mfu
    from _mfu_variants import OTHER_KIND, RunResult, kernel_kind

    expected = {
        "sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off": (
            "float8 matmul"
        ),
        "void cutlass::device_kernel<cutlass_90_tensorop_f8f8bf16_rowwise_gemm_128x128x128_1x2x1>": "float8 matmul",
        "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_NTN": "matmul",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matmul",
        "nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_ovscale_TNT": "float8 matmul",
        "nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT": "float8 matmul",
        "triton_red_fused__scaled_mm__to_copy_abs_add_amax_clamp_clone_exp2_floor_log2_mul_reciprocal_silu": (
            "Triton (compiled)"
        ),
        "triton_poi_fused__scaled_mm_mm_0": "Triton (compiled)",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
        "::{lambda(c10::Float8_e4m3fn)#1}>": "copy and fill",
        "aten::_scaled_mm": "float8 matmul",
        "aten::mm": "matmul",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64": "matmul",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true, true>": "attention",
        "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "Triton (compiled)",
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
        "Memcpy DtoD (Device -> Device)": "copy and fill",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "copy and fill",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MaxOps<float>>>": OTHER_KIND,
    }
    assert {name: kernel_kind(name) for name in expected} == expected

    args = bench_mfu.parse(["--profile", "2", "--variants", "modelpar,float8-tensorwise"])
    assert args.profile == 2

    def run(variant: str, ms: dict[str, float]) -> RunResult:
        result = RunResult(variant, 4, 2048, "NVIDIA H200", "2.11.0+cu130", 989.4, 60000.0)
        result.profile_ms = {"step": 125.0, "busy": sum(ms.values()), **ms}
        return result

    kinds = {"float8 matmul": 0.0, "attention": 9.0, "matmul": 80.0, "communication": 0.0, "Triton (compiled)": 20.0}
    runs = {
        "modelpar": [run("modelpar", kinds)],
        "float8-tensorwise": [run("float8-tensorwise", {**kinds, "float8 matmul": 50.0, "matmul": 6.0})],
    }
    bench_mfu.report_profiles(runs)
    printed = capsys.readouterr().out
    assert "| variant | step | busy | float8 matmul | attention | matmul | Triton (compiled) |" in printed, printed
    assert "| modelpar | 125.00 | 109.00 | 0.00 | 9.00 | 80.00 | 20.00 |" in printed, printed
    assert "| float8-tensorwise | 125.00 | 85.00 | 50.00 | 9.00 | 6.00 | 20.00 |" in printed, printed
    assert "communication" not in printed.split("| variant |")[1], printed  # no run spent time there
    # With the counts a step that profile_steps adds: the host's operators and the kernels, after the kinds.
    for result, host_ops, launched in (
        (runs["modelpar"][0], 10873.4, 900.0),
        (runs["float8-tensorwise"][0], 13247, 1300),
    ):
        assert result.profile_ms is not None
        result.profile_ms |= {"host ops": host_ops, "kernels": launched}
    bench_mfu.report_profiles(runs)
    printed = capsys.readouterr().out
    assert "| float8 matmul | attention | matmul | Triton (compiled) | host ops | kernels |" in printed, printed
    assert "| modelpar | 125.00 | 109.00 | 0.00 | 9.00 | 80.00 | 20.00 | 10873 | 900 |" in printed, printed
    assert "then counts a step: the aten operators the host called, the kernels that ran" in printed, printed


def test_the_benchmarks_profile_sets_each_variants_multiplies_against_their_roofline(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--profile`` with float8 on an H200: the multiplies (both kinds, the output layer's included) against the
    roofline of the same layers, and what the rest of float8's kernels add over bf16's beside the casts' roofline.
    The 1.07B model's roofline, worked by hand: bf16 64.11 ms for the 112 converted layers plus 4.17 ms for the
    output layer (3 x 2 x 8192 x 2048 x 32000 FLOPs at 78% of 989.4 TFLOP/s); float8 32.05 + 4.17 ms."""
    monkeypatch.syspath_prepend(str(_HERE.parent.parent / "benchmarks"))
    import bench_mfu
    from _mfu_variants import RunResult

    args = bench_mfu.parse(["--profile", "2", "--variants", "modelpar,float8-tensorwise"])

    def run(variant: str, ms: dict[str, float], device: str = "NVIDIA H200", emulated: bool = False) -> RunResult:
        result = RunResult(variant, 4, 2048, device, "2.11.0+cu130", 989.4, 60000.0, emulated=emulated)
        result.profile_ms = {"step": 125.0, "busy": sum(ms.values()), **ms}
        return result

    kinds = {"float8 matmul": 0.0, "attention": 9.0, "matmul": 80.0, "Triton (compiled)": 20.0}
    float8 = {**kinds, "float8 matmul": 50.0, "matmul": 6.0, "Triton (compiled)": 32.0}
    runs = {"modelpar": [run("modelpar", kinds)], "float8-tensorwise": [run("float8-tensorwise", float8)]}
    bench_mfu.report_profile_roofline(args, runs)
    printed = capsys.readouterr().out
    assert "| modelpar | 125.00 | 109.00 | 80.00 | 68.29 | 1.17x | 9.00 | 20.00 |  |  |" in printed, printed
    assert "| float8-tensorwise | 125.00 | 97.00 | 56.00 | 36.23 | 1.55x | 9.00 | 32.00 | +12.00 | 6.72 |" in printed
    # Nothing to set against: emulated float8 (the CPU smoke check), or no float8 variant profiled.
    emulated = {**runs, "float8-tensorwise": [run("float8-tensorwise", float8, emulated=True)]}
    bench_mfu.report_profile_roofline(args, emulated)
    bench_mfu.report_profile_roofline(args, {"modelpar": runs["modelpar"]})
    assert capsys.readouterr().out == ""
    unknown = {v: [run(v, kinds, device="NVIDIA A100-SXM4-80GB")] for v in runs}
    bench_mfu.report_profile_roofline(args, unknown)
    assert "no specs for 'NVIDIA A100-SXM4-80GB'" in capsys.readouterr().out


def test_the_float8_multiply_benchmark_times_each_layers_three_multiplies_and_checks_their_products(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bench_float8_gemm.py`` (issue 29; on the CPU, its smoke check): a row per converted shape and multiply,
    the step's sum over the layers, and every product compared with its float32 one, so a wrong layout or float8
    type is reported instead of timed."""
    monkeypatch.syspath_prepend(str(_HERE.parent.parent / "benchmarks"))
    import bench_float8_gemm as gemm

    if gemm.DEVICE.type == "cpu":
        _skip_unless_cpu_scaled_mm_takes_rowwise_scales()
    tiny = ["--dim", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--layers", "2", "--vocab", "256"]
    step = gemm.main([*tiny, "--tokens", "32", "--iters", "1", "--repeats", "1"])
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| 64 x") or line.startswith("| 128 x")]
    # Shapes: q and o 64 x 64, k and v 64 x 32, w1 and w3 64 x 128, w2 128 x 64; each in three multiplies.
    assert len(rows) == 4 * 3 and "| 64 x 32 | 4 | input gradient |" in printed, printed
    assert "step (14 float8 layers, three multiplies each): bf16" in printed, printed
    assert "every product within 0.01 of its float32 one" in printed, printed
    assert set(step) == {"bf16", "tensorwise", "rowwise"} and all(ms > 0 for ms in step.values()), step
    # The comparison catches a product that is not the one meant: here, the second operand read the wrong way.
    call, reference = gemm.operands("tensorwise", "input gradient", 32, 64, 48)
    assert gemm.product_error(call, reference) < gemm.PRODUCT_RTOL
    assert gemm.product_error(call, reference.flip(0)) > gemm.PRODUCT_RTOL


def _skip_unless_cpu_scaled_mm_takes_rowwise_scales() -> None:
    """Skip, naming torch's call and error, where torch's CPU ``_scaled_mm`` takes per-tensor scales only (torch
    2.11: "Now _scaled_mm only supports per-tensor scaling for CPU backend"; 2.12 on take rowwise ones). Torch
    alone, so that no error of the benchmark's own can read as this; any other error fails the test after it."""
    e4m3 = torch.float8_e4m3fn
    a, b = torch.ones(16, 16).to(e4m3), torch.ones(16, 16).to(e4m3).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError as error:
        if "only supports per-tensor scaling for CPU" not in str(error):
            raise
        pytest.skip(f"torch {torch.__version__}: torch._scaled_mm on the CPU refused rowwise scales: {error}")


def test_a_crash_probes_record_names_the_rank_whose_call_failed_not_its_peers_echo() -> None:
    """On an H200, ``batch_isend_irecv`` failed on one rank (``writev``: a device pointer handed to a socket) and its
    peer saw only "Connection closed by peer": the record keeps the cause, a crash first, each distinct error once."""
    trace = 'Traceback (most recent call last):\n  File "torch_probe.py", line 9, in _crash_step\n    work.wait()\n'
    peer = "RuntimeError: [gloo/transport/tcp/pair.cc:547] Connection closed by peer [127.0.0.1]:23448"
    cause = "RuntimeError: [gloo/transport/tcp/pair.cc:339] writev [127.0.0.1]:42154: Bad address"
    report = f"2 of 2 ranks failed:\n--- rank 0 ---\n{trace}{peer}\n--- rank 1 ---\n{trace}{cause}\n"
    assert torch_probe._crash_message(report) == f"{cause} (rank 1)"
    same = f"2 of 2 ranks failed:\n--- rank 0 ---\n{trace}{cause}\n--- rank 1 ---\n{trace}{cause}\n"
    assert torch_probe._crash_message(same) == cause  # the same on every rank: once, as before
    crashed = f"2 of 2 ranks failed:\n--- rank 0 ---\n{trace}{peer}\n--- rank 1 ---\nprocess exited with code -11\n"
    assert torch_probe._crash_message(crashed) == "crashed: SIGSEGV (process exited with code -11)"
    timed_out = "1 of 2 ranks failed:\n--- rank -1 ---\ntimed out after 180s; ranks without a result: [1]\n"
    assert torch_probe._crash_message(timed_out) == "timed out after 180s; ranks without a result: [1]"


def test_the_float8_roofline_counts_the_multiplies_and_casts_of_the_converted_layers_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``_float8_roofline`` (issue 29): what float8 can gain from the shapes alone. Checked against the figures
    worked by hand for one 8192-cube layer, with and without full activation checkpointing; a 1024-wide layer loses (its casts cost more than its multiplies save,
    as torchao's table has it); the step keeps what is not converted; the output layer is not counted; and
    ``bench_mfu.py --roofline`` runs nothing and refuses a malformed argument."""
    monkeypatch.syspath_prepend(str(_HERE.parent.parent / "benchmarks"))
    import bench_mfu
    from _float8_roofline import SPECS, layer_shapes, roofline, specs_for

    from modelpar.models import LlamaConfig

    n, h100 = 8192, SPECS["H100"]
    bf16 = 3 * 2 * n**3 / (989.4e12 * 0.78)  # three multiplies, each bound by arithmetic at this size
    bandwidth = 3.35e12 * 0.92
    cube = roofline([(n, n)], n, "tensorwise", h100)
    # Bytes per element: the input and the output gradient 4 (one bf16 pass fused away, one left, two float8
    # copies), the weight 6 (two bf16 passes, two copies).
    assert cube.bf16_s == pytest.approx(bf16, rel=1e-9) and cube.float8_s == pytest.approx(bf16 / 2, rel=1e-4)
    assert cube.casts_s == pytest.approx(n * n * (4 + 6 + 4) / bandwidth, rel=1e-9), cube
    assert cube.linears_speedup == pytest.approx(1.750, abs=1e-3), cube
    assert cube.step_speedup(2 * bf16) == pytest.approx(2 * bf16 / (bf16 + cube.float8_s + cube.casts_s)), cube
    high = roofline([(n, n)], n, "rowwise_with_gw_hp", h100)  # the weight gradient's multiply stays in bf16
    assert high.float8_s == pytest.approx(bf16 / 3 + bf16 / 3, rel=1e-4), high
    assert high.casts_s == pytest.approx(n * n * (1 + 6 + 1) / bandwidth, rel=1e-9), high
    assert roofline([(1024, 1024)], 1024, "tensorwise", h100).linears_speedup < 1.0
    # Full activation checkpointing: the forward multiply once more, the input cast again (1 byte: its pass fused)
    # and the weight's (tensorwise: its maximum and its cast, 4 bytes, and a copy).
    again = roofline([(n, n)], n, "tensorwise", h100, recompute=True)
    assert again.bf16_s == pytest.approx(bf16 * 4 / 3, rel=1e-9), again
    assert again.casts_s == pytest.approx(n * n * (4 + 6 + 4 + 1 + 5) / bandwidth, rel=1e-9), again

    cfg = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=32)
    shapes, kept = layer_shapes(cfg, "rowwise")
    assert len(shapes) == 7 * 2 and all(256 not in shape for shape in shapes), shapes
    assert kept == [(64, 256)], kept  # the output layer, in high precision
    assert sorted(set(shapes)) == [(64, 32), (64, 64), (64, 128), (128, 64)], shapes
    assert specs_for("NVIDIA H100 80GB HBM3") is h100 and specs_for("NVIDIA GH200 480GB") is SPECS["GH200"]
    assert specs_for("NVIDIA A100-SXM4-80GB") is None

    bench_mfu.print_roofline(bench_mfu.parse(["--roofline", "A100", "--float8", "rowwise"]))
    assert (
        "float8-rowwise: roofline: no specs for 'A100' (known: H100, H800, H200, GH200, B200)"
        in capsys.readouterr().out
    )
    with pytest.raises(SystemExit):
        bench_mfu.parse(["--roofline", "H200:fast"])
    assert "give a GPU's name and, after a colon, bf16's tokens/s: H200:65303" in capsys.readouterr().err


def test_the_benchmark_runs_tensorwise_with_and_without_the_float8_all_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--float8 tensorwise,tensorwise-float8gather``: the same recipe, as modelpar's default sets it on one GPU
    (FSDP2 shards over one rank: weights gathered in bf16) and with FSDP2's float8 all-gather forced on, so one GPU
    run shows what its casts in FSDP2's eager hooks cost where nothing is gathered; ``-bf16gather`` forces it off."""
    monkeypatch.syspath_prepend(str(_HERE.parent.parent / "benchmarks"))
    import bench_mfu
    from _mfu_variants import BENCH_SHARD_SIZE, RUNNERS, plan

    args = bench_mfu.parse(["--float8", "tensorwise,tensorwise-float8gather,tensorwise-bf16gather", "--no-compile"])
    assert args.variants == (
        "modelpar,float8-tensorwise,float8-tensorwise-float8gather,float8-tensorwise-bf16gather"
    ), args.variants
    assert {"float8-tensorwise", "float8-tensorwise-float8gather", "float8-tensorwise-bf16gather"} <= set(RUNNERS)
    default, on, off = (
        plan(args, s).float8 for s in ("tensorwise", "tensorwise-float8gather", "tensorwise-bf16gather")
    )
    assert default.recipe == on.recipe == off.recipe == "tensorwise", (default, on, off)
    gathers = [spec.gathers_in_float8_over(BENCH_SHARD_SIZE) for spec in (default, on, off)]
    assert gathers == [False, True, False], (default, on, off)
    with pytest.raises(SystemExit):
        bench_mfu.parse(["--float8", "rowwise-bf16gather"])


def test_float8_by_hand_runs_against_torch_in_bf16_and_is_set_beside_modelpars(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``--by-hand``: each float8 setting also applied with torchao's API alone (``torch-float8-<setting>``),
    measured against torch in bf16, each baseline run whether named or not; the summary sets modelpar's float8
    against the same by hand, which tells a shortfall of float8 on this GPU from one of modelpar's."""
    monkeypatch.syspath_prepend(str(_HERE.parent.parent / "benchmarks"))
    import bench_mfu
    from _mfu_variants import RUNNERS, RunResult, bf16_baseline, float8_setting

    args = bench_mfu.parse(["--float8", "tensorwise,rowwise", "--by-hand", "--warmup", "1", "--steps", "3"])
    assert args.variants == (
        "modelpar,torch,float8-tensorwise,float8-rowwise,torch-float8-tensorwise,torch-float8-rowwise"
    ), args.variants
    assert args.baselines_added == ["modelpar", "torch"] and set(args.variants.split(",")) <= set(RUNNERS), args
    named = bench_mfu.parse(["--variants", "torch,lightning", "--float8", "rowwise", "--by-hand"])
    assert named.variants == "modelpar,torch,lightning,float8-rowwise,torch-float8-rowwise", named.variants
    assert named.baselines_added == ["modelpar"], named.baselines_added
    assert (float8_setting("torch-float8-tensorwise-bf16gather"), bf16_baseline("torch-float8-rowwise")) == (
        "tensorwise-bf16gather",
        "torch",
    )
    assert (float8_setting("torch"), bf16_baseline("float8-rowwise")) == (None, "modelpar")
    with pytest.raises(SystemExit):
        bench_mfu.parse(["--by-hand"])
    assert "--by-hand runs --float8's settings by hand: give them" in capsys.readouterr().err

    def run(variant: str, tps: float, ms: dict[str, float] | None = None) -> RunResult:
        float8 = float8_setting(variant)
        result = RunResult(
            variant, 4, 2048, "NVIDIA H200", "2.11.0+cu130", 989.4, tps, peak_gib=20.0, losses=[9.0, 8.0, 7.0, 6.0],
            float8=float8, torchao_version="0.18.0" if float8 else None,
        )  # fmt: skip
        result.profile_ms = {"step": 8192 / tps * 1e3, "busy": sum(ms.values()), **ms} if ms else None
        return result

    bf16 = {"attention": 9.0, "matmul": 80.0, "Triton (compiled)": 20.0}
    float8 = {"attention": 9.0, "matmul": 6.0, "float8 matmul": 50.0, "Triton (compiled)": 32.0}
    runs = {
        "modelpar": [run("modelpar", 60000.0, bf16)],
        "torch": [run("torch", 64000.0, {**bf16, "Triton (compiled)": 18.0})],
        "float8-tensorwise": [run("float8-tensorwise", 56000.0, float8)],
        "torch-float8-tensorwise": [run("torch-float8-tensorwise", 80000.0, {**float8, "Triton (compiled)": 25.0})],
    }
    args = bench_mfu.parse(["--float8", "tensorwise", "--by-hand", "--warmup", "1", "--steps", "3", "--profile", "2"])
    bench_mfu.report_float8(args, runs)
    printed = capsys.readouterr().out
    lines = "\n".join(line.strip() for line in printed.splitlines())
    # Each float8 variant against its own bf16: 56000 / 60000 and 80000 / 64000; its roofline with that bf16's step.
    assert "float8-tensorwise: 56000 tokens/s (56000-56000), peak 20.0 GiB; 0.933x bf16's tokens/s" in lines, lines
    assert "[summary]   torch bf16: 64000 tokens/s (64000-64000), peak 20.0 GiB; loss 8.000 -> 6.000" in lines
    assert "torch-float8-tensorwise: 80000 tokens/s (80000-80000), peak 20.0 GiB; 1.250x bf16's tokens/s" in lines
    assert "1.250x bf16's tokens/s (goal at least 1.2x: met)" in lines and "of its 137 ms)" in lines, lines
    assert "of its 128 ms)" in lines, lines  # torch's bf16 step: 8192 tokens at 64000 tokens/s
    assert lines.index("torch bf16:") > lines.index("float8-tensorwise:"), lines  # each baseline, then its float8
    assert "[summary]   modelpar's float8 / the same by hand (tokens/s): tensorwise 0.700x" in lines, lines
    (tmp_path / "bench_float8.txt").write_text(printed)
    shown = gpu_summary.bench_lines(tmp_path / "bench_float8.txt")
    assert len(shown) == 10 and all(len(line) <= gpu_summary.WIDTH for line in shown), shown
    bench_mfu.report_float8(args, dict(reversed(runs.items())))  # variants named torch's first: modelpar's lead
    reordered = capsys.readouterr().out
    assert reordered.index("modelpar bf16:") < reordered.index("torch bf16:"), reordered
    # A baseline that failed (left out by compare): its float8 variant is still shown, without a ratio.
    bench_mfu.report_float8(args, {v: rs for v, rs in runs.items() if v != "torch"})
    assert (
        "torch-float8-tensorwise: 80000 tokens/s (80000-80000), peak 20.0 GiB; no ratio: torch in bf16 did not"
        in capsys.readouterr().out
    )
    # The profile against the roofline: each bf16 variant, then its float8 ones, each over its own bf16's rest.
    bench_mfu.report_profile_roofline(args, runs)
    table = [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert table[1:] == ["| modelpar", "| float8-tensorwise", "| torch", "| torch-float8-tensorwise"], table
    bench_mfu.report_profile_roofline(args, runs)
    printed = capsys.readouterr().out
    assert "| torch-float8-tensorwise | 102.40 | 90.00 | 56.00 | 36.23 | 1.55x | 9.00 | 25.00 | +7.00 |" in printed


def test_the_float8_by_hand_conversion_is_torchaos_own_as_the_setting_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """``float8_by_hand``: every linear layer but the output layer, torchao's wrapped weights and the scales to
    precompute after each step only where the setting all-gathers in float8 (as modelpar's rule decides it for one
    rank: tensorwise forced on)."""
    pytest.importorskip("torchao.float8", reason="torchao.float8 does not import: the by-hand variants need it")
    monkeypatch.syspath_prepend(str(_HERE.parent.parent / "benchmarks"))
    from _mfu_variants import float8_by_hand

    from modelpar.models import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=32)
    settings = (("tensorwise", False), ("tensorwise-float8gather", True), ("tensorwise-bf16gather", False))
    for setting, gathers in (*settings, ("rowwise", False)):
        with torch.device("meta"):
            model = Llama(cfg)
        precompute = float8_by_hand(model, setting)
        converted = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
        wrapped = [n for n, p in model.named_parameters() if type(p).__name__ == "WeightWithDynamicFloat8CastTensor"]
        assert len(converted) == 14 and "output" not in converted, (setting, converted)
        assert (precompute is not None, len(wrapped)) == ((True, 14) if gathers else (False, 0)), (setting, wrapped)
        assert getattr(precompute, "__name__", None) in (None, "precompute_float8_dynamic_scale_for_fsdp"), precompute


def test_a_variant_that_fails_is_left_out_and_the_others_are_still_compared(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GPU lent for minutes is not lost to one variant: the one that fails (or runs out of memory) is left out of
    the later rounds and the table, the others are reported, and the benchmark exits 1 naming it."""
    monkeypatch.syspath_prepend(str(_HERE.parent.parent / "benchmarks"))
    import bench_mfu
    from _mfu_variants import RunResult

    spawned: list[str] = []

    def spawn(args: argparse.Namespace, variant: str, batch: int, seq: int) -> RunResult | None:
        spawned.append(variant)
        if variant == "lightning":
            return None
        oom = "CUDA out of memory" if variant == "torch" else None
        return RunResult(variant, batch, seq, "CPU (smoke check)", "2.13.0", 1.0, 1000.0, step_s=[0.1], oom=oom)

    monkeypatch.setattr(bench_mfu, "spawn", spawn)
    model = ["--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--vocab", "256"]
    args = bench_mfu.parse(["--repeats", "2", "--no-compile", *model])
    assert bench_mfu.compare(args) == 1
    printed = capsys.readouterr().out
    assert spawned == ["modelpar", "lightning", "torch", "modelpar"], spawned  # no second try of a failed one
    assert "lightning failed at 4 x 2048: left out of the comparison" in printed, printed
    assert "torch ran out of memory (try a smaller --batch) at 4 x 2048: left out" in printed, printed
    assert "| modelpar | 1000 |" in printed and "| lightning |" not in printed, printed
    assert printed.rstrip().splitlines()[-1] == (
        "not compared: lightning failed (its output above); torch ran out of memory (try a smaller --batch) (its"
        " output above)"
    ), printed


def test_a_spawns_time_takes_each_case_on_its_slowest_rank_and_the_start_up_of_its_latest() -> None:
    """What ``spawn_cases`` prints for the summary: the case a spawn waits for is its slowest rank's."""
    import gpu_common

    ranks = [
        {gpu_common.TIMES: {"started": 106.0, "cases": {"training": 2.0, "compile_tp": 9.04}}, "training": {}},
        {gpu_common.TIMES: {"started": 107.5, "cases": {"training": 3.0, "compile_tp": 8.0}}, "training": {}},
    ]
    times = gpu_common.spawn_times(ranks, started=100.0, ended=121.0)
    assert times == {"spawn": 21.0, "start-up": 7.5, "cases": {"training": 3.0, "compile_tp": 9.0}}, times
    # run_cases keeps its timing beside the results, so check() and the tests read the cases as before.
    results = run_cases({"case": lambda: {"figure": 1}})
    assert set(results) == {"case", gpu_common.TIMES} and results["case"] == {"ok": True, "figure": 1}, results
    assert set(results[gpu_common.TIMES]["cases"]) == {"case"}, results


def test_ports_reserved_together_for_spawns_at_once_are_distinct() -> None:
    from harness import free_ports

    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(p > 0 for p in ports), ports


def test_calls_side_by_side_get_distinct_ports_and_each_its_own_result_or_error() -> None:
    import threading

    from harness import side_by_side

    started = threading.Barrier(3, timeout=10)  # passes only if all three run at once

    def call(kind: str, port: int) -> tuple[str, int]:
        started.wait()
        if kind == "raises":
            raise RuntimeError(f"boom on {port}")
        return kind, port

    done = side_by_side([partial(call, "a"), partial(call, "raises"), partial(call, "b")])
    assert [d[0] for d in (done[0], done[2])] == ["a", "b"] and done[0][1] != done[2][1], done  # type: ignore[index]
    assert isinstance(done[1], RuntimeError) and str(done[1]).startswith("boom on "), done


def test_the_summary_says_where_the_time_went(tmp_path: Path) -> None:
    """Each spawn's start-up and slowest cases, the crash probes, a benchmark run's phases, and what ran outside
    pytest and the benchmark; the benchmark's own timing lines leave its table's part to the table."""
    figures = (
        "[gpu-suite] time one process: {'spawn': 23.7, 'start-up': 9.2, 'cases': {'mesh_access': 0.0,"
        " 'async_save': 5.3, 'hf': 0.8, 'float8_tensorwise': 2.2}}\n"
        "[gpu-suite] time crash probes: {'seconds': 8.1, 'spawns at once': 4, 'each': {'functional_all_gather on 2':"
        " 6.0, 'batch_isend_irecv on 4': 8.1}}\n"
        "[gpu-suite] time 2 ranks: {'spawn': 58.1, 'start-up': 7.1, 'cases': {'compile_tp': 30.8}}\n"
    )
    bench = (
        "== benchmarks/bench_mfu.py ==\nmodelpar: 65900 tokens/s\n  (modelpar: run 37.0 s: start-up 6.0 s, exit 3.0 s)\n"
        "| variant | tokens/s |\n[time] 3 runs in 103 s; median run 37.0 s: start-up 6.0 s, set-up 3.0 s\n"
    )
    _summary(tmp_path, bench=False)  # writes junit.xml, environment.txt and pytest.log
    (tmp_path / "figures.txt").write_text(figures)
    (tmp_path / "bench_mfu.txt").write_text(bench)
    args = argparse.Namespace(
        exit=0, pytest_exit=0, pytest_seconds=85.0, bench_exit=0, bench_seconds=111.0, wall_seconds=205.0,
        float8_in_bench=None, float8_not_run=None,
    )  # fmt: skip
    text = "\n".join(gpu_summary.render(tmp_path, args))
    timing = text.split("where the time went:\n")[1].split("\nwall time:")[0].splitlines()
    assert timing == [
        "  one process: spawn 23.7 s, start-up 9.2 s; slowest: async_save 5.3 s, float8_tensorwise 2.2 s, hf 0.8 s",
        "  crash probes: 4 spawns at once, 8.1 s (last: batch_isend_irecv on 4, 8.1 s)",
        "  2 ranks: spawn 58.1 s, start-up 7.1 s; slowest: compile_tp 30.8 s",
        "  benchmark: 3 runs in 103 s; median run 37.0 s: start-up 6.0 s, set-up 3.0 s; outside its runs 8 s (its own"
        " process, checks)",
        "  outside pytest and the benchmark: 9 s (the CUDA and package checks, this summary)",
    ], text
    benchmark = text.split("benchmark (")[1].split("float8 comparison")[0]
    assert "  modelpar: 65900 tokens/s\n  | variant | tokens/s |" in benchmark, text
    assert "[time]" not in benchmark and "run 37.0 s" not in benchmark, text


def test_the_benchmark_says_where_each_runs_time_went(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run's phases add up to its wall time; the ``[time]`` line gives each phase's median over the runs."""
    monkeypatch.syspath_prepend(str(_HERE.parent.parent / "benchmarks"))
    import bench_mfu
    from _mfu_variants import RunResult

    def run(wall: float, warmup: float) -> RunResult:
        result = RunResult("modelpar", 4, 2048, "NVIDIA H200", "2.11.0+cu130", 989.4, 60000.0)
        result.setup_s, result.warmup_s, result.step_s = 1.5, warmup, [0.125] * 20
        result.wall_s, result.startup_s, result.exit_s, result.compiler_s = wall, 6.0, 3.0, 1.5
        return result

    phases = bench_mfu.phases(run(37.0, 12.0))
    assert list(phases) == ["start-up", "compile imports", "set-up", "warm-up", "timed steps", "exit", "the rest"]
    assert phases["timed steps"] == 2.5 and phases["the rest"] == pytest.approx(10.5), phases
    assert sum(phases.values()) == pytest.approx(37.0), phases
    bench_mfu.report_time([run(37.0, 12.0), run(30.0, 4.0), run(39.0, 14.0)], 106.4)
    assert capsys.readouterr().out == (
        "[time] 3 runs in 106 s; median run 37.0 s: start-up 6.0 s, compile imports 1.5 s, set-up 1.5 s, warm-up"
        " 12.0 s, timed steps 2.5 s, exit 3.0 s, the rest 10.5 s\n"
    )


def test_the_benchmark_times_the_set_up_alone_and_profiles_it_on_request(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--setup-only`` (many set-ups in the minutes a lent GPU gives) reports each variant's set-up with its spread,
    the imports and the start-up, and the ratios; ``--profile-setup N`` prints the set-up's N longest functions and
    marks its seconds as no measurement; options that need the training steps are refused by name."""
    monkeypatch.syspath_prepend(str(_HERE.parent.parent / "benchmarks"))
    import bench_mfu
    from _mfu_variants import RunResult, setup_timer

    model = ["--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--vocab", "256"]
    args = bench_mfu.parse(["--setup-only", "--variants", "modelpar,lightning", *model])

    def run(variant: str, setup: float) -> RunResult:
        result = RunResult(variant, 4, 2048, "NVIDIA H200", "2.11.0+cu130", 989.4)
        result.setup_s, result.compiler_s, result.startup_s, result.peak_gib = setup, 1.5, 6.5, 4.1
        return result

    runs = {"modelpar": [run("modelpar", 0.6), run("modelpar", 0.5)], "lightning": [run("lightning", 0.5)] * 2}
    bench_mfu.report_setup(args, runs, 27.4)
    printed = capsys.readouterr().out.splitlines()
    assert "| modelpar | 0.55 | 0.50-0.60 | 1.50 | 6.5 | 4.1 |" in printed, printed
    assert "| lightning | 0.50 | 0.50-0.50 | 1.50 | 6.5 | 4.1 |" in printed, printed
    assert any(line.startswith("set-up (meta model") and "modelpar / Lightning: 1.10x" in line for line in printed)
    assert printed[-1] == "4 runs in 27 s.", printed
    profiled = bench_mfu.parse(["--setup-only", "--profile-setup", "5", *model])
    bench_mfu.report_setup(profiled, runs, 27.4)
    assert bench_mfu.PROFILED_SETUP.strip() in capsys.readouterr().out

    with setup_timer(profiled) as seconds:  # the profile of a block, printed after it
        torch.nn.Linear(64, 64).reset_parameters()
    lines = capsys.readouterr().out.splitlines()
    assert len(seconds) == 1 and seconds[0] > 0, seconds
    assert lines[0].startswith("set-up profile (cProfile; the 5 longest") and len(lines) == 6, lines
    assert any("torch/nn/modules/linear.py" in line and "(reset_parameters)" in line for line in lines), lines

    for wrong, why in (
        (["--setup-only", "--float8", "tensorwise"], "--setup-only times the set-up alone"),
        (["--setup-only", "--profile", "2"], "--setup-only times the set-up alone"),
        (["--profile-setup", "-1"], "--profile-setup -1: give how many functions to print"),
    ):
        with pytest.raises(SystemExit):
            bench_mfu.parse([*wrong, *model])
        assert why in capsys.readouterr().err, wrong


def test_the_benchmarks_set_up_ratio_leaves_torch_compiles_imports_out_and_shows_each_variants_spread(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The set-up is timed after ``torch.compile``'s first call (every variant makes it, and its imports run as
    fast as the file cache allows: 4.30 s against 2.58-2.76 s on 2026-11-28); the ratio says so, with each
    variant's spread over its runs and the imports' own seconds, and a worker really makes that call first."""
    monkeypatch.syspath_prepend(str(_HERE.parent.parent / "benchmarks"))
    import bench_mfu
    from _mfu_variants import RunResult

    def run(variant: str, setup: float, imports: float | None) -> RunResult:
        result = RunResult(variant, 4, 2048, "NVIDIA H200", "2.11.0+cu130", 989.4, 60000.0, step_s=[0.1])
        result.setup_s, result.compiler_s = setup, imports
        return result

    runs = {
        "modelpar": [run("modelpar", 1.2, 1.5), run("modelpar", 1.4, 2.9), run("modelpar", 1.3, 1.4)],
        "lightning": [run("lightning", 1.0, 1.6), run("lightning", 1.1, 1.5), run("lightning", 1.3, 1.5)],
        "torch": [run("torch", 1.3, 1.5), run("torch", 1.2, 1.5), run("torch", 1.3, 1.5)],
    }
    setups = {"modelpar": 1.3, "lightning": 1.1, "torch": 1.3}
    assert bench_mfu.setup_line(runs, setups).splitlines() == [
        "set-up (meta model to sharded and materialized, synchronized): modelpar / Lightning: 1.18x (goal on a GPU:"
        " at most 1.2x); modelpar / torch by hand: 1.00x",
        "  set-up median (min-max): modelpar 1.30 s (1.20-1.40), lightning 1.10 s (1.00-1.30), torch 1.30 s"
        " (1.20-1.30); torch.compile's imports, made before the timer in every run: 1.50 s (1.40-2.90)",
    ]
    without = {v: [run(v, 1.0, None)] for v in ("modelpar", "lightning")}  # --no-compile: no imports to report
    assert bench_mfu.setup_line(without, {"modelpar": 1.0, "lightning": 1.0}).splitlines()[1] == (
        "  set-up median (min-max): modelpar 1.00 s (1.00-1.00), lightning 1.00 s (1.00-1.00)"
    )
    probe = (  # in a fresh process: after the worker's first call, a set-up's torch.compile imports nothing
        "import sys, torch; from _mfu_variants import load_compiler; load_compiler(); before = set(sys.modules);"
        " torch.nn.Linear(2, 2).compile(); print(sorted(set(sys.modules) - before))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_HERE.parent.parent / "benchmarks"), *sys.path])}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
