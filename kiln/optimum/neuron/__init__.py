"""Optimum Neuron's API on kiln: swap ``from optimum.neuron import ...`` for
``from kiln.optimum.neuron import ...`` and keep the script.

    from kiln.optimum.neuron import NeuronModelForSequenceClassification
    model = NeuronModelForSequenceClassification.from_pretrained(
        "./my-bert", export=True, batch_size=1, sequence_length=128)
    model.save_pretrained("./my-bert-kiln")          # model.kiln + config.json ("neuron" section)
    model = NeuronModelForSequenceClassification.from_pretrained("./my-bert-kiln")   # no recompile

Fine-tuning: ``NeuronTrainer`` and ``NeuronTrainingArguments`` (:mod:`kiln.optimum.neuron.trainer`),
Hugging Face's Trainer on kiln's device.

Only local directories: nothing is downloaded. See docs/optimum.md.
"""
from kiln.optimum.neuron.modeling import (NeuronModelForFeatureExtraction, NeuronModelForMaskedLM,
                                          NeuronModelForMultipleChoice, NeuronModelForQuestionAnswering,
                                          NeuronModelForSequenceClassification,
                                          NeuronModelForTokenClassification, NeuronTracedModel)
from kiln.optimum.neuron.causal import NeuronModelForCausalLM
from kiln.optimum.neuron.media import (NeuronModelForAudioClassification, NeuronModelForCTC,
                                       NeuronModelForImageClassification)
from kiln.optimum.neuron.pipelines import pipeline
from kiln.optimum.neuron.sentence import NeuronModelForSentenceTransformers, NeuronSentenceTransformers
from kiln.optimum.neuron.seq2seq import NeuronModelForSeq2SeqLM

__all__ = ["NeuronModelForAudioClassification", "NeuronModelForCTC", "NeuronModelForCausalLM",
           "NeuronModelForImageClassification", "NeuronModelForFeatureExtraction", "NeuronModelForMaskedLM", "NeuronModelForMultipleChoice",
           "NeuronModelForQuestionAnswering", "NeuronModelForSeq2SeqLM", "NeuronModelForSequenceClassification",
           "NeuronModelForSentenceTransformers", "NeuronModelForTokenClassification", "NeuronSentenceTransformers",
           "NeuronTracedModel", "NeuronTrainer", "NeuronTrainingArguments", "pipeline"]


def __getattr__(name):
    """The trainer on first use: it imports transformers' Trainer (and accelerate), which
    inference scripts need not pay for."""
    if name in ("NeuronTrainer", "NeuronTrainingArguments"):
        from kiln.optimum.neuron import trainer
        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
