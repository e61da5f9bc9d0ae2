"""``kiln export`` (``optimum-cli export neuron``): a Hugging Face checkpoint directory compiled
into a directory ``from_pretrained`` loads, checked against the source model.

The task comes from the checkpoint (``--task auto``: its architecture, or a
sentence-transformers directory); encoders go through :mod:`kiln.optimum.neuron.modeling`,
encoder-decoders (``*ForConditionalGeneration``) through :mod:`kiln.optimum.neuron.seq2seq`,
decoders (``*ForCausalLM``) through kiln's LLM path (:func:`kiln.llm.build.compile_llm`). An
encoder (or encoder-decoder) export runs the compiled model and the source model on the same
inputs at the static shapes, a third of each row padded, and reports the largest difference
against ``atol`` (an encoder-decoder: its encoder output and first decoder step).
"""
from __future__ import annotations

import contextlib
import json
import os

import torch

from kiln.errors import CompilerArgsError, ValidationError
from kiln.optimum.neuron import media, modeling, sentence, seq2seq

CLASSES = {
    "feature-extraction": modeling.NeuronModelForFeatureExtraction,
    "fill-mask": modeling.NeuronModelForMaskedLM,
    "multiple-choice": modeling.NeuronModelForMultipleChoice,
    "question-answering": modeling.NeuronModelForQuestionAnswering,
    "text-classification": modeling.NeuronModelForSequenceClassification,
    "token-classification": modeling.NeuronModelForTokenClassification,
    "sentence-similarity": sentence.NeuronSentenceTransformers,
    "image-classification": media.NeuronModelForImageClassification,
    "audio-classification": media.NeuronModelForAudioClassification,
    "automatic-speech-recognition": media.NeuronModelForCTC,
    "text2text-generation": seq2seq.NeuronModelForSeq2SeqLM,
}
SUFFIXES = (("ForImageClassification", "image-classification"), ("ForCTC", "automatic-speech-recognition"),
            ("ForAudioClassification", "audio-classification"),
            ("ForSequenceClassification", "text-classification"),
            ("ForTokenClassification", "token-classification"),
            ("ForQuestionAnswering", "question-answering"), ("ForMaskedLM", "fill-mask"),
            ("ForMultipleChoice", "multiple-choice"), ("ForCausalLM", "text-generation"),
            ("ForConditionalGeneration", "text2text-generation"), ("Model", "feature-extraction"))


def infer_task(path: str) -> str:
    """The task a checkpoint directory was saved for, from its architecture."""
    if os.path.exists(os.path.join(path, "modules.json")):
        return "sentence-similarity"
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise CompilerArgsError(f"{path}: no config.json; give a Hugging Face checkpoint directory")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:      # a JSONDecodeError traceback until 12-03
        raise CompilerArgsError(f"{config_path} is not valid JSON ({e}): the checkpoint is damaged; save it "
                                "again, or copy it again") from None
    if not isinstance(config, dict):
        raise CompilerArgsError(f"{config_path} holds a JSON {type(config).__name__}, not an object: not a "
                                "Hugging Face config")
    archs = config.get("architectures") or []
    for arch in archs:
        for suffix, task in SUFFIXES:
            if arch.endswith(suffix):
                if task == "text2text-generation" and not config.get("is_encoder_decoder"):
                    continue        # LLaVA-style *ForConditionalGeneration: not a text encoder-decoder
                # a speech encoder's sequence classifier (wav2vec2's feature encoder) hears audio
                return "audio-classification" if task == "text-classification" and "conv_dim" in config else task
    raise CompilerArgsError(f"{path}: cannot infer the task from its architectures {archs}; pass --task "
                            f"(one of {', '.join(sorted([*CLASSES, 'text-generation']))})")


def export(model_dir: str, output: str, task: str = "auto", atol: float | None = None,
           validate: bool = True, **kwargs) -> dict:
    """Export ``model_dir`` into ``output``; what was done (task, cache hit, validation)."""
    model_dir = os.fspath(model_dir)
    task = infer_task(model_dir) if task in (None, "auto") else task
    _task_fits(model_dir, task)
    if task == "text-generation":
        return _export_decoder(model_dir, output, kwargs)
    cls = CLASSES.get(task)
    if cls is None:
        raise CompilerArgsError(f"--task {task}: kiln exports {', '.join(sorted([*CLASSES, 'text-generation']))}")
    try:
        with _seeded():     # weights the checkpoint lacks are drawn as check() draws them for the source model
            model = cls.from_pretrained(model_dir, export=True, **kwargs)
    except CompilerArgsError as e:      # the class's own check names no task that fits (modeling._export)
        if "does not fit" not in str(e):
            raise
        raise CompilerArgsError(f"--task {task} does not fit {model_dir}: its weights have other shapes than a "
                                f"{task} model's (e.g. a classifier head with another number of labels); tasks "
                                f"that fit this checkpoint: {_fitting(model_dir)}") from None
    report = {"task": task, "class": cls.__name__, "output": output,
              "cache_hit": model.cache_hit}
    if validate:      # before saving: a model that fails its check leaves no directory to load
        atol = atol if atol is not None else (1e-2 if model.neuron.get("auto_cast") else 1e-4)
        report["validation"] = (check_seq2seq(model, model_dir, atol) if task == "text2text-generation"
                                else check(cls, model, model_dir, atol))
    model.save_pretrained(output)
    return report


@contextlib.contextmanager
def _seeded(seed: int = 0):
    """transformers draws the weights a checkpoint lacks (a ``--task fill-mask`` export of a
    classifier: the LM head) from torch's generator: the exported model and check()'s source
    model draw them after the same seed, so both have the same head; the caller's generator is
    left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _task_fits(model_dir: str, task: str) -> None:
    """An encoder-decoder exports as text2text-generation only: its bare model or an encoder
    task would need decoder inputs (T5's "exactly one of input_ids or inputs_embeds")."""
    config_path = os.path.join(model_dir, "config.json")
    if task in ("text2text-generation", "sentence-similarity") or not os.path.exists(config_path):
        return
    with open(config_path) as f:
        config = json.load(f)
    if config.get("is_encoder_decoder"):
        raise CompilerArgsError(f"--task {task} does not fit {model_dir}: it is an encoder-decoder "
                                f"({', '.join(config.get('architectures') or [config.get('model_type', '?')])}), "
                                "which kiln (as Optimum Neuron) exports with --task text2text-generation "
                                "(NeuronModelForSeq2SeqLM)")


def _fitting(model_dir: str) -> str:
    try:
        own = infer_task(model_dir)
    except CompilerArgsError:
        return "feature-extraction"
    return own if own in ("feature-extraction", "text-generation", "text2text-generation") else \
        f"{own} (its architecture's), feature-extraction"


def check(cls, model, model_dir: str, atol: float) -> dict:
    """The compiled model against the source model at the static shapes, a third of each row
    masked, and on a third shorter input, which the compiled model pads to its shapes (unless
    the export found that padding changes the model's answers: then it takes no shorter one)."""
    import transformers
    with _seeded():     # as export() drew the weights the checkpoint lacks
        reference = getattr(transformers, cls.auto_class).from_pretrained(model_dir, local_files_only=True).eval()
    inputs = {k: v for k, v in cls._example(reference, reference.config, model.static).items()
              if k in model.input_names}
    length = inputs["input_ids"].shape[-1]
    if "attention_mask" in inputs:
        inputs["attention_mask"][..., length - length // 3:] = 0
    cases = [inputs]
    if not model.neuron.get("padding_changes_answers") and length // 3:
        cases.append({k: v[..., :length - length // 3] for k, v in cases[0].items() if k != "attention_mask"})
    errors = {}
    for case, suffix in zip(cases, ("", " (shorter input, padded)")):
        with torch.no_grad():
            want = reference(**case, return_dict=True)
        got = modeling.NeuronTracedModel.forward(model, **case)
        for name in model.output_names:
            keep = case.get("attention_mask") if name in modeling.PER_TOKEN else None
            diff = (got[name] - want[name]).abs()
            if keep is not None and diff.dim() >= keep.dim():      # padded positions are not the model's answer
                diff = diff[keep.bool()]
            errors[name + suffix] = float(diff.max())
    return _verdict(errors, atol)


def _verdict(errors: dict, atol: float) -> dict:
    worst = max(errors.values())
    if worst > atol:
        raise ValidationError(f"the exported model differs from the source model by up to {worst:.3g} "
                              f"(atol {atol:g}): {errors}; raise --atol if that is acceptable")
    return {"max_abs_difference": errors, "atol": atol, "passed": True}


def check_seq2seq(model, model_dir: str, atol: float) -> dict:
    """An encoder-decoder's encoder output and its first decoder steps (the start token and two
    more, or as many as the decoder length holds, on ``batch_size * num_beams`` rows; with a KV
    cache one token a step through the cache) against the source model at the static shapes, a
    third of each input row masked; the same report as :func:`check`."""
    import transformers
    reference = transformers.AutoModelForSeq2SeqLM.from_pretrained(model_dir, local_files_only=True).eval()
    rows, length, beams = (model.static[k] for k in ("batch_size", "sequence_length", "num_beams"))
    vocab = max(int(getattr(reference.config, "vocab_size", 2) or 2), 2)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (rows, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[:, length - length // 3:] = 0
    start = reference.generation_config.decoder_start_token_id
    start = reference.config.decoder_start_token_id if start is None else start
    steps = min(3, model.static["decoder_sequence_length"])
    decoder_ids = torch.randint(1, vocab, (rows * beams, steps), generator=gen)
    decoder_ids[:, 0] = int(start or 0)
    with torch.no_grad():
        hidden = reference.get_encoder()(input_ids=ids, attention_mask=mask, return_dict=True).last_hidden_state
        expanded, beam_mask = hidden.repeat_interleave(beams, dim=0), mask.repeat_interleave(beams, dim=0)
        want = reference(encoder_outputs=(expanded,), attention_mask=beam_mask, decoder_input_ids=decoder_ids,
                         use_cache=False, return_dict=True).logits
    got_hidden = model.encode(ids, mask)
    cache = model.new_cache() if model.kv_cache else None
    got = [model.decode(decoder_ids[:, t:t + 1], expanded, beam_mask, cache=cache) if cache is not None
           else model.decode(decoder_ids[:, :t + 1], expanded, beam_mask) for t in range(steps)]
    errors = {"last_hidden_state": float((got_hidden - hidden).abs()[mask.bool()].max()),
              "logits": float((torch.cat(got, dim=1) - want).abs().max())}
    return _verdict(errors, atol)


def _export_decoder(model_dir: str, output: str, kwargs: dict) -> dict:
    """A decoder through kiln's LLM path (:class:`~kiln.optimum.neuron.causal.NeuronModelForCausalLM`):
    ``batch_size`` streams, ``sequence_length`` positions of KV cache."""
    from kiln.optimum.neuron.causal import NeuronModelForCausalLM
    kwargs = dict(kwargs)
    batch, seq = kwargs.pop("batch_size", None), kwargs.pop("sequence_length", None)
    if not batch or not seq:
        raise CompilerArgsError("exporting a text-generation model needs --batch_size and --sequence_length")
    cores = kwargs.pop("num_cores", None) or kwargs.pop("tensor_parallel_size", None) or 1
    cast = kwargs.pop("auto_cast_type", None)
    if cast not in (None, "fp32"):
        raise CompilerArgsError(f"auto_cast_type={cast!r}: kiln's LLM path compiles float32 weights or "
                                "quantizes them (kiln llm compile --quantize int8/int4)")
    options = {"optlevel": int(kwargs.pop("optlevel", 2))}
    if kwargs.pop("disable_neuron_cache", False):
        options["cache"] = False
    ignored = sorted(k for k in kwargs if k not in ("instance_type", "compiler_workdir"))
    if ignored:
        raise CompilerArgsError(f"{', '.join(ignored)}: not options of a text-generation export")
    nc = NeuronModelForCausalLM.get_neuron_config(model_dir, batch_size=batch, sequence_length=seq,
                                                  tensor_parallel_size=cores)
    model = NeuronModelForCausalLM.export(model_dir, nc, **options)
    model.save_pretrained(output)
    return {"task": "text-generation", "class": "NeuronModelForCausalLM", "output": output, "cache_hit": None,
            "validation": {"passed": True, "note": "each graph was checked against eager PyTorch as it compiled"}}
