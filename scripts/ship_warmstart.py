"""Train a recipe's warm-start from scratch and ship it with the package (hash-checked on load).

    python scripts/ship_warmstart.py                          # the default recipe (tiny_cpu)
    python scripts/ship_warmstart.py --config tiny_cpu k=v    # any recipe and overrides

Writes ``sparrow_nemo/tasks/warmstart/<key>/``: the HF checkpoint the warm-start produces (config.json,
model.safetensors, warmstart.json with the loss per step) and ``manifest.json`` with the key, every file's
sha256, the command and where and when it ran. ``ensure_warm_start`` (sparrow_nemo.grpo.warmstart) then
copies that folder into the cache of any run whose warm-start key is ``<key>`` instead of training, after
checking the hashes. Training always starts from scratch here (a cached or shipped copy is not reused) and
on the CPU runs on one torch thread, so the same machine reproduces the same bytes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from sparrow_nemo.grpo.prompts import build_prompt_source
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.warmstart import MANIFEST, SHIPPED_ROOT, ensure_warm_start, file_sha256
from sparrow_nemo.grpo.world import start_processes
from sparrow_nemo.policy.parallel import destroy_parallel


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=None, help="recipe (default: the default recipe)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory() as cache:
        config = load_config(args.config, [*args.overrides, f"warmstart.cache_dir={cache}"])
        source = build_prompt_source(config)
        start_processes()
        t0 = time.perf_counter()
        try:
            folder = ensure_warm_start(config, source, config.logging.progress_bar, use_shipped=False)
        finally:
            destroy_parallel()
        seconds = time.perf_counter() - t0
        target = SHIPPED_ROOT / folder.name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(folder, target)
    manifest = {
        "key": target.name,
        "sha256": {p.name: file_sha256(p) for p in sorted(target.iterdir()) if p.name != MANIFEST},
        "command": " ".join(["python scripts/ship_warmstart.py", *sys.argv[1:]]),
        "recipe": config.name,
        "warmstart_seconds": round(seconds, 1),
        "torch": torch.__version__,
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()})",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    (target / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"shipped warm-start {target} ({seconds / 60:.1f} min of training)")
    return target


if __name__ == "__main__":
    main()
