"""Constrained decoding with xgrammar: the output of a request follows a JSON schema, any
JSON object, a regex, an EBNF grammar or a structural tag.

- ``tokenizer_info.py``: the checkpoint's tokenizer as xgrammar sees it (mask width = the
  model's logits width, stop tokens = the model's EOS ids).
- ``compiler.py``: ``GrammarCache``, compiled grammars keyed by (kind, text), LRU-bounded,
  with size / depth / time limits; bad grammars -> InvalidRequestError naming the field.
- ``pattern_cost.py``: the compile cost of a schema's ``pattern`` regexes, bounded first.
- ``json_strings.py``: JSON strings that stay JSON (length-bounded strings made safe,
  patterns that would write unescaped characters refused).
- ``state.py``: ``GrammarState``, one request's matcher (``Sequence.grammar``).
- ``mask.py``: ``mask_logits``, one batched bitmask fill + apply per step, called by the
  sampler after logit bias / penalties and before temperature / top-k / top-p / min-p.

docs/constrained_decoding.md tells the whole story.
"""
from services.executor.grammar.compiler import GrammarCache, GrammarLimits
from services.executor.grammar.mask import mask_logits
from services.executor.grammar.state import GrammarState
from services.executor.grammar.tokenizer_info import load_tokenizer_info

__all__ = ["GrammarCache", "GrammarLimits", "GrammarState", "load_tokenizer_info", "mask_logits"]
