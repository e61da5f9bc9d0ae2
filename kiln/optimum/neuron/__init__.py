"""Optimum Neuron's API on kiln: swap ``from optimum.neuron import ...`` for
``from kiln.optimum.neuron import ...`` and keep the script.

    from kiln.optimum.neuron import NeuronModelForSequenceClassification
    model = NeuronModelForSequenceClassification.from_pretrained(
        "./my-bert", export=True, batch_size=1, sequence_length=128)
    model.save_pretrained("./my-bert-kiln")          # model.kiln + config.json ("neuron" section)
    model = NeuronModelForSequenceClassification.from_pretrained("./my-bert-kiln")   # no recompile

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
           "NeuronTracedModel", "pipeline"]
