"""Write a tiny random Llama and a byte-level tokenizer into a folder, for a real engine to serve.

Run with the engine's own Python (it imports transformers and tokenizers from there):
    python tests/engines/tiny_llama.py OUT_DIR
Nothing is downloaded: the weights are random (seeded) and the tokenizer is built here, one token per
byte plus `<s>` / `</s>`, so `splitscope load --tokenizer bytes` sizes prompts exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path

SERVED_MAX_LEN = 2048  # room for the long prompt of tests/engines/test_vllm_real.py


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte symbols of byte-level BPE
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    vocab["<s>"], vocab["</s>"] = len(vocab), len(vocab) + 1
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", model_max_length=SERVED_MAX_LEN
    )


def main(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = byte_tokenizer()
    # head_dim 64: vLLM's CPU attention kernels refuse smaller heads (16 fails at the first request).
    # About 36M parameters (144 MB in float32): a decode step of 10-25 ms and an 1800-token prefill of
    # about 2 s on 2 cores. Smaller (a millisecond a step), vLLM's API server spent the cores streaming
    # tokens and admitted new requests only seconds late (tests/engines/test_vllm_real.py).
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=SERVED_MAX_LEN,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_llama.py OUT_DIR")
    main(Path(sys.argv[1]))
