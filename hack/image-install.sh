#!/bin/sh
# Runs INSIDE image builds (runtime/Dockerfile and operator/Dockerfile); one script, so both
# images install the same way.
#
#   image-install.sh requirements EXTRA   write /build/requirements.txt: pyproject.toml's
#                                         dependencies plus those of EXTRA (the only input of
#                                         the heavy layer, so other pyproject edits reuse it)
#   image-install.sh deps VARIANT         install /build/requirements.txt into the venv
#                                         /opt/omnistage; VARIANT is the torch build: cuda, cpu,
#                                         or none for requirements without torch
#   image-install.sh app                  the project itself into /opt/omnistage-app
#
# The host's package-index configuration (pip.conf, PIP_* variables, the CA bundle they name)
# arrives as build secrets mounted under /run/secrets (hack/build-images.sh writes them); it is
# never part of a layer, an ENV or a build argument.
set -eu
VENV=/opt/omnistage
APP=/opt/omnistage-app
if [ -f /run/secrets/pipconf ]; then
  export PIP_CONFIG_FILE=/run/secrets/pipconf
fi
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore

case "${1:-}" in
requirements)
  python3 -c '
import sys, tomllib
project = tomllib.load(open("/build/pyproject.toml", "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"][sys.argv[1]]))
' "$2" >/build/requirements.txt
  ;;
deps)
  variant=$2
  python3 -m venv "$VENV"
  torch="$(grep -E '^torch([<>=!~ ;[]|$)' /build/requirements.txt || true)"
  case "$variant" in
  none)
    if [ -n "$torch" ]; then
      echo "image-install.sh: these requirements need torch: pass cpu or cuda" >&2
      exit 2
    fi
    ;;
  cuda) ;; # PyPI's default torch wheel is the CUDA build (it pulls the nvidia-* wheels)
  cpu) "$VENV/bin/pip" install --index-url https://download.pytorch.org/whl/cpu "$torch" ;;
  *)
    echo "image-install.sh: TORCH_VARIANT must be cpu, cuda or none, not '$variant'" >&2
    exit 2
    ;;
  esac
  "$VENV/bin/pip" install -r /build/requirements.txt
  # The project lives in its own small layer ($APP); the venv finds it through a .pth file.
  site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
  echo "$APP" >"$site/omnistage-app.pth"
  ;;
app)
  # A throwaway venv at the same path as the deps stage's, so the `omnistage` console script's
  # shebang (#!/opt/omnistage/bin/python3) is right in the final image.
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --no-deps --target "$APP" /build/src
  ;;
*)
  echo "usage: image-install.sh requirements EXTRA | deps cuda|cpu|none | app" >&2
  exit 2
  ;;
esac
