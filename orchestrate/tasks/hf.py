"""Hugging Face `transformers` models, built from a config (random weights, nothing downloaded),
for every backend. Only `model._target_` names this module: transformers (seconds to import)
is imported when one of these models is chosen.

    python -m orchestrate model=hf_causal_lm data=python_source backend=ondevice
    python -m orchestrate model=hf_classifier data=python_files backend=ortmodule

orchestrate's loops call `model(x)` and want one tensor of logits, where an HF model takes
keyword arguments and returns a ModelOutput: each class here wraps one HF model (`self.hf`, whose
parameter names keep HF's own below that prefix) and returns its `.logits`.
"""

import warnings
from typing import Annotated

import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

from orchestrate.schema import AT_LEAST_1, PROBABILITY

# "eager": HF's attention written out in matmul, softmax and where, the ops ORT's gradient builder
# knows and that torch.onnx exports plainly at every opset; the default (SDPA) would hand each
# backend a different kernel (PyTorch's fused one, ORT its own decomposition).
ATTENTION = "eager"


class CausalLM(nn.Module):
    """GPT-2 (`GPT2LMHeadModel`): token ids (batch, block_size) -> next-token logits (batch,
    block_size, vocab_size). `dropout` sets all three of GPT-2's dropouts (embeddings, attention,
    residual); HF's default is 0.1."""

    def __init__(self, vocab_size: Annotated[int, AT_LEAST_1], block_size: Annotated[int, AT_LEAST_1],
                 n_layer: Annotated[int, AT_LEAST_1] = 2, n_head: Annotated[int, AT_LEAST_1] = 4,
                 n_embd: Annotated[int, AT_LEAST_1] = 64, dropout: Annotated[float, PROBABILITY] = 0.1):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"model.n_embd ({n_embd}) must be divisible by model.n_head ({n_head})")
        config = GPT2Config(vocab_size=vocab_size, n_positions=block_size, n_embd=n_embd, n_layer=n_layer,
                            n_head=n_head, embd_pdrop=dropout, attn_pdrop=dropout, resid_pdrop=dropout,
                            attn_implementation=ATTENTION, bos_token_id=None, eos_token_id=None)
        self.hf = GPT2LMHeadModel(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # No key/value cache: training sees whole windows, and the cache would be an extra output.
        # The attention mask, all ones, is given: without one transformers 5 looks for packed
        # sequences in the position ids (`torch.diff`, which torch.onnx cannot export, and a host
        # sync every step); transformers 4 builds the same causal mask either way.
        mask = torch.ones_like(idx)
        if not torch.jit.is_tracing():
            return self.hf(input_ids=idx, attention_mask=mask, use_cache=False, return_dict=True).logits
        # Exporting to ONNX (ORTModule, ondevice, the final model.onnx), the tracer warns that GPT-2's
        # causal mask takes a Python branch on the sequence length (`if sequence_length != 1`; in
        # transformers 5 the padding of the mask to the key length, in its masking_utils). The
        # exported graphs fix the sequence length (only the batch dimension is dynamic), so the
        # branch taken is the right one for every input they accept: the warning is left out.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Converting a tensor to a Python boolean", torch.jit.TracerWarning,
                                    r"transformers\.(models\.gpt2\.|masking_utils|modeling_attn_mask_utils)")
            return self.hf(input_ids=idx, attention_mask=mask, use_cache=False, return_dict=True).logits


class Classifier(nn.Module):
    """A BERT encoder with a classification head (`BertForSequenceClassification`): token ids
    (batch, block_size) -> class logits (batch, num_classes). `dropout` sets BERT's hidden,
    attention and classifier dropouts; HF's default is 0.1."""

    def __init__(self, vocab_size: Annotated[int, AT_LEAST_1], block_size: Annotated[int, AT_LEAST_1],
                 num_classes: Annotated[int, AT_LEAST_1], n_layer: Annotated[int, AT_LEAST_1] = 2,
                 n_head: Annotated[int, AT_LEAST_1] = 4, n_embd: Annotated[int, AT_LEAST_1] = 64,
                 dropout: Annotated[float, PROBABILITY] = 0.1):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"model.n_embd ({n_embd}) must be divisible by model.n_head ({n_head})")
        config = BertConfig(vocab_size=vocab_size, max_position_embeddings=block_size, hidden_size=n_embd,
                            num_hidden_layers=n_layer, num_attention_heads=n_head, intermediate_size=4 * n_embd,
                            hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                            classifier_dropout=dropout, num_labels=num_classes,
                            # Windows are never padded. HF's default pad id 0 is a real character here
                            # (newline): its embedding would be zeroed and never trained, and HF would
                            # warn that a batch starting or ending with one looks padded.
                            pad_token_id=None, attn_implementation=ATTENTION)
        self.hf = BertForSequenceClassification(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=idx, return_dict=True).logits
