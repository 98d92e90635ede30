#!/usr/bin/env bash
# Restarts under chaos (tests/python/chaos.py): the main job's model trained with
# AdamW8bit and Shampoo on 2 ranks under torchrun --max-restarts while ranks are
# SIGKILLed at least 10 times (inside an all-gather, an optimizer step, a
# checkpoint's writes, after its marker, while loading, from outside at random);
# the final parameters and optimizer states must equal an uninterrupted run's, bit
# for bit. Prints the kills, restarts and seconds lost per kill. Arguments go to
# chaos.py (--kills N, --steps N, --seed S). The test suite runs a short variant.
set -euo pipefail
cd "$(dirname "$0")/.."
RFSDP_EXTRA_PACKAGES="fortunes" bash scripts/setup.sh
VENV=${RFSDP_VENV:-$HOME/.cache/rfsdp/venv}
"$VENV/bin/python" tests/python/chaos.py --kills 12 --steps 48 "$@"
