"""`hstu import-checkpoint`: convert an upstream checkpoint into DST.pt + DST.json.

Import-light (argparse only): hstu/cli.py imports every subcommand to build its parser; torch and
the importer load when the command runs.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "import-checkpoint",
        help="convert an NVIDIA recsys-examples or Meta generative-recommenders checkpoint",
        description="Write DST.pt (state dict) and DST.json (HSTUConfig) for hstu serve --config DST.json --checkpoint DST.pt.",
    )
    p.add_argument("src", help="NVIDIA: checkpoint dir (torch_module/model.0.pth) or file; Meta: state dict file")
    p.add_argument("dst", help="output path stem: writes DST.pt and DST.json")
    p.add_argument("--format", required=True, choices=["nvidia", "meta"], help="upstream trainer")
    p.add_argument("--num-heads", type=int, required=True, help="attention heads (shapes only give heads x head dim)")
    p.add_argument(
        "--scaling-seqlen",
        type=int,
        default=None,
        help="attention normaliser (NVIDIA scaling_seqlen; required for Meta, which trains with the batch's longest sequence)",
    )
    p.add_argument("--tables", default=None, help="file of exported embedding tables {name: [rows, D] tensor}")
    p.add_argument("--item-table", default="item", help="item embedding table name (default %(default)s)")
    p.add_argument("--action-table", default="action", help="action embedding table name (default %(default)s)")
    p.add_argument(
        "--contextual-tables",
        default="",
        help="comma-separated contextual tables, concatenated in this order (feature i's ids offset by the earlier tables' rows)",
    )
    p.add_argument("--num-contextual", type=int, default=0, help="contextual tokens per request (default %(default)s)")
    p.add_argument("--layer-norm-eps", type=float, default=None, help="default: 1e-5 (NVIDIA), 1e-6 (Meta)")
    p.add_argument("--uvqk-layout", default="auto", choices=["auto", "blocked", "per_head"], help="uvqk column order (default %(default)s)")
    p.add_argument("--head-activation", default=None, choices=["relu", "silu"], help="default: relu (NVIDIA), silu (Meta)")
    p.add_argument("--max-seq-len", type=int, default=None, help="default: the position table's rows")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="saved dtype (default %(default)s)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from hstu.model.checkpoint_import import ImportOptions, import_checkpoint

    options = ImportOptions(
        format=args.format,
        num_heads=args.num_heads,
        attn_scaling_seqlen=args.scaling_seqlen,
        layer_norm_eps=args.layer_norm_eps,
        num_contextual=args.num_contextual,
        item_table=args.item_table,
        action_table=args.action_table,
        contextual_tables=tuple(t for t in args.contextual_tables.split(",") if t),
        uvqk_layout=args.uvqk_layout,
        head_activation=args.head_activation,
        max_seq_len=args.max_seq_len,
        dtype=args.dtype,
    )
    import_checkpoint(args.src, args.dst, options, tables=args.tables)
    return 0
