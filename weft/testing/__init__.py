"""Test-model writers: small random-weight checkpoints in exact Hugging Face format
(``tiny_model``), their byte-level BPE tokenizer files (``tiny_tokenizer``) and the
torch-free table of what can be written (``presets``). Used by ``weft model make-tiny``,
``weft up`` without ``--model``, tests and benchmarks; no service imports them."""
