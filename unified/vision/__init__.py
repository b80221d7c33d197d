"""Image input: loading untrusted images (`images`), family preprocessing matching the transformers
processors (`preprocess`, one file per family), and prompt placeholder expansion (`placeholders`)."""
from unified.lazy import lazy_exports

_EXPORTS = {"ImageError": "unified.vision.images", "load_image": "unified.vision.images",
            "ImageInputs": "unified.vision.pixels", "ImageProcessor": "unified.vision.pixels",
            "processor_for": "unified.vision.preprocess", "image_prompt_marker": "unified.vision.preprocess",
            "expand_image_placeholders": "unified.vision.placeholders"}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
