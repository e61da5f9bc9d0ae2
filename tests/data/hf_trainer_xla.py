"""A Hugging Face Trainer fine-tuning script as it runs on a Neuron host (torch-neuronx:
transformers sees torch_xla and trains on its device), for tests/test_device_xla.py, which
runs it unchanged through ``kiln run-xla``: a small BERT classifier, checkpoints every two
steps, then a second run resumed from the first checkpoint. Prints JSON: where it trained,
the losses, and both runs' final parameters' largest difference."""
import json
import sys

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
from transformers.utils import is_torch_xla_available

cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=32)


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, 100, (8,), generator=g), "labels": torch.tensor(i % 2)}


def run(out_dir, resume=None):
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=4, num_train_epochs=1, logging_steps=1,
                             report_to=[], save_strategy="steps", save_steps=2, seed=0, learning_rate=5e-3)
    trainer = Trainer(model=BertForSequenceClassification(cfg), args=args, train_dataset=Data(), eval_dataset=Data())
    trainer.train(resume_from_checkpoint=resume)
    params = {k: v.detach().cpu() for k, v in trainer.model.state_dict().items()}
    return trainer, params


if __name__ == "__main__":
    out_dir = sys.argv[1]
    trainer, params = run(out_dir)
    evaluated = trainer.evaluate()
    _, resumed = run(out_dir, resume=f"{out_dir}/checkpoint-2")
    print(json.dumps({"xla": is_torch_xla_available(), "device": str(trainer.args.device),
                      "param_device": str(next(trainer.model.parameters()).device),
                      "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                      "eval_loss": evaluated["eval_loss"],
                      "process_zero": [trainer.is_world_process_zero(), trainer.is_local_process_zero(),
                                       trainer.args.should_log, trainer.args.should_save],
                      "resumed_gap": max(float((params[k] - resumed[k]).abs().max()) for k in params)}))
