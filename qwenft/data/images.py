"""Where an image part's pixels are: a file path, encoded bytes (a data URI, a `datasets` Image column) or a
PIL image; checked when the row is read, decoded when its micro batch is built (and for video frames)."""

import base64
import binascii
import io
import os
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps

from qwenft.data.chat import BadRow

DEFAULT_MAX_IMAGE_BYTES = 32 * 1024 * 1024


@dataclass
class ImageSource:
    """Where an image's bytes are: a file path, encoded bytes, or a PIL image already in memory."""
    path: str | None = None
    data: bytes | None = None
    image: Image.Image | None = None

    def open(self) -> Image.Image:
        """The decoded RGB image (raises BadRow `image_undecodable` / `image_too_large`)."""
        try:
            if self.image is not None:
                image = self.image
            else:
                image = Image.open(self.path if self.path is not None else io.BytesIO(self.data))
                # upright as the EXIF orientation of a phone's photo says, as transformers' load_image turns it
                ImageOps.exif_transpose(image, in_place=True)
            image.load()
            return image.convert("RGB")
        except Image.DecompressionBombError as e:
            raise BadRow("image_too_large", f"image {self.describe()} is too large to decode ({e})") from None
        except (OSError, ValueError, SyntaxError) as e:
            raise BadRow("image_undecodable", f"image {self.describe()} cannot be decoded ({e})") from None

    def describe(self) -> str:
        if self.path is not None:
            return repr(self.path)
        return f"of {len(self.data)} bytes" if self.data is not None else "(PIL image)"


def image_source(value, base_dir: Path, max_image_bytes: int) -> ImageSource:
    """An image part's value -> ImageSource; missing files, bad URIs and over-size images are BadRows."""
    if isinstance(value, Image.Image):
        return ImageSource(image=value)
    if isinstance(value, dict):  # datasets' Image feature as a row: {"bytes": ..., "path": ...}
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        data = bytes(value)
    elif isinstance(value, str) and value.startswith("data:"):
        header, _, payload = value.partition(",")
        if not header.endswith(";base64"):
            raise BadRow("image_source", f"image data URI {value[:40]!r}... is not base64")
        if len(payload) * 3 // 4 > max_image_bytes:
            raise BadRow("image_too_large", f"image data URI holds over {max_image_bytes} bytes "
                                            "(data.image.max_image_bytes)")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise BadRow("image_undecodable", f"image data URI is not valid base64 ({e})") from None
    elif isinstance(value, str) and value:
        if "://" in value:
            raise BadRow("image_source", f"image {value!r} is a URL; qwenft reads local files and data URIs only")
        path = Path(value) if os.path.isabs(value) else base_dir / value
        try:
            size = path.stat().st_size
        except OSError:
            raise BadRow("image_missing", f"image file {str(path)!r} does not exist") from None
        if size > max_image_bytes:
            raise BadRow("image_too_large", f"image file {str(path)!r} has {size} bytes, over "
                                            f"data.image.max_image_bytes={max_image_bytes}")
        return ImageSource(path=str(path))
    else:
        raise BadRow("image_source", f"image part holds {type(value).__name__}; expected a path, a data URI, "
                                     "bytes or a PIL image")
    if len(data) > max_image_bytes:
        raise BadRow("image_too_large", f"image of {len(data)} bytes is over "
                                        f"data.image.max_image_bytes={max_image_bytes}")
    return ImageSource(data=data)
