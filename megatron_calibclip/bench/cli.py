"""`calibclip bench ...` subcommands."""
from __future__ import annotations


def add_bench_parser(subparsers) -> None:
    from megatron_calibclip.bench.step import add_step_parser

    p = subparsers.add_parser("bench", help="benchmarks that print JSON")
    sub = p.add_subparsers(dest="bench", required=True)
    add_step_parser(sub)
    from megatron_calibclip.bench.weight_cache import add_weight_cache_parser

    add_weight_cache_parser(sub)
    from megatron_calibclip.bench.gemm import add_gemm_parser

    add_gemm_parser(sub)
    try:
        from megatron_calibclip.bench.quantile import add_quantile_parser
    except ImportError:  # pragma: no cover - lands separately
        return
    add_quantile_parser(sub)
