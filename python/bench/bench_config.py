"""One config of bench/bench_configs.json for the benchmark scripts that measure a single shape: the --config and
--file arguments, and the lookup by name (an unknown name exits naming the known ones)."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def add_config_args(ap, default="readme-default"):
    ap.add_argument("--config", default=default)
    ap.add_argument("--file", default=str(ROOT / "bench" / "bench_configs.json"))


def load_config(args):
    """The config named args.config in args.file (a dict: name, T, H, I, E, K, ...)."""
    cfgs = {c["name"]: c for c in json.load(open(args.file))["configs"]}
    if args.config not in cfgs:
        sys.exit(f"unknown config {args.config!r}; known: {sorted(cfgs)}")
    return cfgs[args.config]
