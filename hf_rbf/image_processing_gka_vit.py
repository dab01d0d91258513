"""Image processor of the GKA vision transformer: channels, resize, rescale, normalise -> ``pixel_values``.

NumPy, and Pillow for resizing (no torchvision), so it runs wherever transformers does and loads as remote code.
"""

from __future__ import annotations

import numpy as np
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature


try:  # Pillow is optional: needed only to resize and to read PIL images (hf_rbf[recipes] installs it)
    from PIL import Image
except ImportError:
    Image = None


# PIL's resampling codes (PIL.Image.Resampling): NEAREST 0, LANCZOS 1, BILINEAR 2, BICUBIC 3, BOX 4, HAMMING 5.
BILINEAR = 2

# MNIST training-set statistics of pixel / 255 (mean 33.32 / 255, std of all pixels).
MNIST_MEAN = (0.1307,)
MNIST_STD = (0.3081,)
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)


class GkaVitImageProcessor(BaseImageProcessor):
    r"""Turn images into ``pixel_values`` ``[B, num_channels, height, width]`` (float32).

    Steps, each switchable: channel conversion to ``num_channels`` (grayscale -> RGB by repetition, RGB -> grayscale
    by ITU-R 601 luma, an alpha channel is dropped), resize to ``size`` with ``resample`` (PIL, per channel, in float),
    rescale by ``rescale_factor`` (1/255: uint8 -> [0, 1]), normalise with ``image_mean`` / ``image_std``.

    Accepted inputs: a PIL image, a NumPy array or torch tensor ``[H, W]``, ``[H, W, C]`` or ``[C, H, W]``
    (C in 1, 3, 4), a list of those, or a batch array ``[B, H, W]`` / ``[B, H, W, C]`` / ``[B, C, H, W]``.  A 3-D
    array whose first and last dims are both not 1, 3 or 4 is read as a batch of grayscale images (e.g. MNIST
    ``[B, 28, 28]``).

    Args:
        do_resize, size (``{"height": h, "width": w}`` or an int), resample: resizing (``resample`` a PIL
            resampling code, default 2 = bilinear).
        do_rescale, rescale_factor: multiply the pixel values.
        do_normalize, image_mean, image_std: per-channel ``(x - mean) / std`` (one value per output channel, or
            one value for all).  Defaults: the MNIST statistics.
        num_channels: channels of the output (the model's ``config.num_channels``).
    """

    model_input_names = ["pixel_values"]

    def __init__(
        self,
        do_resize: bool = True,
        size: dict | int | None = None,
        resample: int = BILINEAR,
        do_rescale: bool = True,
        rescale_factor: float = 1 / 255,
        do_normalize: bool = True,
        image_mean: float | list[float] | None = None,
        image_std: float | list[float] | None = None,
        num_channels: int = 1,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.do_resize = do_resize
        self.size = self._size_dict(size if size is not None else 28)
        self.resample = int(resample)
        self.do_rescale = do_rescale
        self.rescale_factor = float(rescale_factor)
        self.do_normalize = do_normalize
        if num_channels not in (1, 3):
            raise ValueError(f"GkaVitImageProcessor: `num_channels` must be 1 or 3; got {num_channels!r}")
        self.num_channels = num_channels
        self.image_mean = self._per_channel("image_mean", MNIST_MEAN if image_mean is None else image_mean)
        self.image_std = self._per_channel("image_std", MNIST_STD if image_std is None else image_std)

    @staticmethod
    def _size_dict(size) -> dict:
        if isinstance(size, int) and not isinstance(size, bool):
            return {"height": size, "width": size}
        if isinstance(size, dict) and set(size) == {"height", "width"}:
            return {"height": int(size["height"]), "width": int(size["width"])}
        raise ValueError(f"GkaVitImageProcessor: `size` must be an int or {{'height': h, 'width': w}}; got {size!r}")

    def _per_channel(self, name, value) -> list[float]:
        v = [float(value)] if isinstance(value, (int, float)) else [float(x) for x in value]
        if len(v) == 1:
            v = v * self.num_channels
        if len(v) != self.num_channels:
            raise ValueError(
                f"GkaVitImageProcessor: `{name}` needs 1 or {self.num_channels} values (num_channels); got {value!r}"
            )
        return v

    # --------------------------------------------------------------------------------------------------------
    # input handling
    # --------------------------------------------------------------------------------------------------------

    @staticmethod
    def _is_channel(n: int) -> bool:
        return n in (1, 3, 4)

    def _to_list(self, images) -> list[np.ndarray]:
        """Flatten the accepted inputs into a list of float32 ``[H, W, C]`` arrays."""
        if isinstance(images, (list, tuple)):
            out = []
            for im in images:
                out.extend(self._to_list(im))
            return out
        if Image is not None and isinstance(images, Image.Image):
            return [self._hwc(np.asarray(images))]
        if hasattr(images, "detach") and hasattr(images, "cpu"):  # torch.Tensor, without importing torch here
            images = images.detach().cpu().float().numpy()
        if not isinstance(images, np.ndarray):
            raise TypeError(
                "GkaVitImageProcessor: images must be PIL images, NumPy arrays or torch tensors (or lists of them); "
                f"got {type(images).__name__}"
            )
        if images.ndim == 4:
            return [self._hwc(im) for im in images]
        if images.ndim == 3 and not (self._is_channel(images.shape[0]) or self._is_channel(images.shape[-1])):
            return [self._hwc(im) for im in images]  # a batch of grayscale images
        if images.ndim in (2, 3):
            return [self._hwc(images)]
        raise ValueError(f"GkaVitImageProcessor: cannot read an image array of shape {images.shape}")

    def _hwc(self, im: np.ndarray) -> np.ndarray:
        im = np.asarray(im, dtype=np.float32)
        if im.ndim == 2:
            return im[:, :, None]
        if im.ndim != 3:
            raise ValueError(f"GkaVitImageProcessor: an image must be 2-D or 3-D; got shape {im.shape}")
        if self._is_channel(im.shape[-1]):
            return im
        if self._is_channel(im.shape[0]):
            return np.moveaxis(im, 0, -1)
        raise ValueError(f"GkaVitImageProcessor: cannot find the channel axis (1, 3 or 4) in shape {im.shape}")

    def _convert_channels(self, im: np.ndarray) -> np.ndarray:
        c = im.shape[-1]
        if c == 4:
            im, c = im[..., :3], 3
        if c == self.num_channels:
            return im
        if self.num_channels == 3:  # grayscale -> RGB
            return np.repeat(im, 3, axis=-1)
        return (im @ _LUMA)[..., None]  # RGB -> grayscale

    def _resize(self, im: np.ndarray, size: dict, resample: int) -> np.ndarray:
        h, w = size["height"], size["width"]
        if im.shape[:2] == (h, w):
            return im
        if Image is None:
            raise ImportError(
                f"GkaVitImageProcessor: resizing {im.shape[1]}x{im.shape[0]} images to {w}x{h} needs Pillow "
                "(pip install pillow), or pass images of the model's size"
            )
        chans = []
        for i in range(im.shape[-1]):
            channel = Image.fromarray(np.ascontiguousarray(im[..., i], dtype=np.float32))  # PIL mode "F"
            chans.append(np.asarray(channel.resize((w, h), resample=resample)))
        return np.stack(chans, axis=-1)

    # --------------------------------------------------------------------------------------------------------

    def preprocess(
        self,
        images,
        do_resize: bool | None = None,
        size: dict | int | None = None,
        resample: int | None = None,
        do_rescale: bool | None = None,
        rescale_factor: float | None = None,
        do_normalize: bool | None = None,
        image_mean=None,
        image_std=None,
        return_tensors=None,
        **kwargs,
    ) -> BatchFeature:
        """Process images (see the class docstring); ``return_tensors="pt"`` gives torch tensors."""
        do_resize = self.do_resize if do_resize is None else do_resize
        size = self.size if size is None else self._size_dict(size)
        resample = self.resample if resample is None else int(resample)
        do_rescale = self.do_rescale if do_rescale is None else do_rescale
        rescale_factor = self.rescale_factor if rescale_factor is None else float(rescale_factor)
        do_normalize = self.do_normalize if do_normalize is None else do_normalize
        mean = np.asarray(self.image_mean if image_mean is None else self._per_channel("image_mean", image_mean),
                          dtype=np.float32)
        std = np.asarray(self.image_std if image_std is None else self._per_channel("image_std", image_std),
                         dtype=np.float32)
        if kwargs:
            raise TypeError(f"GkaVitImageProcessor.preprocess: unexpected arguments {sorted(kwargs)}")

        out = []
        for im in self._to_list(images):
            im = self._convert_channels(im)
            if do_resize:
                im = self._resize(im, size, resample)
            if do_rescale:
                im = im * rescale_factor
            if do_normalize:
                im = (im - mean) / std
            out.append(np.ascontiguousarray(np.moveaxis(im, -1, 0), dtype=np.float32))
        if not out:
            raise ValueError("GkaVitImageProcessor: no images given")
        shapes = {o.shape for o in out}
        if len(shapes) > 1:
            raise ValueError(f"GkaVitImageProcessor: images of different sizes {sorted(shapes)}; set do_resize=True")
        return BatchFeature(data={"pixel_values": np.stack(out)}, tensor_type=return_tensors)


GkaVitImageProcessor.register_for_auto_class("AutoImageProcessor")


__all__ = ["GkaVitImageProcessor", "MNIST_MEAN", "MNIST_STD"]
