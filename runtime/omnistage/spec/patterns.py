"""The spec's names, limits and string grammars, shared with the CRD's CEL rules.

Plain values without pydantic, so the error formatter (omnistage.spec.errors) and the models
read the same patterns and the same help text for them.
"""

from __future__ import annotations

import re

from omnistage import __version__

KIND = "OmniPipeline"
POOL_KIND = "StagePool"
#: The runtime image (runtime/Dockerfile). Its tag is the package version, the one version
#: source that the chart's appVersion and the image tags share (tests/unit/test_versions.py).
IMAGE_REPOSITORY = "ghcr.io/omnistage/omnistage"
DEFAULT_IMAGE = f"{IMAGE_REPOSITORY}:{__version__}"
#: Upper bounds shared with the CRD's CEL rules, so the API server and the runtime agree.
MAX_STAGES = 16
MAX_REPLICAS = 64

# A stage name becomes part of pod names (<pipeline>-<stage>-<ordinal>), hence the short limits.
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# The pipeline name prefixes Service names, which must be DNS-1035 labels (leading letter).
DNS1035_LABEL_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
URL_PATTERN = r"^https?://[^\s/]+(/[^\s]*)?$"
#: A voice (speaker) name, as OpenAI's `voice` field and Qwen-Omni's speaker names spell them.
VOICE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
# Names of Secrets and PersistentVolumeClaims.
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
PIPELINE_NAME_MAX = 40
# Pod names are <pipeline>-<stage>-<ordinal>; keep them within one 63-character DNS label.
POD_NAME_MAX = 63
STAGE_NAME_MAX = 20
QUANTITY_PATTERN = r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$"
# A pool's name is <pipeline>-<stage>, and its pods add -<ordinal>.
POOL_NAME_MAX = POD_NAME_MAX - 1 - len(str(MAX_REPLICAS - 1))

# The container image reference grammar (github.com/distribution/reference):
# [registry[:port]/]path[:tag][@digest]. Written for both regex engines that apply it (Rust's in
# pydantic-core is not used: the check is a validator; Go's RE2 runs it in the CRD's CEL rule),
# so it uses explicit classes instead of \w.
_IMAGE_DOMAIN = (
    r"(?:(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
    r"(?:\.(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9]))*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
)
_IMAGE_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE_PATTERN = (
    rf"^(?:{_IMAGE_DOMAIN}/)?{_IMAGE_COMPONENT}(?:/{_IMAGE_COMPONENT})*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$"
)
IMAGE_MAX = 512
IMAGE_GRAMMAR = "[registry[:port]/]name[:tag][@digest]"

#: What a pattern means, in words: the error formatter says this instead of quoting the regex.
PATTERN_HELP = {
    DNS_LABEL_PATTERN: "must be a DNS-1123 label: lowercase letters, digits and '-', "
    "starting and ending with a letter or digit",
    DNS1035_LABEL_PATTERN: "must be a DNS-1035 label: lowercase letters, digits and '-', "
    "starting with a letter and ending with a letter or digit",
    QUANTITY_PATTERN: "must be a Kubernetes quantity such as '500m', '2', '1.5' or '4Gi'",
    URL_PATTERN: "must be an http:// or https:// URL",
    DNS_SUBDOMAIN_PATTERN: "must be a DNS-1123 subdomain: lowercase letters, digits, '-' and "
    "'.', starting and ending with a letter or digit",
}


def image_error(value: str) -> str | None:
    """Why value is not a container image reference, or None when it is one.

    The CRD's CEL rule for images (omni_operator.crd) words its messageExpression the same way,
    so `kubectl apply` and `omnistage validate` print the same sentence.
    """
    if value == "":
        return f"an image is required: {IMAGE_GRAMMAR}, such as {DEFAULT_IMAGE!r}"
    if re.fullmatch(IMAGE_PATTERN, value):
        return None
    if "://" in value:
        bare = value[value.index("://") + 3 :]
        return f"an image reference has no scheme: write {bare!r} instead of {value!r}"
    return (
        f"not a container image reference (got {value!r}): expected {IMAGE_GRAMMAR} "
        f"in lowercase, such as {DEFAULT_IMAGE!r}"
    )


def join_words(items: list[str], last: str = "and") -> str:
    """'a', 'a and b', 'a, b, and c': how descriptions and messages list kinds."""
    if len(items) <= 2:
        return f" {last} ".join(items)
    return ", ".join(items[:-1]) + f", {last} " + items[-1]
