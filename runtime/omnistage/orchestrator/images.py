"""Image tensors to PNG for the images API.

Diffusion stages return pixels as a uint8 [H, W, 3] tensor; OpenAI clients expect base64 PNG.
The encoder is lenient about layout (grayscale, alpha, channel-first, float in [0, 1]) so a custom
diffusion model does not need a new HTTP layer, but it refuses anything it would have to guess.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
from PIL import Image

__all__ = ["ImageEncodeError", "png_base64", "tensor_to_png", "to_hwc_uint8"]

# PNG compression: level 1 is several times faster than the default 6 and the tiny size gain
# is not worth holding the event loop for on large images.
_COMPRESS_LEVEL = 1
_MAX_SIDE = 16_384


class ImageEncodeError(ValueError):
    """The stage returned a tensor that is not an image this module can encode."""


def _as_array(value: Any) -> np.ndarray:
    """numpy view of a WireTensor, numpy array or nested list."""
    if hasattr(value, "numpy") and hasattr(value, "dtype") and hasattr(value, "shape"):
        arr = value.numpy()
        if getattr(value, "dtype", None) == "bfloat16":
            raise ImageEncodeError("bfloat16 image tensors are not supported; send uint8")
        return np.asarray(arr)
    return np.asarray(value)


def to_hwc_uint8(value: Any) -> np.ndarray:
    """Normalise an image tensor to a contiguous uint8 [H, W, C] array with C in (1, 3, 4).

    Accepts [H, W], [H, W, C], [C, H, W] (C in 1, 3, 4) and a leading batch dimension of 1.
    Floating point pixels are taken to be in [0, 1] and are clipped, as diffusers returns them.
    """
    arr = _as_array(value)
    if arr.ndim == 4 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.ndim != 3:
        raise ImageEncodeError(f"image tensor must have 2 or 3 dimensions, got shape {arr.shape}")
    if arr.shape[-1] not in (1, 3, 4) and arr.shape[0] in (1, 3, 4):
        arr = np.moveaxis(arr, 0, -1)
    height, width, channels = arr.shape
    if channels not in (1, 3, 4):
        raise ImageEncodeError(f"image tensor must have 1, 3 or 4 channels, got shape {arr.shape}")
    if not (0 < height <= _MAX_SIDE and 0 < width <= _MAX_SIDE):
        raise ImageEncodeError(f"image size {width}x{height} is out of range")
    if arr.dtype == np.uint8:
        pass
    elif arr.dtype == np.bool_:
        arr = arr.astype(np.uint8) * 255
    elif np.issubdtype(arr.dtype, np.floating):
        arr = np.nan_to_num(arr.astype(np.float32), nan=0.0, posinf=1.0, neginf=0.0)
        arr = np.rint(np.clip(arr, 0.0, 1.0) * 255.0).astype(np.uint8)
    elif np.issubdtype(arr.dtype, np.integer):
        arr = np.clip(arr, 0, 255).astype(np.uint8)
    else:
        raise ImageEncodeError(f"unsupported image dtype {arr.dtype}")
    return np.ascontiguousarray(arr)


def tensor_to_png(value: Any) -> bytes:
    """PNG bytes of an image tensor (see to_hwc_uint8 for the accepted layouts)."""
    arr = to_hwc_uint8(value)
    # fromarray infers L / RGB / RGBA from the uint8 layout (its mode argument is deprecated).
    image = Image.fromarray(arr[:, :, 0] if arr.shape[-1] == 1 else arr)
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=_COMPRESS_LEVEL)
    return buf.getvalue()


def png_base64(value: Any) -> str:
    """Base64 (standard alphabet, padded) PNG: what OpenAI's b64_json carries."""
    return base64.b64encode(tensor_to_png(value)).decode("ascii")
