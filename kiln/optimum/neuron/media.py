"""Optimum Neuron's image and audio classes on kiln: ``NeuronModelForImageClassification``
(``pixel_values``), ``NeuronModelForAudioClassification`` and ``NeuronModelForCTC``
(``input_values``).

Only the batch is padded here (with copies of the first row, trimmed back). An image must have
the compiled height and width; audio the compiled ``audio_sequence_length``: a speech encoder
such as wav2vec2 normalizes over time, so zeros appended to a clip change every frame's
answer, and kiln never pads where padding changes answers. Resize or cut the input to the
compiled shape (the image processor does for images), or export at the length you feed.
"""
from __future__ import annotations

import torch

from kiln.errors import CompilerArgsError
from kiln.optimum.neuron.modeling import NeuronTracedModel


class _BatchPadded(NeuronTracedModel):
    """A model whose one float input is padded only along the batch."""

    dims_names: tuple = ()

    @classmethod
    def _example(cls, model, config, shapes) -> dict:
        return {cls.main_input_name: torch.randn(*cls._dims(shapes), generator=torch.Generator().manual_seed(0))}

    def _inputs(self, given: dict) -> dict:
        return {self.main_input_name: torch.as_tensor(given[self.main_input_name]).to(torch.float32)}

    def _run_padded(self, inputs: dict) -> list:
        x = inputs[self.main_input_name]
        want = tuple(self.static[n] for n in self.dims_names)
        if tuple(x.shape[1:]) != want:
            raise ValueError(f"{self.main_input_name} has shape {tuple(x.shape)}; this model was exported for "
                             f"[batch, {', '.join(map(str, want))}] ({', '.join(self.dims_names)}): "
                             "resize or cut the input to that shape, or export at the shape you feed")
        batch, static = x.shape[0], self.static["batch_size"]
        if batch < static:
            x = torch.cat([x, x[:1].expand(static - batch, *x.shape[1:])])
        outs = self.model(x.contiguous())
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        return [o[:batch] for o in outs]


class NeuronModelForImageClassification(_BatchPadded):
    task = "image-classification"
    auto_class = "AutoModelForImageClassification"
    output_names = ("logits",)
    output_class = "ImageClassifierOutput"
    main_input_name = "pixel_values"
    input_modalities = "image"
    shapes = ("batch_size", "num_channels", "height", "width")
    dims_names = ("num_channels", "height", "width")
    defaults = {"num_channels": "num_channels", "height": "image_size", "width": "image_size"}

    @staticmethod
    def _dims(shapes) -> tuple:
        return shapes["batch_size"], shapes["num_channels"], shapes["height"], shapes["width"]

    @classmethod
    def _export(cls, path, config=None, **kwargs):
        """``height``, ``width`` and ``num_channels`` default to the config's ``image_size``
        and ``num_channels``, as Optimum takes them."""
        config = config or _config(path)
        for shape, attr in cls.defaults.items():
            value = getattr(config, attr, None)
            if shape not in kwargs and isinstance(value, int):
                kwargs[shape] = value
        return super()._export(path, config, **kwargs)


class NeuronModelForAudioClassification(_BatchPadded):
    """Audio clips of the compiled length. An ``attention_mask`` (the speech pipeline's feature
    extractor sends one) is taken when it masks nothing; one that masks samples is a padded
    clip, refused (module doc)."""
    task = "audio-classification"
    auto_class = "AutoModelForAudioClassification"
    output_names = ("logits",)
    output_class = "SequenceClassifierOutput"
    main_input_name = "input_values"
    input_modalities = "audio"
    shapes = ("batch_size", "audio_sequence_length")
    dims_names = ("audio_sequence_length",)

    @staticmethod
    def _dims(shapes) -> tuple:
        return shapes["batch_size"], shapes["audio_sequence_length"]

    def _accept(self, given: dict) -> dict:
        mask = given.pop("attention_mask", None)
        if mask is not None and not bool(torch.as_tensor(mask).all()):
            raise ValueError("attention_mask marks padded samples: this model was exported without a mask "
                             "(zeros appended to a clip change a speech encoder's answer); give each clip at "
                             "the compiled audio_sequence_length")
        return given


class NeuronModelForCTC(NeuronModelForAudioClassification):
    task = "automatic-speech-recognition"
    auto_class = "AutoModelForCTC"
    output_class = "CausalLMOutput"


def _config(path):
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except OSError as e:
        raise CompilerArgsError(f"{path}: no Hugging Face config there ({e})") from None
