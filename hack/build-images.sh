#!/usr/bin/env bash
# Build (or reuse from cache) the runtime and operator images. Safe to call every time: a warm
# run only hashes the inputs. See hack/build_images.py and docs/images.md.
#
#   hack/build-images.sh [runtime|operator ...] [--force] [--torch cuda|cpu]
#   hack/build-images.sh --print-index        # the image index the local pod runner reads
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${PYTHON:-python3}" "$here/build_images.py" "$@"
