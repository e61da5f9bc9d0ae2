"""Optimum Neuron's fine-tuning API (``NeuronTrainer``, ``NeuronTrainingArguments``) on kiln's
device: a small BERT classifier trains as Hugging Face's Trainer trains it on the CPU, loss
for loss (dropout included), with gradient accumulation, clipping and a schedule; a run
resumed from its checkpoint ends where the uninterrupted one does; ``save_model`` writes
weights ``from_pretrained`` reads back; ``bf16=True`` reaches the device's operations; Neuron's
parallelism options and ``fp16`` are refused with what to use. In a fresh process: the
trainer puts the process's device in lazy mode."""
import json
import os
import sys
import textwrap

import pytest

from tests.conftest import ROOT, run_py
from tests import forkserver

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = textwrap.dedent("""
    import json, os, sys, torch, transformers
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
    from kiln.optimum.neuron import NeuronTrainer, NeuronTrainingArguments
    from kiln.errors import CompilerArgsError
    root = sys.argv[1]
    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32)

    from tests.data.hf_trainer_xla import Data       # 16 synthetic two-class examples

    dtypes = set()

    def run(args_cls, trainer_cls, name, resume=None, **extra):
        torch.manual_seed(0)
        model = BertForSequenceClassification(cfg)
        model.bert.encoder.layer[0].intermediate.dense.register_forward_hook(
            lambda m, i, o: dtypes.add((name, str(o.dtype))))
        settings = dict(output_dir=os.path.join(root, name), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                        num_train_epochs=1, learning_rate=5e-3, warmup_steps=1, logging_steps=1, report_to=[],
                        save_strategy="no", seed=0, use_cpu=True)
        settings.update(extra)
        trainer = trainer_cls(model=model, args=args_cls(**settings), train_dataset=Data())
        trainer.train(resume_from_checkpoint=resume)
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        params = {k: v.detach().cpu() for k, v in trainer.model.state_dict().items()}
        return trainer, losses, params

    def gap(a, b):
        return max(float((a[k] - b[k]).abs().max()) for k in a)

    out = {}
    _, cpu_losses, cpu_params = run(TrainingArguments, Trainer, "cpu")
    trainer, losses, params = run(NeuronTrainingArguments, NeuronTrainer, "kiln", save_strategy="steps", save_steps=2)
    out["device"] = str(trainer.args.device)
    out["losses"] = [cpu_losses, losses]
    out["param_gap"] = gap(params, cpu_params)
    trainer.save_model(os.path.join(root, "saved"))
    back = BertForSequenceClassification.from_pretrained(os.path.join(root, "saved"))
    out["saved_gap"] = gap({k: v for k, v in back.state_dict().items()}, params)
    _, _, resumed = run(NeuronTrainingArguments, NeuronTrainer, "kiln", resume=os.path.join(root, "kiln", "checkpoint-2"))
    out["resumed_gap"] = gap(resumed, params)
    _, bf16_losses, _ = run(NeuronTrainingArguments, NeuronTrainer, "bf16", bf16=True)
    _, cpu_bf16_losses, _ = run(TrainingArguments, Trainer, "cpu-bf16", bf16=True)
    out["bf16"] = [cpu_bf16_losses, bf16_losses]
    out["dtypes"] = sorted(dtypes)
    refused = []
    for bad in ({"tensor_parallel_size": 2}, {"zero_1": True}, {"fp16": True}):
        try:
            NeuronTrainingArguments(output_dir=root, **bad)
        except CompilerArgsError as e:
            refused.append(str(e))
    try:
        NeuronTrainer(model=BertForSequenceClassification(cfg), args=TrainingArguments(output_dir=root, use_cpu=True))
    except TypeError as e:
        refused.append(str(e))
    out["refused"] = refused
    print(json.dumps(out))
""")


def test_neuron_trainer_trains_as_the_cpu_trainer(tmp_path):
    proc = run_py(SCRIPT.replace("sys.argv[1]", repr(str(tmp_path))), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["device"] == "kiln:0"
    cpu, kiln = out["losses"]
    assert len(cpu) == len(kiln) == 4
    assert kiln == pytest.approx(cpu, rel=1e-5, abs=1e-6)
    assert out["param_gap"] < 1e-5
    assert out["saved_gap"] == 0.0
    assert out["resumed_gap"] < 1e-5
    # bf16 autocast reached the device: the losses move as the CPU's bf16 run's do, away from float32's
    cpu_bf16, kiln_bf16 = out["bf16"]
    assert kiln_bf16 == pytest.approx(cpu_bf16, rel=2e-2, abs=2e-2)
    assert sorted(out["dtypes"]) == [["bf16", "torch.bfloat16"], ["cpu", "torch.float32"],
                                     ["cpu-bf16", "torch.bfloat16"], ["kiln", "torch.float32"]]
    tp, zero, fp16, plain = out["refused"]
    assert "tensor_parallel_size=2" in tp and "kiln.neuronx_distributed" in tp
    assert "zero_1=True" in zero and "fp16=True" in fp16 and "bf16=True" in fp16
    assert "NeuronTrainingArguments" in plain


def test_neuron_trainer_compiles_with_neuron_cc_flags(tmp_path):
    """``NEURON_CC_FLAGS`` reaches the trainer's device as it reaches ``xm.xla_device()``'s
    (kiln.compiler.neuron_env): a Trainium fine-tuning job's ``--auto-cast all
    --auto-cast-type bf16`` and ``--cache_dir`` were ignored, so it computed in float32 and
    compiled into another cache without a word. Neuron-only flags get a warning; a bad value
    is a clear error."""
    code = textwrap.dedent("""
    import json, warnings
    from kiln.optimum.neuron import NeuronTrainingArguments
    from kiln.device import modes
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        device = NeuronTrainingArguments(output_dir=%r, report_to=[]).device
    import os
    from kiln.compiler import neuron_env
    from kiln.errors import CompilerArgsError
    os.environ["NEURON_CC_FLAGS"] = "--auto-cast-type int3"
    try:
        neuron_env.device_options()
        refused = None
    except CompilerArgsError as e:
        refused = str(e)
    print(json.dumps({"device": str(device), "mode": modes.mode(), "options": modes.policy().options,
                      "warned": [str(w.message) for w in caught if "NEURON_CC_FLAGS" in str(w.message)],
                      "refused": refused}))
    """ % str(tmp_path / "out"))
    cache = str(tmp_path / "neuron-cache")
    flags = f"--model-type transformer -O1 --auto-cast all --auto-cast-type bf16 --cache_dir={cache}"
    env = {k: v for k, v in os.environ.items() if k != "KILN_CACHE_URL"}    # kiln's own would win
    proc = forkserver.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(env, NEURON_CC_FLAGS=flags))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["device"] == "kiln:0" and out["mode"] == "lazy"
    assert out["options"] == {"optlevel": 1, "auto_cast": "all", "auto_cast_type": "bf16", "cache": cache}
    assert len(out["warned"]) == 1 and "--model-type transformer" in out["warned"][0], out["warned"]
    assert out["refused"] and "NEURON_CC_FLAGS" in out["refused"] and "int3" in out["refused"], out["refused"]
