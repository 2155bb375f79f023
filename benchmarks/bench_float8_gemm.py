"""Float8 multiplies alone, against bf16's, at the shapes of the model ``bench_mfu.py`` trains: torch only.

    python benchmarks/bench_float8_gemm.py [--dim 4096 --layers 4 --heads 32 --kv-heads 8 --ffn 14336 --tokens 8192]

On an H200 (2026-11-27) float8 training ran at 0.846x-0.991x bf16's tokens/s where the roofline
(``_float8_roofline.py``) allows about 1.25-1.31x. Either the float8 multiplies run far from float8's rate on that
stack, or the casts and the code around them eat the gain. This benchmark answers the first half with no modelpar
and no torchao: ``torch._scaled_mm`` against ``torch.mm`` for each linear layer modelpar converts, in each of the
three multiplies a layer does in a training step, with the operands' layouts, float8 types and accumulation torchao
0.18 uses (``torchao.float8.config``):

* **forward** ``output = input @ weight.t()`` (``M x K`` by ``K x N``): e4m3 by e4m3, fast accumulation;
* **input gradient** ``grad_input = grad_output @ weight`` (``M x N`` by ``N x K``): tensorwise e5m2 by e4m3,
  rowwise e4m3 by e4m3; precise accumulation;
* **weight gradient** ``grad_weight = grad_output.t() @ input`` (``N x M`` by ``M x K``): as the input gradient.

``_scaled_mm`` takes its first operand row-major and its second column-major, so each operand is laid out as
torchao's casts leave it. Tensorwise scales are one float per operand, rowwise ones a float per row of the first
operand and per column of the second. Operands are random (never zeros, which run faster than real data on an H200);
each multiply's result is first compared with its float32 product (a wrong one is reported), then timed with CUDA
events, ``--iters`` calls in a row, the median of ``--repeats`` such timings, after a warm-up. Reported per shape
and multiply: milliseconds, TFLOP/s and float8's speed-up over bf16; then the whole step's multiplies (each shape
times the layers that have it) against the roofline's. Without a GPU it runs on the CPU as a smoke check of its own
code; those figures mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from collections.abc import Callable

import torch
from _float8_roofline import GEMM_EFFICIENCY, layer_shapes, roofline, specs_for
from _mfu_variants import add_model_arguments, config

#: Where it runs: the GPU when there is one, else the CPU (the smoke check).
DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
#: The kinds of multiply timed, in the order printed: bf16 and torchao's two recipes with float8 multiplies.
KINDS = ("bf16", "tensorwise", "rowwise")
#: A layer's three multiplies in a training step, by name: (rows, inner, columns) of the product from the layer's
#: (tokens, in_features, out_features), and whether torchao accumulates it fast (the forward only).
ROLES: dict[str, tuple[Callable[[int, int, int], tuple[int, int, int]], bool]] = {
    "forward": (lambda m, k, n: (m, k, n), True),
    "input gradient": (lambda m, k, n: (m, n, k), False),
    "weight gradient": (lambda m, k, n: (n, m, k), False),
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_model_arguments(p)  # bench_mfu.py's model flags
    p.add_argument("--tokens", type=int, default=8192, help="tokens a step (bench_mfu.py's batch x seq: 4 x 2048)")
    p.add_argument("--iters", type=int, default=20, help="calls timed together")
    p.add_argument("--repeats", type=int, default=5, help="timings of --iters calls; their median is reported")
    return p.parse_args(argv)


def converted_layers(args: argparse.Namespace) -> Counter[tuple[int, int]]:
    """How many of the model's float8 layers have each ``(in_features, out_features)``: modelpar's own choice, the
    output layer left out (``_float8_roofline.layer_shapes``)."""
    return Counter(layer_shapes(config(args, seq=args.tokens), "tensorwise")[0])


def operands(kind: str, role: str, rows: int, inner: int, cols: int) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    """One multiply of ``kind`` in ``role``, ready to call: ``rows x inner`` (row-major) by ``inner x cols``
    (column-major), random values, as torchao lays them out and scales them; and its product in float32 from the
    same (rounded) operands, to check that the call computes it."""
    gen = torch.Generator(device=DEVICE).manual_seed(rows * 31 + inner * 7 + cols)

    def draw(r: int, c: int) -> torch.Tensor:
        return torch.randn(r, c, device=DEVICE, generator=gen, dtype=torch.float32)

    a, b_t = draw(rows, inner), draw(cols, inner)  # the second operand is built as its transpose: column-major
    if kind == "bf16":
        a16, b16 = a.to(torch.bfloat16), b_t.to(torch.bfloat16).t()
        return (lambda: torch.mm(a16, b16)), a16.float() @ b16.float()
    first = E5M2 if kind == "tensorwise" and role != "forward" else E4M3  # tensorwise's gradients are e5m2
    a8, b8 = a.to(first), b_t.to(E4M3).t()
    if kind == "tensorwise":
        scale_a = scale_b = torch.tensor(1.0, device=DEVICE)
    else:
        scale_a = torch.ones(rows, 1, device=DEVICE)
        scale_b = torch.ones(1, cols, device=DEVICE)
    fast = ROLES[role][1]

    def call() -> torch.Tensor:
        return torch._scaled_mm(a8, b8, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16, use_fast_accum=fast)

    return call, a8.float() @ b8.float()  # unit scales: the product of the float8 values themselves


#: A product further than this from its float32 one (relative, in norm) is not the one meant: a wrong layout or
#: scale. The bf16 result's rounding (and fast accumulation's) stays well under it.
PRODUCT_RTOL = 1e-2


def product_error(call: Callable[[], torch.Tensor], reference: torch.Tensor) -> float:
    """How far the call's result is from its float32 product: ``|got - reference| / |reference|`` in norm."""
    got = call().float()
    return ((got - reference).norm() / reference.norm()).item()


def time_ms(call: Callable[[], torch.Tensor], iters: int, repeats: int) -> float:
    """Milliseconds a call takes: the median over ``repeats`` timings of ``iters`` calls in a row, after a warm-up."""
    for _ in range(3):
        call()
    timings = []
    for _ in range(repeats):
        if DEVICE.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                call()
            end.record()
            end.synchronize()
            timings.append(start.elapsed_time(end) / iters)
        else:
            began = time.perf_counter()
            for _ in range(iters):
                call()
            timings.append((time.perf_counter() - began) * 1e3 / iters)
    return statistics.median(timings)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Time every shape and multiply; print the tables; return the step's multiplies in ms by kind (for tests)."""
    args = parse(argv)
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "CPU (smoke check)"
    specs = specs_for(name)
    layers = converted_layers(args)
    m = args.tokens
    print(
        f"float8 multiplies on {name}, torch {torch.__version__}: {args.tokens} tokens, ms per multiply (median of"
        f" {args.repeats} x {args.iters} calls), TFLOP/s, float8's speed-up over bf16"
    )
    columns = ("bf16 ms", "tensorwise ms", "rowwise ms", "TFLOP/s bf16 / tw / rw", "speed-up tw / rw")
    print("| layer (in x out) | layers | multiply | " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|---|---|")
    step = dict.fromkeys(KINDS, 0.0)
    wrong: list[str] = []  # products not the ones meant: their timings mean nothing
    for (k, n), count in layers.items():
        for role, (dims, _) in ROLES.items():
            rows, inner, cols = dims(m, k, n)
            ms, errors = {}, {}
            for kind in KINDS:
                call, reference = operands(kind, role, rows, inner, cols)
                errors[kind] = product_error(call, reference)
                del reference
                ms[kind] = time_ms(call, args.iters, args.repeats)
            wrong += [f"{kind} {role} {k} x {n}: {e:.1e}" for kind, e in errors.items() if not e < PRODUCT_RTOL]
            for kind in KINDS:
                step[kind] += ms[kind] * count
            tflops = " / ".join(f"{2 * rows * inner * cols / (ms[kind] * 1e9):.0f}" for kind in KINDS)
            print(
                f"| {k} x {n} | {count} | {role} | {ms['bf16']:.3f} | {ms['tensorwise']:.3f} | {ms['rowwise']:.3f}"
                f" | {tflops} | {ms['bf16'] / ms['tensorwise']:.2f}x / {ms['bf16'] / ms['rowwise']:.2f}x |"
            )
    print(
        f"step ({sum(layers.values())} float8 layers, three multiplies each): bf16 {step['bf16']:.2f} ms, tensorwise"
        f" {step['tensorwise']:.2f} ms ({step['bf16'] / step['tensorwise']:.2f}x), rowwise {step['rowwise']:.2f} ms"
        f" ({step['bf16'] / step['rowwise']:.2f}x)"
    )
    if specs is not None:  # every multiply in float8 under both recipes
        line = roofline(list(layers.elements()), m, "tensorwise", specs)
        roof = {"bf16": line.bf16_s * 1e3, "float8": line.float8_s * 1e3}
        print(
            f"roofline ({GEMM_EFFICIENCY:.0%} of the data sheet's dense peak): bf16 {roof['bf16']:.2f} ms, float8"
            f" {roof['float8']:.2f} ms; measured / roofline: bf16 {step['bf16'] / roof['bf16']:.2f}x, tensorwise"
            f" {step['tensorwise'] / roof['float8']:.2f}x, rowwise {step['rowwise'] / roof['float8']:.2f}x"
        )
    else:
        print(f"(no roofline: no specs for {name!r})")
    if wrong:
        print(f"WRONG PRODUCTS (relative error over {PRODUCT_RTOL:g}; their timings mean nothing): {'; '.join(wrong)}")
    else:
        print(f"every product within {PRODUCT_RTOL:g} of its float32 one")
    return step


if __name__ == "__main__":
    main()
