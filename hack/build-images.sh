#!/usr/bin/env bash
# Build (or reuse from cache) the runtime and operator images. Safe to call every time: a warm
# run only hashes the inputs. See hack/build_images.py and docs/images.md.
#
#   hack/build-images.sh [runtime|operator ...] [--force] [--torch cuda|cpu]
#   hack/build-images.sh --print-index        # the image index the local pod runner reads
#   OMNISTAGE_BREAK_IMAGE=1 hack/build-images.sh   # TEST ONLY: a runtime image whose entry point
#                                                  # fails (proves hack/test.sh's image canary)
#
# Images are cached by a hash of their inputs (tag <repository>:<hash>), shared by every checkout.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${PYTHON:-python3}" "$here/build_images.py" "$@"
