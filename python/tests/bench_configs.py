"""The shapes of bench/bench_configs.json (the configs every benchmark reports), for the full-size GPU tests."""
import json
from pathlib import Path

CONFIGS = json.loads((Path(__file__).resolve().parents[2] / "bench" / "bench_configs.json").read_text())["configs"]
IDS = [c["name"] for c in CONFIGS]
