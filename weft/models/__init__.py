"""Getting a real model: a checkpoint directory from a name, a GGUF file or a directory.

    sources         resolve_model(spec) / pull(name): the named sources (SmolLM2 by default),
                    what each door that takes a model calls
    cache           the model cache's mechanism: $WEFT_CACHE_DIR (else ~/.cache/weft), one
                    atomic install per entry under a lock file
    gguf_import     import_gguf(FILE, DIR): a GGUF file as a Hugging Face checkpoint
    gguf_tokenizer  tokenizer.json + special tokens from the GGUF vocabulary
    chat_templates  the chat templates shipped with an import (tools-aware)

Imports point one way: sources ──▶ cache, and (when importing) gguf_import; nothing here
imports sources.
Importing this package imports nothing (the CLI's --help stays light); numpy and the
``gguf`` package load only when a file is imported.
"""
