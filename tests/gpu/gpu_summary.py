"""The one-screen summary that ``scripts/gpu-check.sh`` ends with, and writes to ``$OUT/summary.txt``.

    python tests/gpu/gpu_summary.py OUT --exit N --pytest-exit N --pytest-seconds S [--bench-exit N
        --bench-seconds S] [--float8-in-bench RECIPES | --float8-not-run REASON] --wall-seconds S
    python tests/gpu/gpu_summary.py --merge-junit TARGET [PATH RAN STATUS]...   (the pytest sides' junit XML)

A GPU run is rare (a task may be lent a machine for minutes), so its result has to be readable at a glance
and pasted whole into an issue: per test file the passed/failed/skipped counts, each failure's test with its
own error line, each skip's reason, what the probe found torch alone could run, the benchmark's table, the
float8 comparison's ``[summary]`` lines (its runs are the benchmark's; or why it did not run: torchao missing is
no failure, but must not pass unseen), the environment, where the time went (each spawn's start-up and slowest
cases, a benchmark run's phases: the whole check must stay under 5 minutes) and the wall time. Read from the files
the script wrote (``junit.xml``, ``figures.txt``, ``bench_mfu.txt``, ``bench_float8.txt``, ``environment.txt``,
``pytest.log``); a missing or broken one is said so, never a reason to print nothing.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

#: Widest line printed; longer ones end in "...", but the last, which says where the results are. Tracebacks and
#: full figures stay in the files beside.
WIDTH = 200
#: At most this many failure lines and skip lines (the rest are counted, and are in pytest.log).
MOST = 12
#: Lines of the benchmark's output shown when it prints no ``[summary]`` lines (its table with the set-up lines under it).
BENCH_TAIL = 16


@dataclass
class FileCounts:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0


@dataclass
class Outcomes:
    """What junit.xml says: counts and seconds per test file (a spawn's time counts in its first test's),
    failures as (test, error line), skips as (test, reason)."""

    files: dict[str, FileCounts] = field(default_factory=dict)
    failures: list[tuple[str, str]] = field(default_factory=list)
    skips: list[tuple[str, str]] = field(default_factory=list)


def read_junit(path: Path) -> Outcomes:
    """Parse pytest's junit XML; raises ``OSError`` or ``ET.ParseError`` for the caller to report."""
    outcomes = Outcomes()
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "?")
        # pytest names a module ("tests.gpu.test_x"); a case merge_junit made for a side without results, a path
        file = module if "/" in module or module == "?" else module.replace(".", "/") + ".py"
        counts = outcomes.files.setdefault(file, FileCounts())
        seconds = float(case.get("time") or 0.0)
        counts.seconds += seconds
        test = f"{Path(file).name}::{case.get('name', '?')}"
        problems = [e for e in case if e.tag in ("failure", "error")]
        skipped = case.find("skipped")
        if problems:
            counts.failed += 1
            outcomes.failures.append((test, error_line(problems[0].get("message") or "", problems[0].text or "")))
        elif skipped is not None:
            counts.skipped += 1
            outcomes.skips.append((test, skip_reason(skipped.get("message") or "")))
        else:
            counts.passed += 1
    return outcomes


def merge_junit(target: Path, sides: list[tuple[Path, str, int]]) -> None:
    """Write ``target`` from each side's junit XML: ``(path, what it ran, its pytest's exit status)``.

    ``gpu-check.sh`` runs the one-process file in a pytest of its own beside the other files. A side without a
    readable file (its pytest crashed, or was killed) becomes one failed test named after what it ran, with its
    exit status: the summary then says so instead of showing fewer files.
    """
    root = ET.Element("testsuites")
    for path, ran, status in sides:
        try:
            found = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as error:
            suite = ET.SubElement(root, "testsuite", name=ran, tests="1", errors="1")
            case = ET.SubElement(suite, "testcase", classname=ran, name="(its pytest)", time="0")
            message = (
                f"pytest of {ran} wrote no readable junit XML (exit {status}; {type(error).__name__}): read pytest.log"
            )
            ET.SubElement(case, "error", message=message)
            continue
        root.extend([found] if found.tag == "testsuite" else list(found.iter("testsuite")))
    ET.ElementTree(root).write(target, encoding="utf-8", xml_declaration=True)


def error_line(message: str, text: str) -> str:
    """A failure's first message line; where that names no cause ("2 of 2 ranks failed:"), the traceback's.

    The suite's ``check`` already puts the case's own error on its first line; a spawn that failed as a whole
    (the harness's report) or an error in a fixture does not, so the cause is read from the traceback in the
    exception's text (pytest's ``E`` lines, else junit's ``message``, which pytest may cut short): the first
    line after the frames, indented less than they are, however pytest indents both.
    """
    first = next((line.strip() for line in message.splitlines() if line.strip()), "")
    if first and not first.endswith(":"):
        return first
    e_lines = [line[1:] for line in text.splitlines() if line.startswith("E")]
    for source in (e_lines, message.splitlines()):
        cause = _traceback_cause(source)
        if cause:
            return f"{first} {cause}".strip()
    return first or next((line.strip() for line in reversed(e_lines) if line.strip()), "(no message)")


def _traceback_cause(lines: list[str]) -> str:
    marker = "Traceback (most recent call last):"
    starts = [i for i, line in enumerate(lines) if marker in line]
    body = [line for line in lines[starts[0] + 1 :] if line.strip()] if starts else []
    if not body:
        return ""
    frames = _indent(body[0])
    return next((line.strip() for line in body if _indent(line) < frames), "")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def skip_reason(message: str) -> str:
    """pytest writes a skip's reason after "Skipped: " in junit; the reason is what matters."""
    return message.removeprefix("Skipped: ").strip() or "(no reason given)"


def grouped(pairs: list[tuple[str, str]]) -> list[tuple[list[str], str]]:
    """Tests that share one error line or reason, together, in first-seen order: one line per cause."""
    groups: dict[str, list[str]] = {}
    for test, text in pairs:
        groups.setdefault(text, []).append(test)
    return [(tests, text) for text, tests in groups.items()]


def probe_lines(figures: Path) -> list[str]:
    """The probe's outcomes (``[gpu-suite] gloo_cuda_collectives: {...}`` lines), one line per world size."""
    lines = []
    for raw in _read_lines(figures):
        if not raw.startswith("[gpu-suite] gloo_cuda_collectives: "):
            continue
        try:
            figures_ = ast.literal_eval(raw.split(": ", 1)[1])
        except (ValueError, SyntaxError):
            lines.append(f"  (unreadable: {raw})")
            continue
        meta = {k: figures_.pop(k, "?") for k in ("torch", "device", "ranks")}
        bad = {k: v for k, v in figures_.items() if v != "ok"}
        where = f"{meta['ranks']} ranks on {meta['device']}, torch {meta['torch']}"
        found = "; ".join(f"{k}: {v}" for k, v in bad.items()) if bad else "everything ran"
        lines.append(f"  {where}: {len(figures_) - len(bad)} of {len(figures_)} ok; {found}")
    return lines


def bench_lines(bench: Path, *, marked: bool = True) -> list[str]:
    """The benchmark's ``[summary]`` lines if it prints any (and ``marked``); else its last lines that are
    neither ``[summary]`` lines nor library chatter (the table and the ratios under it)."""
    lines = [line.rstrip() for line in _read_lines(bench) if line.strip() and not line.startswith("== ")]
    summary = [line for line in lines if line.startswith("[summary]")]
    if marked and summary:
        return [f"  {line}" for line in summary]
    rest = [
        line for line in lines if line not in summary and not any(p.search(line) for p in (_CHATTER, _TIMING, _CURVES))
    ]
    return [f"  {line}" for line in rest][-BENCH_TAIL:]


#: Lines torch, Lightning, torchao (its extensions for other GPUs) and warnings print into the benchmark's output:
#: not its results.
_CHATTER = re.compile(r"^\[rank\d|^Using |^You are using|^\s*warnings\.warn|Warning:|^W\d{4} |^Failed to load ")
#: The benchmark's timing lines (each run's, and the ``[time]`` line): the summary's time part shows them.
_TIMING = re.compile(r"^\[time\] |^  \([\w.-]+: run [\d.]+ s: ")
#: Its float8 loss curves (``[loss]`` lines), a loss per step: too long for a summary; bench_mfu.txt keeps them.
_CURVES = re.compile(r"^\[loss\] ")


def environment_line(environment: Path) -> list[str]:
    """environment.txt in one line (GPU | torch, CUDA, NCCL | packages | commit, date), plus any NOTE."""
    lines = [line.strip() for line in _read_lines(environment) if line.strip()]
    if not lines:
        return ["environment: (no environment.txt)"]
    headers = [line for line in lines if line.startswith("== environment")]
    notes = [line for line in lines if line.startswith("NOTE")]
    body = [line for line in lines if line not in headers and line not in notes]
    packages = [line for line in body if re.fullmatch(r"[\w.]+ \S+", line)]
    rest = [line for line in body if line not in packages]
    when = headers[0].removeprefix("== environment").strip(" =()") if headers else ""
    second = " | ".join(part for part in (", ".join(packages), when) if part)
    return ["environment: " + " | ".join(rest), *([f"  {second}"] if second else []), *notes]


def render(out: Path, args: argparse.Namespace) -> list[str]:
    lines = ["== gpu-check summary =="]
    lines += environment_line(out / "environment.txt")
    try:
        outcomes: Outcomes | None = read_junit(out / "junit.xml")
    except (OSError, ET.ParseError) as error:
        outcomes = None
        tail = [line for line in _read_lines(out / "pytest.log") if re.match(r"^=+ .* in [\d.]+s", line)]
        lines.append(f"tests: no readable junit.xml ({type(error).__name__}: {error}); pytest said:")
        lines += [f"  {line.strip()}" for line in tail[-1:]] or ["  (nothing: read pytest.log)"]
    if outcomes is not None:
        lines.append(f"tests (pytest exit {args.pytest_exit}, {args.pytest_seconds:.0f} s):")
        width = max((len(f) for f in outcomes.files), default=0)
        for file, c in sorted(outcomes.files.items()):
            lines.append(
                f"  {file:<{width}}  {c.passed} passed, {c.failed} failed, {c.skipped} skipped ({c.seconds:.0f} s)"
            )
        if not outcomes.files:
            lines.append("  no tests ran")
        for title, pairs in (("failed", outcomes.failures), ("skipped", outcomes.skips)):
            if not pairs:
                continue
            lines.append(f"{title} ({len(pairs)}):")
            groups = grouped(pairs)
            for tests, text in groups[:MOST]:
                names = ", ".join(tests[:3]) + (f" and {len(tests) - 3} more" if len(tests) > 3 else "")
                lines.append(f"  {names}: {text}")
            if len(groups) > MOST:
                lines.append(f"  ... and {len(groups) - MOST} more causes (pytest.log)")
    probe = probe_lines(out / "figures.txt")
    if probe:
        lines.append("probe (torch alone, gloo):")
        lines += probe
    if args.bench_exit is None:
        lines.append("benchmark: left out (GPU_CHECK_SKIP_MFU=1)")
    else:
        lines.append(f"benchmark (benchmarks/bench_mfu.py, exit {args.bench_exit}, {args.bench_seconds:.0f} s):")
        lines += bench_lines(out / "bench_mfu.txt", marked=False) or ["  (no output: read bench_mfu.txt)"]
    lines += float8_lines(out, args)
    lines += time_lines(out, args)
    bench = f", benchmark {args.bench_seconds:.0f} s" if args.bench_exit is not None else ""
    lines.append(f"wall time: {_duration(args.wall_seconds)} (pytest {args.pytest_seconds:.0f} s{bench})")
    written = _files(out, args.bench_exit is not None)
    fitted = [line if len(line) <= WIDTH else line[: WIDTH - 3] + "..." for line in lines]
    # Whole however long the folder's path: a path cut short leads nowhere.
    return [*fitted, f"gpu-check: exit {args.exit}; results in {out}/ ({', '.join(written)})"]


#: Cases named per spawn in the time lines, slowest first.
SLOWEST = 3


def time_lines(out: Path, args: argparse.Namespace) -> list[str]:
    """Where the wall time went: each spawn's ``[gpu-suite] time`` line (its start-up and its slowest cases), the
    crash probes', the benchmark's ``[time]`` line (a run's phases), and what ran outside pytest and the benchmark.

    The whole check has to stay under 5 minutes on a GPU (issue 25): these lines say what to cut next.
    """
    lines = []
    for raw in _read_lines(out / "figures.txt"):
        found = re.match(r"\[gpu-suite\] time (.+?): (\{.*\})$", raw)
        if not found:
            continue
        label = found[1]
        try:
            times = ast.literal_eval(found[2])
        except (ValueError, SyntaxError):
            lines.append(f"  {label}: (unreadable: {found[2]})")
            continue
        if "cases" in times:
            slowest = sorted(times["cases"].items(), key=lambda item: -item[1])[:SLOWEST]
            cases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in slowest)
            lines.append(
                f"  {label}: spawn {times['spawn']:.1f} s, start-up {times['start-up']:.1f} s; slowest: {cases}"
            )
        else:
            each = times.get("each", {})
            slowest_probe = max(each.items(), key=lambda item: item[1], default=None)
            last = f" (last: {slowest_probe[0]}, {slowest_probe[1]:.1f} s)" if slowest_probe else ""
            lines.append(
                f"  {label}: {times.get('spawns at once', '?')} spawns at once, {times['seconds']:.1f} s{last}"
            )
    if args.bench_exit is not None:
        timed = [line for line in _read_lines(out / "bench_mfu.txt") if line.startswith("[time] ")]
        if timed:
            line = timed[-1].removeprefix("[time] ")
            runs = re.match(r"\d+ runs in (\d+) s", line)
            own = (
                f"; outside its runs {args.bench_seconds - int(runs[1]):.0f} s (its own process, checks)"
                if runs
                else ""
            )
            lines.append(f"  benchmark: {line}{own}")
    rest = args.wall_seconds - args.pytest_seconds - (args.bench_seconds if args.bench_exit is not None else 0)
    lines.append(f"  outside pytest and the benchmark: {rest:.0f} s (the CUDA and package checks, this summary)")
    return ["where the time went:", *lines]


def float8_lines(out: Path, args: argparse.Namespace) -> list[str]:
    """The float8 comparison (``bench_mfu.py --float8``, run as part of the benchmark): its ``[summary]`` lines,
    or why it did not run."""
    if args.float8_in_bench and args.bench_exit is not None:
        summary = [line for line in bench_lines(out / "bench_mfu.txt") if line.startswith("  [summary]")]
        return [
            f"float8 comparison (--float8 {args.float8_in_bench}, in the benchmark's runs above):",
            *(summary or ["  (no [summary] lines: read bench_mfu.txt)"]),
        ]
    if args.float8_not_run:
        return [f"float8 comparison: not run: {args.float8_not_run}"]
    if args.bench_exit is None:
        return ["float8 comparison: left out with the benchmark (GPU_CHECK_SKIP_MFU=1)"]
    return ["float8 comparison: not run (gpu-check.sh gave no reason)"]


def _files(out: Path, bench_ran: bool) -> list[str]:
    """The result files this run wrote (an earlier run's ``bench_mfu.txt`` is not this run's; gpu-check.sh removes
    an earlier ``bench_float8.txt``, the float8 check's output)."""
    names = ["environment.txt", "pytest.log", "figures.txt", "junit.xml", *(["bench_mfu.txt"] if bench_ran else [])]
    names += ["bench_float8.txt"] if bench_ran else []
    return [name for name in names if (out / name).exists()] + ["summary.txt"]


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--merge-junit"]:  # TARGET, then PATH RAN STATUS for each side
        target, rest = Path(argv[1]), argv[2:]
        merge_junit(target, [(Path(a), b, int(c)) for a, b, c in zip(rest[::3], rest[1::3], rest[2::3], strict=True)])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the folder gpu-check.sh wrote its results to")
    p.add_argument("--exit", type=int, required=True, help="gpu-check.sh's exit status")
    p.add_argument("--pytest-exit", type=int, required=True)
    p.add_argument("--pytest-seconds", type=float, required=True)
    p.add_argument("--bench-exit", type=int, default=None, help="left out: the benchmark did not run")
    p.add_argument("--bench-seconds", type=float, default=0.0)
    p.add_argument("--float8-in-bench", default=None, help="the recipes the benchmark compared with bf16")
    p.add_argument("--float8-not-run", default=None, help="why the float8 comparison did not run")
    p.add_argument("--wall-seconds", type=float, required=True)
    args = p.parse_args(argv)
    text = "\n".join(render(args.out, args)) + "\n"
    sys.stdout.write(text)
    (args.out / "summary.txt").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
