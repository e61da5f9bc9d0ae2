"""Reading a decoder and its tokenizer from where Hugging Face keeps them: a checkpoint
directory (safetensors and config) or a GGUF file, which transformers dequantizes to
float32 weights (it needs the ``gguf`` package). Only local files: nothing is downloaded."""
from __future__ import annotations

import os

from kiln.errors import CompilerArgsError, UnsupportedModelError


def load_pretrained(source: str):
    """``(model, tokenizer or None)`` from a checkpoint directory or a ``.gguf`` file."""
    import torch
    import transformers
    source = os.fspath(source)
    if not os.path.exists(source):
        raise CompilerArgsError(f"{source}: no such file or directory (give a Hugging Face checkpoint "
                                "directory or a .gguf file; nothing is downloaded)")
    if os.path.isfile(source):
        if not source.endswith(".gguf"):
            raise CompilerArgsError(f"{source}: a file must be a .gguf; otherwise give the checkpoint directory")
        folder, where = os.path.dirname(os.path.abspath(source)), {"gguf_file": os.path.basename(source)}
    else:
        folder, where = source, {}
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                  local_files_only=True, **where)
    except (ValueError, KeyError) as e:
        raise UnsupportedModelError(f"{source}: transformers cannot load a causal LM from it: {e}") from None
    except ImportError as e:
        raise CompilerArgsError(f"{source}: {e} (GGUF files need the 'gguf' package)") from None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True, **where)
    except (OSError, ValueError):
        tokenizer = None              # the graphs still compile; text in and out needs one
    return model.eval(), tokenizer
